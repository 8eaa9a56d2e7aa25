"""The virtual cluster: results, warm workers, every failure mode, output, torchrun, JAX devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from course_lib.launch import Cluster, RankError, init_from_env, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- worker functions (importable: shipped by reference; notebook functions are tested below) ----
def all_reduce_rank(rank, world_size, n):
    import torch
    import torch.distributed as dist

    t = torch.full((n,), float(rank))
    dist.all_reduce(t)
    return t.tolist()


def whoami(rank, world_size):
    import os

    return rank, world_size, os.getpid()


def raise_on(rank, world_size, bad_rank):
    import torch.distributed as dist

    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the healthy ranks block here, waiting for the failed one
    return rank


def exit_on(rank, world_size, bad_rank, how):
    import os
    import signal

    if rank == bad_rank:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def mismatched_collectives(rank, world_size):
    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # nobody else joins: a hang
    return rank


def chatty(rank, world_size):
    import sys

    print("x" * 5000 + f"|end of rank {rank}")
    print(f"second line from rank {rank}", file=sys.stderr)
    return rank


def unpicklable_result(rank, world_size):
    import threading

    return threading.Lock()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): check its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_all_gone(pids, within=5.0):
    end = time.monotonic() + within
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], f"worker processes left behind: {pids}"


@pytest.fixture(scope="module")
def cluster():
    with Cluster(3, timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------------- results
def test_run_returns_values_in_rank_order():
    assert run(all_reduce_rank, 2, 3) == [[1.0, 1.0, 1.0]] * 2


def test_world_size_one():
    assert run(whoami, 1)[0][:2] == (0, 1)


def test_cluster_reuses_warm_workers(cluster):
    first = cluster.run(whoami)
    second = cluster.run(whoami)
    assert [r[:2] for r in first] == [(0, 3), (1, 3), (2, 3)]
    assert [r[2] for r in first] == [r[2] for r in second] == cluster.pids
    assert cluster.run(all_reduce_rank, 2) == [[3.0, 3.0]] * 3


def test_keyword_arguments_reach_fn(cluster):
    def scaled(rank, world_size, base, scale=1, timeout_like=None):
        return (base + rank) * scale, timeout_like

    assert cluster.run(scaled, 10, scale=2, timeout_like="kw", timeout=30) == [(20, "kw"), (22, "kw"), (24, "kw")]
    assert run(scaled, 1, 5, scale=3) == [(15, None)]


def test_lambda_and_closure_are_shipped_by_value(cluster):
    offset = 100
    assert cluster.run(lambda rank, ws: rank + offset) == [100, 101, 102]


# ---------------------------------------------------------------------------------- failures
def test_exception_names_rank_and_carries_traceback_then_recovers(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(raise_on, 1, timeout=30)
    err = info.value
    assert err.ranks == [1]
    assert "deliberate failure on rank 1" in err.failures[1]
    assert "Traceback" in err.failures[1] and "raise_on" in err.failures[1]
    assert "rank(s) 1" in str(err)
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3


def test_exception_on_every_rank_keeps_workers(cluster):
    def fail_everywhere(rank, ws):
        raise KeyError(f"rank {rank}")

    pids = cluster.pids
    with pytest.raises(RankError) as info:
        cluster.run(fail_everywhere)
    assert info.value.ranks == [0, 1, 2]
    assert cluster.pids == pids, "all ranks answered, so the workers should have been kept"
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3


@pytest.mark.parametrize("how,code", [("exit", "code 7"), ("kill", "SIGKILL")])
def test_dead_rank_reports_exit_code_and_recovers(cluster, how, code):
    old = cluster.pids
    with pytest.raises(RankError) as info:
        cluster.run(exit_on, 2, how, timeout=30)
    assert info.value.ranks == [2]
    assert code in info.value.failures[2]
    assert_all_gone(old)
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3
    assert not set(old) & set(cluster.pids)


def test_hang_times_out_and_leaves_no_process(cluster):
    old = cluster.pids
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 2 s on rank\(s\) \[0\]"):
        cluster.run(mismatched_collectives, timeout=2)
    assert time.monotonic() - start < 10
    assert_all_gone(old)
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3


def test_rank_killed_between_calls_is_replaced(cluster):
    import signal

    victim = cluster.pids[1]
    os.kill(victim, signal.SIGKILL)
    # A killed process is gone only once the kernel has torn down all its threads (gloo has
    # several); /proc shows it as a zombie earlier. exit_codes reports it once it can be reaped.
    end = time.monotonic() + 10
    while cluster.exit_codes[1] is None and time.monotonic() < end:
        time.sleep(0.05)
    assert cluster.exit_codes == [None, -signal.SIGKILL, None]
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3
    assert victim not in cluster.pids


def test_unpicklable_return_names_rank(cluster):
    with pytest.raises(RankError, match="return value of rank 0 could not be pickled"):
        cluster.run(unpicklable_result)
    assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3


def test_unpicklable_argument_is_a_clear_type_error(cluster):
    with pytest.raises(TypeError, match="could not be pickled"):
        cluster.run(whoami, threading.Lock())


def test_close_leaves_no_process():
    c = Cluster(2)
    pids = c.pids
    assert all(alive(p) for p in pids)
    c.close()
    assert_all_gone(pids)
    c.close()  # twice is fine


def test_two_clusters_coexist(cluster):
    with Cluster(2) as other:
        assert other.run(all_reduce_rank, 1) == [[1.0]] * 2
        assert cluster.run(all_reduce_rank, 1) == [[3.0]] * 3
        assert not set(other.pids) & set(cluster.pids)


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("ws,exc,msg", [(0, ValueError, "at least 1"), (-2, ValueError, "at least 1"),
                                        ("2", TypeError, "must be an int"), (2.0, TypeError, "must be an int")])
def test_bad_world_size(ws, exc, msg):
    with pytest.raises(exc, match=msg):
        run(whoami, ws)


def test_nccl_without_enough_gpus_is_explained():
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        Cluster(n + 1, backend="nccl")


def test_backend_none_is_gloo_even_with_gpus_and_torchrun_picks_nccl(monkeypatch):
    """Cluster(n) runs CPU processes over gloo on a machine with GPUs too (the notebooks' rank code makes
    CPU tensors); backend="nccl" asks for the GPUs; init_from_env (torchrun) still picks NCCL when every
    rank of the node has a GPU. No GPU here: torch.cuda reports 4 of them."""
    import torch

    from course_lib import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch._resolve_backend(None, 1) == launch._resolve_backend(None, 4) == "gloo"
    assert launch._resolve_backend("nccl", 4) == "nccl" and launch._resolve_backend("GLOO", 4) == "gloo"
    with pytest.raises(ValueError, match="world_size=5 but 4 GPU"):
        launch._resolve_backend("nccl", 5)
    assert launch._torchrun_backend(4) == "nccl" and launch._torchrun_backend(8) == "gloo"


def test_nccl_results_travel_as_cpu_tensors_of_the_same_kind():
    """What an NCCL rank sends back (course_lib._worker._dumps(..., to_cpu=True)): every tensor as a CPU
    copy, parameters still parameters, requires_grad kept, a tensor with a graph as a leaf (as pickle)."""
    import cloudpickle
    import torch

    from course_lib._worker import _dumps

    value = {"w": torch.nn.Parameter(torch.ones(2)), "xs": [torch.arange(3.0), (torch.zeros(1, 2),)],
             "leaf": torch.ones(2, requires_grad=True), "n": 3}
    back = cloudpickle.loads(_dumps(value, to_cpu=True))
    assert type(back["w"]) is torch.nn.Parameter and back["w"].requires_grad and back["w"].device.type == "cpu"
    assert torch.equal(back["xs"][0], torch.arange(3.0)) and back["xs"][1][0].shape == (1, 2)
    assert back["leaf"].requires_grad and back["leaf"].is_leaf and back["n"] == 3
    y = cloudpickle.loads(_dumps(value["leaf"] * 2, to_cpu=True))
    assert y.is_leaf and y.requires_grad and torch.equal(y.detach(), torch.full((2,), 2.0))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be"):
        Cluster(2, backend="mpi-please")


def test_non_callable(cluster):
    with pytest.raises(TypeError, match="must be a callable"):
        cluster.run(42)
    with pytest.raises(TypeError, match="must be a callable"):
        run("not a function", 2)


# ---------------------------------------------------------------------------------- output
def test_rank_output_is_prefixed_whole_and_ordered(cluster, capsys):
    cluster.run(chatty)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6, out
    for r in range(3):
        assert out[2 * r] == f"[rank {r}] " + "x" * 5000 + f"|end of rank {r}"
        assert out[2 * r + 1] == f"[rank {r}] second line from rank {r}"


def test_live_output_lines_are_whole(capsys):
    with Cluster(2, output="live") as c:
        c.run(chatty)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert sorted(lines) == sorted(
        [f"[rank {r}] " + "x" * 5000 + f"|end of rank {r}" for r in range(2)]
        + [f"[rank {r}] second line from rank {r}" for r in range(2)])


def test_output_of_failing_rank_is_not_lost(cluster, capsys):
    def talk_then_fail(rank, ws):
        print(f"about to fail on {rank}")
        raise RuntimeError("nope")

    with pytest.raises(RankError):
        cluster.run(talk_then_fail)
    out = capsys.readouterr().out
    for r in range(3):
        assert f"[rank {r}] about to fail on {r}" in out


# ---------------------------------------------------------------------------------- notebook, torchrun, JAX
def test_function_defined_in_a_real_notebook():
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(textwrap.dedent("""
            from course_lib.launch import Cluster
            SCALE = 10
            def scaled_rank(rank, world_size):
                import torch, torch.distributed as dist
                t = torch.tensor([float(rank * SCALE)])
                dist.all_reduce(t)
                print("hello from", rank)
                return t.item()
            with Cluster(2) as c:
                print(c.run(scaled_rank))
        """)),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": REPO}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "[rank 0] hello from 0\n[rank 1] hello from 1\n[10.0, 10.0]" in text, text


def test_torchrun_runs_the_same_worker_function():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "course_lib.demos.hello"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"[rank {r}/2 on cpu via gloo]" in proc.stdout and "after_all_reduce=[3.0, 3.0, 3.0, 3.0] OK" in proc.stdout


def test_init_from_env_outside_torchrun_is_explained(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_from_env()


def test_jax_cpu_devices_in_a_fresh_process():
    code = textwrap.dedent("""
        from course_lib.launch import jax_cpu_devices
        devs = jax_cpu_devices(8)
        import jax, jax.numpy as jnp
        print(len(devs), jax.device_count("cpu"), float(jnp.ones(3).sum()))
        print(len(jax_cpu_devices(4)))
        try:
            jax_cpu_devices(16)
        except RuntimeError as e:
            print("ERR", e)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "8 8 3.0"
    assert lines[1] == "4"
    assert lines[2].startswith("ERR JAX is already initialised with 8 CPU device(s) but 16 were asked for")


def test_xla_flags_only_when_the_installed_xla_knows_them():
    from course_lib.launch import xla_flag_known

    assert xla_flag_known("xla_force_host_platform_device_count")
    assert not xla_flag_known("xla_cpu_flag_that_no_xla_has_h4c")
    # an XLA that knows none of the optional flags (an older jaxlib) gets only the device count
    code = textwrap.dedent("""
        import os
        import course_lib.launch as L
        L.xla_flag_known = lambda name: False
        devs = L.jax_cpu_devices(4)
        print(len(devs), os.environ["XLA_FLAGS"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4", "--xla_force_host_platform_device_count=4"], proc.stdout


def test_jax_collective_that_waits_too_long_ends_with_a_message():
    # device 0 reaches the psum 60 s late: a stand-in for a participant that never starts
    code = textwrap.dedent("""
        import time
        import numpy as np
        from course_lib.launch import jax_cpu_devices
        devs = jax_cpu_devices(4, collective_timeout_s=2)
        import jax, jax.numpy as jnp
        from jax.sharding import Mesh, PartitionSpec as P
        def late(i):
            if int(i) == 0:
                time.sleep(60)
            return np.float32(0)
        def body(x):
            y = jax.pure_callback(late, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("i"))
            return jax.lax.psum(x + y, "i")
        f = jax.jit(jax.shard_map(body, mesh=Mesh(devs, ("i",)), in_specs=P("i"), out_specs=P("i")))
        print(f(jnp.ones(4)))
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=REPO)
    assert proc.returncode != 0, "the late device should have ended the run, not let it finish"
    assert time.monotonic() - t0 < 50
    assert "Termination timeout" in proc.stderr and "Expected 4 threads to join" in proc.stderr, proc.stderr[-2000:]


def _parent(rank, world_size):
    import os
    return os.getppid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank template is Linux only")
def test_ranks_fork_from_the_template_and_can_start_as_interpreters():
    from course_lib.launch import _Zygote
    with Cluster(2) as c:
        parents = c.run(_parent)
    z = _Zygote.get()
    assert z is not None and parents == [z.pid, z.pid] and z.pid != os.getpid()
    code = ("from course_lib.launch import Cluster\nimport os\n"
            "with Cluster(2) as c:\n    print(c.run(lambda r, w: os.getppid()) == [os.getpid()] * 2)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COURSE_NO_ZYGOTE": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stdout + out.stderr[-2000:]


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs /proc (Linux)")
def test_pids_with_env_finds_a_tagged_process_until_it_is_gone():
    import subprocess
    from course_lib.launch import pids_with_env
    tag = f"COURSE_TEST_TAG=pids-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         env={**os.environ, tag.split("=")[0]: tag.split("=", 1)[1]})
    try:
        deadline = time.monotonic() + 10
        while not (found := pids_with_env(tag)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == [p.pid]                       # the child; never this process
    finally:
        p.kill()
        p.wait()
    assert pids_with_env(tag, within=5) == []
    with pytest.raises(ValueError, match="NAME=value"):
        pids_with_env("COURSE_TEST_TAG")
