"""The course's techniques on CUDA GPUs under NCCL: the library part of ``make test-gpu``.

Every other test file runs its ranks as CPU processes with gloo. Here the same modules run with NCCL,
rank ``r`` on ``cuda:r``, every tensor created on ``course_lib.launch.device()``, each check the one
of the technique's CPU test file at a small size (a few seconds on a GPU):

* one GPU, world size 1: the course's collectives (equal to NCCL's, on the same device), data
  parallelism, ZeRO 1/2/3, tensor parallelism, the pipeline runner (one stage), ``HybridGPT`` at
  1 x 1 x 1, expert-parallel MoE, recomputation with dropout (CUDA RNG replayed) and a training-state
  checkpoint with the CUDA RNG;
* :class:`TestMultiRank`, 2 and 4 ranks where the machine has that many GPUs (NCCL refuses two ranks
  on one GPU): the checks that communicate, again.

Skipped as a whole without CUDA. ``python -m pytest -m gpu tests/test_gpu.py`` runs it alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.launch import Cluster

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
if N_GPU == 0:
    pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False (make test-gpu runs this file on a "
                "machine with one)", allow_module_level=True)
pytestmark = pytest.mark.gpu

CALL_S = 30        # one call's limit: every case takes seconds, so a hang (mismatched NCCL calls) fails
LR = 1e-2
TOL = 1e-5         # float32 on the GPU, one process vs the parallel version of the same step
HYBRID = {1: (1, 1, 1), 2: (1, 2, 1), 4: (1, 2, 2)}   # world size -> (dp, pp, tp) of the HybridGPT check


@pytest.fixture(scope="module")
def cluster1():
    with Cluster(1, backend="nccl", timeout=CALL_S) as c:
        yield c


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-gpus")
def cluster_n(request):
    n = request.param
    if N_GPU < n:
        pytest.skip(f"needs >= {n} GPUs: NCCL refuses two ranks on one GPU ({N_GPU} visible)")
    with Cluster(n, backend="nccl", timeout=CALL_S) as c:
        yield c


# ------------------------------------------------------------------ helpers (run on the ranks)
def _max_diff(xs, ys) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(xs, ys))


def _rel_diff(xs, ys) -> float:
    """:func:`_max_diff` over the largest ``|y|`` (at least 1): a sharded matmul sums in another order
    than the whole one, so large values differ by more than float32's eps in absolute terms."""
    return _max_diff(xs, ys) / max([1.0] + [float(y.detach().abs().max()) for y in ys])


def _ints(seed, n, dtype, dev):
    """``n`` integers in [-30, 30] as ``dtype`` on ``dev``: their sums and averages over 1, 2 or 4 ranks
    are exact in float32 and bfloat16 alike, so the course's collectives and NCCL must agree bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-30, 31, (n,), generator=g, device="cpu").to(dtype).to(dev)


def _built_on_cpu(make):
    """``make()`` under the CPU device and a fixed seed: the same values whatever the default device."""
    with torch.device("cpu"):
        torch.manual_seed(0)
        return make()


def _devices(tensors) -> list[str]:
    return sorted({str(t.device) for t in tensors if torch.is_tensor(t) and t.dim()})


# ------------------------------------------------------------------ cases (by reference, on the ranks)
def collectives_case(rank, world_size):
    """The course's collectives vs ``torch.distributed``'s on the same CUDA tensors; returns the
    failures (wrong values, or a result on another device) and the number of comparisons."""
    import torch.distributed as dist

    from course_lib import collectives as C, compat
    from course_lib.launch import device

    dev, N = device(), world_size
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
    all_reduces = {"ring_all_reduce": C.ring_all_reduce, "plain_ring_all_reduce": C.plain_ring_all_reduce,
                   "naive_all_reduce": lambda t, op: C.naive_all_reduce(t, op, root=N - 1)}
    failures, cases = [], 0

    def check(what, got, want):
        nonlocal cases
        cases += 1
        if got.device != dev:
            failures.append(f"{what}: result on {got.device}, not {dev}")
        elif not torch.equal(got, want):
            err = float((got.double() - want.double()).abs().max())
            failures.append(f"{what}: differs from torch.distributed by up to {err:g}")

    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 1000, 4099):                       # uneven chunks, empty ones when n < N
            x = _ints(100 * rank + n, n, dtype, dev)
            for op, red in ops.items():
                want = x.clone()
                dist.all_reduce(want, op=red)
                for name, fn in all_reduces.items():
                    check(f"{name} n={n} {dtype} {op}", fn(x.clone(), op), want)
        for k in (1, 257):                                  # k elements per rank: the built-ins need equal chunks
            full = _ints(200 * rank + k, k * N, dtype, dev)
            for op, red in ops.items():
                want = torch.empty(k, dtype=dtype, device=dev)
                compat.reduce_scatter_single(want, full.clone(), op=red)
                got = torch.empty(k, dtype=dtype, device=dev)
                check(f"ring_reduce_scatter k={k} {dtype} {op}", C.ring_reduce_scatter(got, full, op), want)
            mine = _ints(300 * rank + k, k, dtype, dev)
            want = torch.empty(k * N, dtype=dtype, device=dev)
            compat.all_gather_single(want, mine)
            got = torch.empty(k * N, dtype=dtype, device=dev)
            check(f"ring_all_gather k={k} {dtype}", C.ring_all_gather(got, mine), want)
            want = torch.empty(k * N, dtype=dtype, device=dev)
            dist.all_to_all_single(want, full)
            got = torch.empty(k * N, dtype=dtype, device=dev)
            C.all_to_all(list(got.chunk(N)), list(full.chunk(N)))
            check(f"all_to_all k={k} {dtype}", got, want)
    return failures, cases


def _gpt_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def ddp_case(rank, world_size, kind):
    """One SGD step of ``NaiveDDP`` or ``BucketedDDP`` on this rank's share of 8 sequences vs one
    process on all of them: the largest parameter difference and the devices of the gradients."""
    from course_lib.data_parallel import BucketedDDP, NaiveDDP, shard_range
    from course_lib.launch import device
    from course_lib.models import TinyGPT, make_tokens

    dev = device()
    model, (X, y) = _built_on_cpu(lambda: (TinyGPT(32, 8, 2, 4, 16), make_tokens(8, 8, 32, seed=1)))
    model, X, y = model.to(dev), X.to(dev), y.to(dev)
    ref = copy.deepcopy(model)
    ddp = NaiveDDP(model) if kind == "naive" else BucketedDDP(model, bucket_cap_bytes=4096)
    s = shard_range(X.shape[0], rank, world_size)
    for net, xb, yb in ((ddp, X[s], y[s]), (ref, X, y)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        _gpt_loss(net(xb), yb).backward()
        if net is ddp and kind == "naive":
            ddp.sync_gradients()
        opt.step()
    return _max_diff(model.parameters(), ref.parameters()), _devices(p.grad for p in model.parameters())


def zero_case(rank, world_size, stage, builtin, bf16=False):
    """Three Adam steps of ``ZeRO`` on this rank's share of 16 samples vs ``torch.optim.Adam`` on all of
    them in one process (an MLP of 85 parameters: the shards need padding on 2 and 4 ranks). Returns the
    largest difference of the gathered parameters and the devices of those and of Adam's states."""
    from course_lib.data_parallel import shard_range
    from course_lib.launch import device
    from course_lib.models import TinyMLP, make_regression
    from course_lib.zero import ZeRO

    dev = device()
    model, (X, y) = _built_on_cpu(lambda: (TinyMLP(5, 6, 1, 3), make_regression(16, 5, 1, seed=1)))
    model, X, y = model.to(dev), X.to(dev), y.to(dev)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    z = ZeRO(model, stage, lr=LR, builtin=builtin, param_dtype=torch.bfloat16 if bf16 else None)
    s = shard_range(X.shape[0], rank, world_size)
    for _ in range(3):
        F.mse_loss(z(X[s]).float(), y[s]).backward()
        z.step()
        z.zero_grad()
        opt.zero_grad()
        F.mse_loss(ref(X), y).backward()
        opt.step()
    got = z.gather_full_parameters()
    states = [v for st in z.optimizer.state.values() for v in st.values()]
    z.close()
    return _max_diff(got, ref.parameters()), _devices(got), _devices(states)


def tensor_parallel_case(rank, world_size, sequence_parallel, builtin):
    """A ``models.Block`` vs its ``ParallelBlock`` over all ranks (tp = world size): the largest relative
    error of the output, the input gradient and this rank's weight-gradient shards against the full
    gradients' slices, and the devices of the sharded gradients."""
    from course_lib import tensor_parallel as T
    from course_lib.launch import device
    from course_lib.models import Block

    dev, tp, r = device(), world_size, rank
    block, x = _built_on_cpu(lambda: (Block(8, 4), torch.randn(2, 8, 8)))   # (B, T, C), 4 heads
    block, x = block.to(dev), x.to(dev).requires_grad_(True)
    ref = block(x)
    ref.pow(2).sum().backward()
    par = T.ParallelBlock.from_block(block, None, sequence_parallel=sequence_parallel, builtin=builtin)
    xp = x.detach().clone().requires_grad_(True)
    out = par(T.scatter_to_sequence_parallel(xp, 1, None, builtin=builtin) if sequence_parallel else xp)
    out.pow(2).sum().backward()
    if sequence_parallel:
        T.all_reduce_sequence_parallel_grads(par, None, builtin=builtin)
        lo, hi = T.even_shard(8, r, tp)
        ref = ref[:, lo:hi]                                  # my chunk of the sequence
    c, h = 8 // tp, 32 // tp                                 # my channels of the attention and the MLP
    q_rows = torch.cat([torch.arange(j * 8 + r * c, j * 8 + (r + 1) * c) for j in range(3)]).to(dev)
    errs = {
        "out": _rel_diff([out], [ref]),
        "dx": _rel_diff([xp.grad], [x.grad]),
        "qkv.w": _rel_diff([par.attn.qkv.weight.grad], [block.attn.qkv.weight.grad[q_rows]]),
        "proj.w": _rel_diff([par.attn.proj.weight.grad], [block.attn.proj.weight.grad[:, r * c:(r + 1) * c]]),
        "fc.w": _rel_diff([par.mlp.fc.weight.grad], [block.fc.weight.grad[r * h:(r + 1) * h]]),
        "fc_proj.w": _rel_diff([par.mlp.fc_proj.weight.grad], [block.fc_proj.weight.grad[:, r * h:(r + 1) * h]]),
        "ln1.w": _rel_diff([par.ln1.weight.grad], [block.ln1.weight.grad]),
    }
    return errs, _devices(p.grad for p in par.parameters())


def pipeline_case(rank, world_size, schedule, m=4):
    """One step of the course's pipeline runner, one stage per rank, vs the sequential model on the whole
    batch: the largest gradient error on this rank's stage, the losses, and the gradients' devices."""
    from course_lib import pipeline as P
    from course_lib.launch import device

    dev, S = device(), world_size
    model, x, y = _built_on_cpu(lambda: (
        nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(S)]),
        torch.randn(8, 6), torch.randn(8, 6)))
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    ref = F.mse_loss(model(x), y)
    ref.backward()
    ref_grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    bounds = P.partition(model, S)
    stages = P.build_stages(model, bounds, [rank])
    out = P.run_schedule(P.make_schedule(schedule, S, m), stages, P.split_microbatches(x, m),
                         P.split_microbatches(y, m), F.mse_loss)
    mine = [(q, ref_grads[f"{k}.{n}"]) for k in bounds[rank] for n, q in model[k].named_parameters()]
    return {"err": _max_diff([q.grad for q, _ in mine], [g for _, g in mine]), "loss": out["loss"],
            "ref": float(ref.detach()), "devices": _devices(q.grad for q, _ in mine)}


def moe_case(rank, world_size, builtin):
    """``ExpertParallelMoE`` (4 experts over the ranks, top-2, nothing dropped) vs ``MoELayer`` on every
    rank's tokens at once: the largest relative error of the output, the input gradient, this rank's
    experts' gradients and the router's averaged gradient, and the devices of the gradients."""
    from course_lib import moe as X
    from course_lib.launch import device

    dev, n = device(), world_size
    full, xs, dy = _built_on_cpu(lambda: (X.MoELayer(8, 16, 4, 2), torch.randn(n, 6, 8), torch.randn(n, 6, 8)))
    full, xs, dy = full.to(dev), xs.to(dev), dy.to(dev)                  # every rank's tokens, known to all
    ep = X.ExpertParallelMoE.from_moe(full, None, builtin=builtin)
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    (y * dy[rank]).sum().backward()
    ep.sync_grads()
    xa = xs.reshape(-1, 8).clone().requires_grad_(True)
    ya = full(xa)
    (ya * dy.reshape(-1, 8)).sum().backward()
    mine = [full.experts[ep.first + i] for i in range(ep.local)]
    errs = {
        "out": _rel_diff([y], [ya.view(n, 6, 8)[rank]]),
        "dx": _rel_diff([x.grad], [xa.grad.view(n, 6, 8)[rank]]),
        "experts": _rel_diff([p.grad for e in ep.experts for p in e.parameters()],
                             [p.grad / n for e in mine for p in e.parameters()]),
        "router": _rel_diff([ep.gate.weight.grad], [full.gate.weight.grad / n]),
    }
    return errs, _devices(p.grad for p in ep.parameters())


def recompute_case(rank, world_size):
    """``course_lib.recompute.checkpoint`` of a stack with dropout on the GPU: gradients vs no
    checkpointing and ``torch.utils.checkpoint``, where the CUDA RNG is left, and the difference without
    the RNG replay (it must be large: the replay is what makes the masks equal)."""
    import torch.utils.checkpoint as tc

    from course_lib import recompute as R
    from course_lib.launch import device

    dev = device()
    model, x = _built_on_cpu(lambda: (
        nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.2)) for _ in range(6)]),
        torch.randn(8, 32)))
    model, x = model.to(dev), x.to(dev).requires_grad_(True)

    def grads(f):
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(1)                       # seeds the CUDA generator too: the same dropout masks
        f(x).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()], torch.rand(4, device=dev)

    plain, rng_plain = grads(model)
    ours, rng_ours = grads(lambda t: R.checkpoint(model, t))
    theirs, _ = grads(lambda t: tc.checkpoint(model, t, use_reentrant=False))
    no_replay, _ = grads(lambda t: R.checkpoint(model, t, preserve_rng_state=False))
    return {"ours": _max_diff(ours, plain), "torch": _max_diff(theirs, plain),
            "rng_left_alike": torch.equal(rng_ours, rng_plain), "no_replay": _max_diff(no_replay, plain),
            "devices": _devices(ours)}


def fault_case(rank, world_size, directory):
    """A training state saved on the GPU (model, AdamW, RNGs with CUDA's) and restored into a fresh
    model: the resumed run vs the uninterrupted one (dropout draws from the CUDA generator), with and
    without the CUDA RNG state restored, where the restored Adam states live, and the RNG afterwards."""
    from course_lib.checkpoint import CheckpointManager, restore_training_state, training_state
    from course_lib.launch import device
    from course_lib.models import TinyMLP, make_regression

    dev = device()
    X, y = (t.to(dev) for t in _built_on_cpu(lambda: make_regression(32, 16, 1, seed=0)))

    def build(seed):
        with torch.device("cpu"):
            torch.manual_seed(seed)
            model = TinyMLP(16, 32, 1, 3, dropout=0.5).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def train(model, opt, steps):
        for _ in range(steps):
            loss = F.mse_loss(model(X), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, opt = build(0)
    torch.manual_seed(1)
    train(model, opt, 2)
    manager = CheckpointManager(directory, keep_last=2)
    manager.save(2, training_state(model, opt, step=2))
    straight = train(model, opt, 3)                          # the run that was never interrupted
    draw = torch.rand(3, device=dev)
    saved = manager.load()
    out = {"cuda_rng_saved": "cuda" in saved["rng"]}
    for with_cuda_rng in (True, False):
        state = copy.deepcopy(saved)
        if not with_cuda_rng:
            state["rng"].pop("cuda", None)
        model2, opt2 = build(5)                              # a restarted process: other weights, other RNG
        torch.manual_seed(99)
        out["step"] = restore_training_state(state, model2, opt2)
        if with_cuda_rng:
            out["adam_devices"] = _devices(v for st in opt2.state.values() for v in st.values())
        out[f"diff_{'with' if with_cuda_rng else 'without'}_cuda_rng"] = _max_diff([train(model2, opt2, 3)], [straight])
        if with_cuda_rng:
            out["rng_after"] = torch.equal(torch.rand(3, device=dev), draw)
    return out


# ------------------------------------------------------------------ checks (any world size)
def _cuda_only(devices, what):
    assert devices and all(d.startswith("cuda") for d in devices), f"{what} on {devices}, not on the GPU"


def _check_collectives(cluster):
    for rank, (failures, cases) in enumerate(cluster.run(collectives_case)):
        assert cases > 0 and not failures, f"rank {rank}: {len(failures)} of {cases} wrong:\n" + "\n".join(failures[:20])


def _check_ddp(cluster, kind):
    for rank, (diff, devices) in enumerate(cluster.run(ddp_case, kind)):
        assert diff < TOL, f"rank {rank}: {kind} DDP differs from one process by {diff:g}"
        _cuda_only(devices, "gradients")


def _check_zero(cluster, stage, builtin, bf16=False):
    for rank, (diff, devices, states) in enumerate(cluster.run(zero_case, stage, builtin, bf16)):
        # bf16 parameters and gradients: Adam's normalised step can differ in sign on tiny gradients
        assert diff < (1e-2 if bf16 else TOL), f"rank {rank}: ZeRO-{stage} differs from Adam by {diff:g}"
        _cuda_only(devices, "gathered parameters")
        _cuda_only(states, "Adam states")


def _check_tensor_parallel(cluster, sequence_parallel, builtin):
    for rank, (errs, devices) in enumerate(cluster.run(tensor_parallel_case, sequence_parallel, builtin)):
        assert max(errs.values()) < TOL, f"rank {rank}: {errs}"
        _cuda_only(devices, "sharded gradients")


def _check_pipeline(cluster, schedule):
    results = cluster.run(pipeline_case, schedule)
    for rank, r in enumerate(results):
        assert r["err"] < TOL, f"rank {rank}: {r}"
        _cuda_only(r["devices"], "stage gradients")
    last = results[-1]                                       # stage S-1 lives on the last rank
    assert abs(last["loss"] - last["ref"]) < TOL, last


def _check_hybrid(cluster):
    from course_lib import hybrid_gpt

    dp, pp, tp = HYBRID[cluster.world_size]
    steps = 3
    results = cluster.run(hybrid_gpt.train, dp, pp, tp, steps, dtype=torch.float64)
    losses, ref = hybrid_gpt.replica_losses(results), hybrid_gpt.train_reference(steps, torch.float64)
    assert len(losses) == steps
    err = max(abs(a - b) for a, b in zip(losses, ref))
    assert err < 1e-9, f"dp={dp} pp={pp} tp={tp}: losses {losses} vs one process {ref}"


def _check_moe(cluster, builtin):
    for rank, (errs, devices) in enumerate(cluster.run(moe_case, builtin)):
        assert max(errs.values()) < TOL, f"rank {rank}: {errs}"
        _cuda_only(devices, "expert and router gradients")


# ------------------------------------------------------------------ one GPU
def test_collectives_on_cuda_equal_nccl(cluster1):
    _check_collectives(cluster1)


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_data_parallel(cluster1, kind):
    _check_ddp(cluster1, kind)


@pytest.mark.parametrize("stage, builtin, bf16", [(1, False, False), (2, False, False), (3, False, False),
                                                  (3, True, False), (1, False, True)],
                         ids=["stage1", "stage2", "stage3", "stage3-builtin", "stage1-bf16"])
def test_zero(cluster1, stage, builtin, bf16):
    _check_zero(cluster1, stage, builtin, bf16)


@pytest.mark.parametrize("sequence_parallel, builtin", [(False, False), (True, False), (True, True)],
                         ids=["tp", "tp+sp", "tp+sp-builtin"])
def test_tensor_parallel(cluster1, sequence_parallel, builtin):
    _check_tensor_parallel(cluster1, sequence_parallel, builtin)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pipeline_one_stage(cluster1, schedule):
    _check_pipeline(cluster1, schedule)


def test_hybrid_gpt_1x1x1(cluster1):
    _check_hybrid(cluster1)


@pytest.mark.parametrize("builtin", [False, True], ids=["ring", "builtin"])
def test_expert_parallel_moe(cluster1, builtin):
    _check_moe(cluster1, builtin)


def test_recompute_replays_the_cuda_rng(cluster1):
    r = cluster1.run(recompute_case)[0]
    assert r["ours"] < 1e-6 and r["torch"] < 1e-6, r
    assert r["rng_left_alike"], "the CUDA RNG is not left where the run without checkpointing leaves it"
    assert r["no_replay"] > 1e-3, f"without the RNG replay the gradients should differ: {r}"
    _cuda_only(r["devices"], "gradients")


def test_fault_checkpoint_restores_the_cuda_rng(cluster1, tmp_path):
    r = cluster1.run(fault_case, str(tmp_path))[0]
    assert r["cuda_rng_saved"] and r["step"] == 2, r
    assert r["diff_with_cuda_rng"] < 1e-6, f"the resumed run differs from the uninterrupted one: {r}"
    assert r["rng_after"], "the CUDA RNG is not where the uninterrupted run left it"
    assert r["diff_without_cuda_rng"] > 1e-4, f"without the CUDA RNG state the dropout masks should differ: {r}"
    _cuda_only(r["adam_devices"], "restored Adam states")


# ------------------------------------------------------------------ 2 and 4 GPUs
class TestMultiRank:
    """The checks that communicate, with 2 and 4 ranks on as many GPUs (skipped with fewer)."""

    def test_collectives_on_cuda_equal_nccl(self, cluster_n):
        _check_collectives(cluster_n)

    @pytest.mark.parametrize("kind", ["naive", "bucketed"])
    def test_data_parallel(self, cluster_n, kind):
        _check_ddp(cluster_n, kind)

    @pytest.mark.parametrize("stage, builtin", [(1, False), (2, False), (3, False), (3, True)],
                             ids=["stage1", "stage2", "stage3", "stage3-builtin"])
    def test_zero(self, cluster_n, stage, builtin):
        _check_zero(cluster_n, stage, builtin)

    @pytest.mark.parametrize("sequence_parallel, builtin", [(False, False), (True, False), (True, True)],
                             ids=["tp", "tp+sp", "tp+sp-builtin"])
    def test_tensor_parallel(self, cluster_n, sequence_parallel, builtin):
        _check_tensor_parallel(cluster_n, sequence_parallel, builtin)

    @pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
    def test_pipeline(self, cluster_n, schedule):
        _check_pipeline(cluster_n, schedule)

    def test_hybrid_gpt(self, cluster_n):
        _check_hybrid(cluster_n)

    @pytest.mark.parametrize("builtin", [False, True], ids=["ring", "builtin"])
    def test_expert_parallel_moe(self, cluster_n, builtin):
        _check_moe(cluster_n, builtin)
