"""Fault-tolerant training (course_lib.checkpoint, course_lib.fault, course_lib.demos.resilient).

Bitwise resume after SIGKILLs at many different steps, on 1 and 2 ranks; what breaks when a part of the
state is left out; atomic saves (a crash in the middle leaves the previous checkpoint); truncated and
corrupted files named; fallback to the newest intact checkpoint; sharded ZeRO checkpoints resharded 4 -> 2
next to torch.distributed.checkpoint (save, async_save, load 4 -> 2); torchrun --max-restarts; no orphans.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from course_lib import checkpoint, fault
from course_lib.demos.resilient import PARTS, train
from course_lib.checkpoint import (CheckpointError, CheckpointManager, ResumableSampler, restore_training_state,
                                   training_state)
from course_lib.fault import FaultPlan, run_with_restarts
from course_lib.launch import Cluster, RankError


def test_checkpoint_holds_the_storage_and_fault_the_rest():
    """course_lib.checkpoint (storage) imports nothing else of course_lib; course_lib.fault (failures,
    restarts, goodput) holds none of checkpoint's names, so nothing is found at its old place."""
    import ast
    import inspect
    for name in checkpoint.__all__:
        assert not hasattr(fault, name), f"course_lib.fault.{name}"
    tree = ast.parse(inspect.getsource(checkpoint))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not sorted(m for m in imported if m.split(".")[0] == "course_lib")


@pytest.fixture(scope="module")
def cluster1():
    with Cluster(1, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def cluster4():
    with Cluster(4, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ the sampler
def test_sampler_resumes_mid_epoch_and_splits_batches():
    a = ResumableSampler(10, 4, seed=3)
    full = [a.next_batch() for _ in range(7)]            # crosses two epoch boundaries (2 batches each)
    b = ResumableSampler(10, 4, seed=3)
    for _ in range(3):
        b.next_batch()
    c = ResumableSampler(10, 4, seed=3)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(full[3:], [c.next_batch() for _ in range(4)]))
    assert not torch.equal(full[0], full[2])             # a new permutation each epoch
    parts = [ResumableSampler(10, 4, seed=3, rank=r, num_replicas=2).next_batch() for r in range(2)]
    assert torch.equal(torch.cat(parts), full[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=4, batch_size=5), "larger than the data set"),
    (dict(n=8, batch_size=4, num_replicas=3), "divisible by num_replicas"),
    (dict(n=0, batch_size=1), "positive int"),
    (dict(n=8, batch_size=4, rank=2, num_replicas=2), "rank must be"),
])
def test_sampler_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResumableSampler(**kwargs)


def test_sampler_state_from_another_data_order():
    s = ResumableSampler(10, 2, seed=1)
    with pytest.raises(CheckpointError, match="seed: checkpoint 1, sampler 2"):
        ResumableSampler(10, 2, seed=2).load_state_dict(s.state_dict())


# ------------------------------------------------------------------ bitwise resume after kills
def test_resume_is_bitwise_after_kills_at_ten_steps(cluster1, tmp_path):
    """One run killed (SIGKILL) at ten different steps, restarted each time, equals an uninterrupted run."""
    ref = cluster1.run(train, 0, str(tmp_path / "ref"), steps=36, every=3)[0]
    plan = FaultPlan.random(10, 36, world_size=1, seed=7)
    assert len({s for _, s in plan.failures}) == 10
    rec = run_with_restarts(cluster1, train, str(tmp_path / "run"), steps=36, every=3, plan=plan,
                            max_restarts=10)
    assert rec.attempts == 11 and len(rec.failures) == 10
    assert all(f.ranks == [0] for f in rec.failures)
    out = rec.results[0]
    assert torch.equal(out["params"], ref["params"]), "resumed run differs from the uninterrupted one"
    last_kill = plan.failures[-1][1]
    assert out["resumed_from"] == last_kill - last_kill % 3


def test_resume_on_two_ranks_with_repeated_failures_leaves_no_orphans(cluster2, tmp_path):
    ref = cluster2.run(train, 0, str(tmp_path / "ref"), steps=30, every=4)
    plan = FaultPlan([(1, 6), (0, 13), (1, 14)])
    rec = run_with_restarts(cluster2, _train_noting_pid, str(tmp_path / "run"), steps=30, every=4,
                            plan=plan, max_restarts=3)
    pids = [int(p) for p in (tmp_path / "run" / "pids").read_text().split()]
    assert len(pids) == 8
    assert [f.ranks for f in rec.failures] == [[1], [0], [1]]
    assert rec.starts == 3
    for r in range(2):
        assert torch.equal(rec.results[r]["params"], ref[r]["params"])
    assert set(pids[6:]) == set(cluster2.pids)                    # the attempt that finished
    assert not any(_alive(p) for p in pids[:6]), "a failed attempt left processes behind"


def _train_noting_pid(rank, world_size, attempt, directory, **kwargs):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    return train(rank, world_size, attempt, directory, **kwargs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("part", ["rng", "sampler", "optimizer", "scheduler"])
def test_leaving_out_a_part_of_the_state_changes_the_result(cluster1, tmp_path, part):
    ref = cluster1.run(train, 0, str(tmp_path / "ref"), steps=20, every=5)[0]
    rec = run_with_restarts(cluster1, train, str(tmp_path / "run"), steps=20, every=5,
                            plan=FaultPlan([(0, 12)]), max_restarts=1, omit=(part,))
    assert not torch.equal(rec.results[0]["params"], ref["params"]), f"omitting {part} changed nothing"


def test_restarts_used_up_raise_the_last_error(cluster1, tmp_path):
    with pytest.raises(RankError, match="SIGKILL"):
        run_with_restarts(cluster1, train, str(tmp_path), steps=20, every=5,
                          plan=FaultPlan([(0, 2), (0, 3)]), max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts"):
        run_with_restarts(cluster1, train, str(tmp_path), max_restarts=-1)
    with pytest.raises(ValueError, match="must increase"):
        FaultPlan([(0, 5), (0, 5)])
    with pytest.raises(ValueError, match="unknown parts"):
        train(0, 1, 0, str(tmp_path), omit=("weights",))


# ------------------------------------------------------------------ atomic, verified files
def _state(seed=0, hidden=8):
    from course_lib.models import TinyMLP
    torch.manual_seed(seed)
    m = TinyMLP(4, hidden, 1, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_training_state_round_trip_and_rng(tmp_path):
    m, opt = _state()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(5, training_state(m, opt, step=5))
    expected = torch.rand(3)
    m2, opt2 = _state(seed=1)
    assert restore_training_state(mgr.load(), m2, opt2) == 5
    assert torch.equal(torch.rand(3), expected), "the torch RNG was not restored"
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


class _Anything:
    """An object whose unpickling would import and build it: a checkpoint must not hold one."""


def test_numpy_and_python_rng_come_back_and_files_load_without_running_code(tmp_path):
    """Loading is weights_only: numpy's RNG state travels as a tensor; an arbitrary object is refused."""
    import random
    import numpy as np
    m, opt = _state()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    np.random.seed(3); random.seed(4)
    mgr.save(1, training_state(m, opt, step=1))
    want = (np.random.standard_normal(3), random.random())
    np.random.seed(99); random.seed(99)
    restore_training_state(mgr.load(), m, opt)
    assert np.array_equal(np.random.standard_normal(3), want[0]) and random.random() == want[1]
    mgr.save(2, training_state(m, opt, step=2, extra={"thing": _Anything()}))
    with pytest.raises(CheckpointError, match="not a tensor, a number, a string"):
        mgr.load(2)


def test_cuda_rng_states_are_saved_and_restored_when_the_process_uses_cuda(monkeypatch):
    """No GPU here: torch.cuda's RNG calls are replaced by stand-ins that hand out and record states."""
    m, opt = _state()                                   # before the stand-ins (manual_seed asks CUDA too)
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = training_state(m, opt, step=3)
    assert [t.tolist() for t in state["rng"]["cuda"]] == [[1, 2], [3, 4]]
    assert restore_training_state(state, m, opt) == 3
    assert [t.tolist() for t in restored[0]] == [[1, 2], [3, 4]]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CheckpointError, match=r"RNG states of 2 CUDA device\(s\) but this process sees 1"):
        restore_training_state(state, m, opt)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)   # never used CUDA: nothing drawn
    assert "cuda" not in checkpoint.rng_state()


def test_checkpoint_from_another_model_names_the_keys(tmp_path):
    from course_lib.models import TinyMLP
    m, opt = _state()
    state = training_state(m, opt, step=1)
    other = TinyMLP(4, 9, 1, 3)
    with pytest.raises(CheckpointError, match=r"missing keys \['layers.2.bias', 'layers.2.weight'\].*"
                                              r"shape mismatches \['layers.0.bias: checkpoint \(8,\), model \(9,\)"):
        restore_training_state(state, other, torch.optim.Adam(other.parameters()))
    with pytest.raises(CheckpointError, match="no scheduler state"):
        restore_training_state(state, m, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(CheckpointError, match="not a course_lib.checkpoint training state"):
        restore_training_state({"model": {}}, m, opt)
    with pytest.raises(ValueError, match="step must be"):
        training_state(m, opt, step=-1)


def test_corrupted_and_truncated_files_are_named_and_skipped(tmp_path):
    m, opt = _state()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for s in (1, 2, 3):
        mgr.save(s, training_state(m, opt, step=s))
    f3, f2 = mgr.path(3) / "state.pt", mgr.path(2) / "state.pt"
    data = bytearray(f3.read_bytes())
    data[len(data) // 2] ^= 0xFF                          # one flipped bit pattern, same size
    f3.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_00000003/state.pt: corrupted: SHA-256"):
        mgr.verify(3)
    f2.write_bytes(f2.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step_00000002/state.pt: truncated .*100 bytes"):
        mgr.verify(2)
    with pytest.warns(RuntimeWarning) as caught:
        assert mgr.latest() == 1
    assert [str(w.message)[:27] for w in caught] == ["skipping checkpoint step 3:", "skipping checkpoint step 2:"]
    assert [s for s, _ in mgr.skipped] == [3, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.load()["step"] == 1
    with pytest.raises(CheckpointError, match="does not exist"):
        mgr.verify(7)
    with pytest.raises(CheckpointError, match="no file 'other.pt'"):
        mgr.load(1, "other.pt")


def test_keep_last_and_unfinished_saves(tmp_path):
    m, opt = _state()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.write_file(1, "state.pt", {"x": 1})                 # written but never committed
    for s in (2, 3, 4):
        mgr.save(s, training_state(m, opt, step=s))
    assert mgr.steps() == [3, 4]
    assert not mgr.path(1).exists() and not mgr.path(2).exists()
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="plain name"):
        mgr.write_file(5, "../x.pt", 1)


CRASH = textwrap.dedent("""
    import sys, torch
    from course_lib.checkpoint import CheckpointManager, atomic_save
    from course_lib.fault import kill_self
    where, d = sys.argv[1], sys.argv[2]
    big = {"w": torch.arange(6_000_000, dtype=torch.float32)}      # 24 MB: six 4 MiB chunks
    if where == "mid-file":
        atomic_save(big, d + "/file.pt", on_chunk=lambda n: kill_self() if n > 8 << 20 else None)
    else:
        def crash(event, **info):
            if event == where:
                kill_self()
        CheckpointManager(d, keep_last=2, on_event=crash).save(2, big)
""")


@pytest.mark.parametrize("where", ["mid-file", "file-written", "before-manifest"])
def test_a_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, where):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, {"w": torch.zeros(3)})
    checkpoint.atomic_save({"old": 1}, tmp_path / "file.pt")
    before = (tmp_path / "file.pt").read_bytes()
    proc = subprocess.run([sys.executable, "-c", CRASH, where, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / "file.pt").read_bytes() == before      # never half-replaced
    assert mgr.latest() == 1 and torch.equal(mgr.load()["w"], torch.zeros(3))
    mgr.save(3, {"w": torch.ones(3)})                         # the unfinished step 2 is cleaned up
    assert not mgr.path(2).exists() and mgr.steps() == [1, 3]


# ------------------------------------------------------------------ sharded: ZeRO and DCP, 4 -> 2
def _zero_model(seed):
    from course_lib.models import TinyMLP
    torch.manual_seed(seed)
    return TinyMLP(5, 6, 1, 3)      # 85 parameters: the shards of 4 and of 2 ranks cut differently


def _batch():
    from course_lib.models import make_regression
    return make_regression(16, 5, 1, seed=1)


def _zero_train(z, rank, world, steps):
    X, y = _batch()
    n = X.shape[0] // world
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(z(X[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        z.step()
        z.zero_grad()


def _zero_save(rank, world, directory, stage, steps, more):
    from course_lib.checkpoint import CheckpointManager, save_sharded
    from course_lib.zero import ZeRO
    z = ZeRO(_zero_model(0), stage, lr=1e-2)
    _zero_train(z, rank, world, steps)
    save_sharded(CheckpointManager(directory), steps, {**z.sharded_state_dict(), "local": {"rank": rank}})
    saved = z.gather_full_parameters()
    _zero_train(z, rank, world, more)
    return saved, z.gather_full_parameters()


def _zero_load(rank, world, directory, stage, more):
    from course_lib.checkpoint import CheckpointManager, load_sharded
    from course_lib.zero import ZeRO
    z = ZeRO(_zero_model(1), stage, lr=1e-2)             # different initial values: all must be loaded
    ck = load_sharded(CheckpointManager(directory))
    z.load_sharded_state_dict(ck.fetch, ck.replicated)
    loaded = z.gather_full_parameters()
    _zero_train(z, rank, world, more)
    return loaded, z.gather_full_parameters(), ck.files_read, ck.local(rank), ck.step


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_sharded_checkpoint_reshards_4_to_2(cluster4, cluster2, tmp_path, stage):
    saved = cluster4.run(_zero_save, str(tmp_path), stage, 3, 2)
    again = cluster4.run(_zero_load, str(tmp_path), stage, 2)
    for r in range(4):        # same world size: resuming is bitwise
        assert all(torch.equal(a, b) for a, b in zip(again[r][0], saved[r][0]))
        assert all(torch.equal(a, b) for a, b in zip(again[r][1], saved[r][1]))
        assert again[r][3] == {"rank": r} and again[r][4] == 3
    two = cluster2.run(_zero_load, str(tmp_path), stage, 2)
    for r in range(2):        # 4 -> 2: the loaded values are exact, later steps sum in another order
        assert all(torch.equal(a, b) for a, b in zip(two[r][0], saved[0][0]))
        for a, b in zip(two[r][1], saved[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # rank 0 of 2 needs the first half of every unit: 4-rank shards 0 and 1 hold it, 2 and 3 are not read
    assert sorted(two[0][2]) == ["shard_00000_of_00004.pt", "shard_00001_of_00004.pt"], two[0][2]


def _save_two_steps(rank, world, directory):
    """Sharded checkpoints of steps 1 and 2, every rank its own file."""
    from course_lib.checkpoint import CheckpointManager, save_sharded
    manager = CheckpointManager(directory)
    for step in (1, 2):
        save_sharded(manager, step, {"shards": {"w": (4 * rank, torch.full((4,), float(step)))},
                                     "lengths": {"w": 4 * world}})


def _agree_recording_hashes(rank, world, directory):
    """agreed_latest, with every file this rank hashes recorded: (step, hashed, skipped, warnings)."""
    from course_lib import checkpoint
    real, hashed = checkpoint.file_sha256, []

    def recording(path):
        hashed.append(os.path.basename(path))
        return real(path)

    checkpoint.file_sha256 = recording
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            manager = checkpoint.CheckpointManager(directory)
            step = checkpoint.agreed_latest(manager)
    finally:
        checkpoint.file_sha256 = real
    return step, hashed, manager.skipped, [str(w.message) for w in warned]


def _load_step(rank, world, directory, step):
    from course_lib.checkpoint import CheckpointManager, load_sharded
    load_sharded(CheckpointManager(directory), step)


def test_restart_verification_is_split_over_the_ranks(cluster4, cluster2, tmp_path):
    """Before a restart every rank hashes the shard files it wrote (rank 0 used to hash them all: at a
    175B model's 2-3 TB, the whole restart); a bad shard is named with the rank that found it."""
    d = str(tmp_path)
    cluster4.run(_save_two_steps, d)
    for r, (step, hashed, skipped, warned) in enumerate(cluster4.run(_agree_recording_hashes, d)):
        assert step == 2 and not skipped and not warned
        assert hashed == [f"shard_{r:05d}_of_00004.pt"], (r, hashed)       # its own file of step 2, once
    # saved on 4 ranks, checked on 2: the writers' files dealt out, two each
    hashed = [h for _, h, _, _ in cluster2.run(_agree_recording_hashes, d)]
    assert hashed == [["shard_00000_of_00004.pt", "shard_00002_of_00004.pt"],
                      ["shard_00001_of_00004.pt", "shard_00003_of_00004.pt"]], hashed
    # one flipped bit in rank 1's shard of step 2: rank 1 finds it, every rank falls back to step 1
    bad = tmp_path / "step_00000002" / "shard_00001_of_00004.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    for r, (step, hashed, skipped, warned) in enumerate(cluster4.run(_agree_recording_hashes, d)):
        assert step == 1 and [s for s, _ in skipped] == [2], (r, step, skipped)
        why = skipped[0][1]
        assert why.startswith("rank 1 of 4: ") and "shard_00001_of_00004.pt: corrupted: SHA-256" in why, why
        assert hashed == [f"shard_{r:05d}_of_00004.pt"] * 2, (r, hashed)   # step 2's file, then step 1's
        assert len(warned) == (r == 0) and (r or "skipping checkpoint step 2: rank 1 of 4" in warned[0])
    # asked for by step: refused on every rank, with the file and the rank that found it
    with pytest.raises(RankError) as e:
        cluster2.run(_load_step, d, 2)
    assert e.value.ranks == [0, 1]
    assert "rank 1 of 2: " in str(e.value) and "shard_00001_of_00004.pt: corrupted" in str(e.value)


def test_who_verifies_which_file():
    """The writer the manifest records (modulo the group's size); files without one in name order."""
    manifest = {"files": {"b.pt": {}, "a.pt": {}, "shard_3.pt": {"rank": 3}, "shard_0.pt": {"rank": 0}}}
    assert checkpoint._verifiers(manifest, 4) == {"a.pt": 0, "b.pt": 1, "shard_0.pt": 0, "shard_3.pt": 3}
    assert checkpoint._verifiers(manifest, 2) == {"a.pt": 0, "b.pt": 1, "shard_0.pt": 0, "shard_3.pt": 1}
    assert set(checkpoint._verifiers(manifest, 1).values()) == {0}


def test_zero_sharded_checkpoint_from_another_model(cluster2, tmp_path):
    def save(rank, world, d):
        from course_lib.checkpoint import CheckpointManager, save_sharded
        from course_lib.zero import ZeRO
        save_sharded(CheckpointManager(d), 1, ZeRO(_zero_model(0), 1).sharded_state_dict())

    def load_other(rank, world, d):
        from course_lib.checkpoint import CheckpointManager, load_sharded
        from course_lib.models import TinyMLP
        from course_lib.zero import ZeRO
        z = ZeRO(TinyMLP(5, 6, 1, 2), 1)
        ck = load_sharded(CheckpointManager(d))
        z.load_sharded_state_dict(ck.fetch, ck.replicated)

    cluster2.run(save, str(tmp_path))
    with pytest.raises(RankError, match="different model"):
        cluster2.run(load_other, str(tmp_path))


def _fsdp(seed):
    from torch.distributed.fsdp import fully_shard
    model = _zero_model(seed)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _dcp_save(rank, world, directory, use_async):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _fsdp(0)
    X, y = _batch()
    n = X.shape[0] // world
    for _ in range(3):
        torch.nn.functional.mse_loss(model(X[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, f"rng_rank{rank}": torch.get_rng_state()}   # per-rank key
    if use_async:
        dcp.async_save(state, checkpoint_id=directory).result()
    else:
        dcp.save(state, checkpoint_id=directory)
    return _full(model)


def _dcp_load(rank, world, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fsdp(1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model)


@pytest.mark.parametrize("use_async", [False, True])
def test_dcp_reshards_4_to_2(cluster4, cluster2, tmp_path, use_async):
    saved = cluster4.run(_dcp_save, str(tmp_path), use_async)
    loaded = cluster2.run(_dcp_load, str(tmp_path))
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(loaded[r], saved[0]))


# ------------------------------------------------------------------ torchrun --max-restarts
# The run under `torchrun --max-restarts=3` with two SIGKILLs, resumed bit for bit, is notebook 12's cell
# (section "torchrun"), which `make test` runs under nbval with the same checks (the final sha256 equals an
# uninterrupted run's, both ranks resumed from step 12, the manifest names 2 ranks): one run, not two.


def test_resilient_demo_bad_input():
    from course_lib.demos.resilient import parse_fail_at
    with pytest.raises(SystemExit, match="RANK:STEP"):
        parse_fail_at("1-12")
    assert parse_fail_at("1:12, 0:23").failures == [(1, 12), (0, 23)]
    assert set(PARTS) == {"optimizer", "scheduler", "scaler", "sampler", "rng"}


# ------------------------------------------------------------------ how often to save
def test_goodput_formula_matches_simulation_and_young_daly():
    d, m, r = 60.0, 3600.0, 30.0
    tau = fault.young_daly_interval(d, m)
    assert tau == pytest.approx((2 * d * m) ** 0.5)
    for t in (tau / 4, tau, 4 * tau):
        mean, se = fault.simulate_goodput(30 * m, t, d, m, r, runs=300)
        assert abs(mean - fault.expected_goodput(t, d, m, r)) < 5 * se + 2e-3
    grid = [tau * k / 100 for k in range(20, 400)]
    best = max(grid, key=lambda t: fault.expected_goodput(t, d, m, r))
    assert abs(best - fault.daly_interval(d, m)) / best < 0.03      # Daly's higher-order optimum
    assert abs(best - tau) / tau < 0.1                              # Young's first-order one
    assert fault.cluster_failures_per_day(16384, 16384 * 54 * 24 / 419) == pytest.approx(419 / 54)
    assert fault.cluster_mtbf_hours(1000, 1e5) == 100
    with pytest.raises(ValueError, match="mtbf_seconds"):
        fault.young_daly_interval(1, 0)


def test_a_directory_that_cannot_be_fsynced_is_said_once(tmp_path, monkeypatch):
    """_fsync_dir used to swallow the error; now a file system that cannot fsync a directory gets one
    warning naming the directory and the reason, and the save still completes."""
    import course_lib.checkpoint as F

    def refuse(fd):
        raise OSError(22, "Invalid argument")

    real = F.os.fsync

    def fsync(fd):                                          # files as usual, directories refused
        return refuse(fd) if F.os.path.isdir(f"/proc/self/fd/{fd}") else real(fd)

    monkeypatch.setattr(F.os, "fsync", fsync)
    monkeypatch.setattr(F, "_FSYNC_WARNED", set())
    with pytest.warns(RuntimeWarning, match=r"cannot fsync directory .*Invalid argument"):
        F.atomic_save({"x": 1}, tmp_path / "a.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.atomic_save({"x": 2}, tmp_path / "b.pt")          # the same directory: said once
    assert torch.load(tmp_path / "b.pt") == {"x": 2}
