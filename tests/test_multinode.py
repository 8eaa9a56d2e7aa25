"""Two "nodes" on this machine: two ``torchrun --nnodes=2 --node_rank=i`` invocations, 2 processes each.

What an instructor types on two real nodes, with the c10d rendezvous on 127.0.0.1 instead of node 0's
address and gloo instead of NCCL. Runs :mod:`course_lib.demos.hello` end to end (4 ranks, broadcast and
all-reduce across both "nodes"), then rehearses a lost process (``--die-rank 3`` kills itself with
SIGKILL): both torchrun agents must report the failure and exit within the timeout, and no process of
the job may be left behind (each job's processes carry a unique environment tag that is looked for in
``/proc`` afterwards).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from course_lib.launch import pids_with_env

TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB_TIMEOUT = 120  # seconds for a whole 2-node job; it needs about 10 s on 2 idle cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``COURSE_TEST_TAG=tag`` (the job's agents and workers)."""
    return pids_with_env(f"COURSE_TEST_TAG={tag}")


def run_two_nodes(*demo_args: str) -> tuple[list[subprocess.CompletedProcess], float]:
    """Start node 0 and node 1 at once; wait for both; return their results and the wall time.

    Both agents run on this machine, so node 0 is told to host the rendezvous store (``is_host``) and
    node 1 never tries: left to guess, both match 127.0.0.1 and race for the port. Once, when the job did
    not get going (neither node reached the store, ``RendezvousConnectionError`` on both, or it hung), it
    is started again on a new port: the port can be taken by another process of the suite between
    ``free_port()`` and torchrun's bind, and a loaded machine slows the store (seen in 2 of 4 full runs
    on 2026-12-05, each passing when run alone). That is the test's set-up failing, not what it tests; a
    second failure fails the test."""
    out = _run_two_nodes_once(*demo_args)
    if out is None or all("RendezvousConnectionError" in r.stderr for r in out[0]):
        out = _run_two_nodes_once(*demo_args)
    if out is None:
        pytest.fail(f"the 2-node job did not finish within {JOB_TIMEOUT} s, twice (a hang)")
    return out


def _run_two_nodes_once(*demo_args: str) -> tuple[list[subprocess.CompletedProcess], float] | None:
    """One start of the 2-node job: the results and the wall time, or None when it hung (killed)."""
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun not found next to {sys.executable}")
    tag, port = uuid.uuid4().hex, free_port()
    env = {**os.environ, "COURSE_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    procs = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes=2", f"--node_rank={i}", "--nproc_per_node=2", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=test-{tag[:8]}",
         f"--rdzv-conf=join_timeout=60,is_host={int(i == 0)}",
         "--max-restarts=0", "--monitor-interval=0.5", "-m", "course_lib.demos.hello", *demo_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for i in (0, 1)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, JOB_TIMEOUT - (time.monotonic() - t0)))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        for pid in tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
        return None
    wall = time.monotonic() - t0
    # workers killed by their agent may need a moment to be reaped
    left = pids_with_env(f"COURSE_TEST_TAG={tag}", within=10)
    assert not left, f"processes of the job left behind: {left}"
    return results, wall


def test_two_nodes_run_the_demo_end_to_end():
    (node0, node1), wall = run_two_nodes("--size", "3")
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-3000:] + node1.stderr[-3000:]
    lines = [line for line in (node0.stdout + node1.stdout).splitlines() if line.startswith("[rank ")]
    ranks = sorted(int(re.match(r"\[rank (\d+)/4 ", line).group(1)) for line in lines)
    assert ranks == [0, 1, 2, 3], lines
    # Ranks 0, 1 run on node 0 and 2, 3 on node 1 (torchrun assigns ranks by node order).
    assert all(re.match(r"\[rank [01]/4 ", x) for x in node0.stdout.splitlines() if x.startswith("[rank "))
    assert all(re.match(r"\[rank [23]/4 ", x) for x in node1.stdout.splitlines() if x.startswith("[rank "))
    for line in lines:
        assert "via gloo" in line and line.endswith(" OK"), line
        assert "after_broadcast=[0.0, 1.0, 2.0]" in line, line             # rank 0's tensor
        assert "after_all_reduce=[10.0, 10.0, 10.0]" in line, line         # 1 + 2 + 3 + 4
    print(f"2 nodes x 2 processes: {wall:.1f} s")


def test_a_dead_process_on_one_node_stops_both_nodes():
    (node0, node1), wall = run_two_nodes("--die-rank", "3")
    assert node1.returncode != 0 and node0.returncode != 0, (node0.returncode, node1.returncode)
    assert "--die-rank 3: killing myself" in node1.stdout
    # Node 1's agent names the dead rank and the signal; node 0's reports its own ranks failing.
    assert re.search(r"rank\s*: 3 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", node1.stderr), node1.stderr[-3000:]
    assert "SIGKILL" in node1.stderr
    # Node 0 either reports its own ranks failing (their gloo peers vanished) or, when node 1's agent
    # hosted the rendezvous store (the first agent to bind the port does), that the store is gone.
    assert ("course_lib.demos.hello FAILED" in node0.stderr
            or "connection to the C10d store has failed" in node0.stderr), node0.stderr[-3000:]
    assert not any(" OK" in x for x in node0.stdout.splitlines()), node0.stdout
    print(f"failure detected and both nodes exited in {wall:.1f} s")


def test_die_rank_outside_the_job_is_a_clear_error():
    (node0, node1), _ = run_two_nodes("--die-rank", "7")
    assert node0.returncode != 0 and node1.returncode != 0
    assert "--die-rank 7 is not a rank of this job (0..3)" in node0.stderr + node1.stderr


def test_gpu_selftest_runs_on_cpu_under_torchrun():
    """The instructors' self-test on 2 gloo ranks: a table of sizes with algbw/busbw, PASS, exit 0."""
    r = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "course_lib.demos.selftest",
                        "--max-bytes", "65536", "--iters", "2"], capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "backend gloo, 2 ranks" in r.stdout and r.stdout.rstrip().endswith("PASS"), r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(x[0]) for x in rows] == [1024, 8192, 65536]
    for size, us, alg, bus, res in rows:
        assert res == "ok" and float(alg) == float(bus)  # 2 ranks: busbw = algbw * 2 (2 - 1) / 2


def test_selftest_bandwidth_terms_and_fail_verdict():
    from course_lib.demos.selftest import bandwidths, report
    assert bandwidths(8_000, 1e-3, 4) == (8e6, 8e6 * 1.5)  # nccl-tests: busbw = algbw * 2 (n - 1) / n
    res = {"backend": "gloo", "device": "cpu", "gpus": 0,
           "rows": [{"bytes": 1024, "seconds": 1e-4, "ok": True}, {"bytes": 8192, "seconds": 2e-4, "ok": False}]}
    text, ok = report(res, 4)
    assert not ok and "WRONG" in text and text.rstrip().endswith("FAIL: an all-reduce gave a wrong result")
