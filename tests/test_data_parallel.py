"""Data parallelism from scratch (course_lib.data_parallel, course_lib.param_server) on 4 gloo ranks.

Every DDP is compared with a single-process full-batch run and with
torch.nn.parallel.DistributedDataParallel on the same data, over several optimizer steps.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from course_lib.data_parallel import shard_loss_weight, shard_range
from course_lib.launch import Cluster

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(WORLD, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ worker functions (by reference)
def _make(kind, module, bucket_cap_bytes, find_unused=False):
    import torch.nn as nn

    from course_lib.data_parallel import BucketedDDP, NaiveDDP

    if kind == "naive":
        return NaiveDDP(module)
    if kind == "bucketed":
        return BucketedDDP(module, bucket_cap_bytes=bucket_cap_bytes)
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_bytes / 2**20,
                                                   find_unused_parameters=find_unused)
    raise ValueError(kind)


def _flat_params(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _model_and_data(model_name, n):
    """The test model (seeded by the caller), its seeded data of ``n`` samples, and its loss."""
    import torch.nn.functional as F

    from course_lib.models import TinyGPT, TinyMLP, make_regression, make_tokens

    if model_name == "mlp":
        return TinyMLP(16, 32, 1, 3), *make_regression(n, 16, 1, seed=1), F.mse_loss
    model = TinyGPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    X, y = make_tokens(n, 8, 32, seed=1)
    return model, X, y, lambda out, tgt: F.cross_entropy(out.reshape(-1, out.size(-1)), tgt.reshape(-1))


def train_ddp(rank, world_size, model_name, kind, n, steps, weighted, bucket_cap_bytes=2048):
    """Train with DDP ``kind`` on this rank's shard of n samples; return the final flat parameters.

    The replicas start from *different* seeds: only the initial broadcast makes them agree (torch DDP
    broadcasts too). The loss is the mean over the shard, optionally scaled by shard_loss_weight.
    """
    from course_lib.data_parallel import NaiveDDP
    from course_lib.models import TinyGPT, TinyMLP

    torch.manual_seed(100 + rank)
    model, X, y, loss_fn = _model_and_data(model_name, n)
    if kind == "torch":
        # torch DDP also broadcasts from rank 0; start from rank 0's seed explicitly anyway
        torch.manual_seed(100)
        model = TinyMLP(16, 32, 1, 3) if model_name == "mlp" else TinyGPT(32, 8, 1, 2, 16)
    ddp = _make(kind, model, bucket_cap_bytes)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    s = shard_range(n, rank, world_size)
    w = shard_loss_weight(n, rank, world_size) if weighted else 1.0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        (w * loss_fn(ddp(X[s]), y[s])).backward()
        if isinstance(ddp, NaiveDDP):
            ddp.sync_gradients()
        opt.step()
    return _flat_params(model)


def train_single(model_name, n, steps):
    torch.manual_seed(100)  # rank 0's seed: the broadcast makes every replica equal to it
    model, X, y, loss_fn = _model_and_data(model_name, n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(X), y).backward()
        opt.step()
    return _flat_params(model)


def _assert_all_ranks_equal(results, ref, what):
    for r, v in enumerate(results):
        assert torch.allclose(v, ref, **TOL), (
            f"{what}: rank {r} differs from the reference by {(v - ref).abs().max().item():.3e}")


# ------------------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("kind", ["naive", "bucketed"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_equals_single_process_and_torch_ddp(cluster, kind, model_name):
    steps, n = 6, 32
    ref = train_single(model_name, n, steps)
    ours = cluster.run(train_ddp, model_name, kind, n, steps, False)
    theirs = cluster.run(train_ddp, model_name, "torch", n, steps, False)
    _assert_all_ranks_equal(ours, ref, f"{kind} DDP vs single process ({model_name})")
    _assert_all_ranks_equal(ours, theirs[0], f"{kind} DDP vs torch DDP ({model_name})")
    # the run must actually have moved the parameters, or equality would prove nothing
    torch.manual_seed(100)
    assert not torch.allclose(ref, train_single(model_name, n, 0), **TOL)


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_uneven_split_needs_and_gets_weighting(cluster, kind):
    n, steps = 30, 5  # 30 = 8 + 8 + 7 + 7 over 4 ranks
    ref = train_single("mlp", n, steps)
    weighted = cluster.run(train_ddp, "mlp", kind, n, steps, True)
    _assert_all_ranks_equal(weighted, ref, f"{kind} DDP with shard_loss_weight on an uneven split")
    unweighted = cluster.run(train_ddp, "mlp", kind, n, steps, False)
    assert not torch.allclose(unweighted[0], ref, **TOL), (
        "plain per-rank mean losses on unequal shards should NOT equal the full-batch mean")


def test_shard_range_and_bad_sizes():
    sizes = [shard_range(30, r, 4) for r in range(4)]
    assert [s.stop - s.start for s in sizes] == [8, 8, 7, 7]
    assert sizes[0].start == 0 and sizes[-1].stop == 30
    assert all(a.stop == b.start for a, b in zip(sizes, sizes[1:]))
    # weights N * n_r / n: the weighted per-rank means average to the full-batch mean
    assert sum(shard_loss_weight(30, r, 4) for r in range(4)) == pytest.approx(4.0)
    assert shard_loss_weight(30, 0, 4) == pytest.approx(4 * 8 / 30)
    assert shard_loss_weight(32, 1, 4) == 1.0
    with pytest.raises(ValueError, match="some rank would get none"):
        shard_range(3, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        shard_range(8, 4, 4)
    with pytest.raises(TypeError, match="n must be an int"):
        shard_range(8.0, 0, 4)


# ------------------------------------------------------------------- frozen, tied, unused params
def frozen_run(rank, world_size, kind):
    import torch.nn.functional as F

    from course_lib.data_parallel import NaiveDDP
    from course_lib.models import TinyMLP, make_regression

    torch.manual_seed(7)
    model = TinyMLP(16, 32, 1, 3)
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    before = [p.detach().clone() for p in model.layers[0].parameters()]
    ddp = _make(kind, model, 1024)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    X, y = make_regression(32, 16, 1, seed=2)
    s = shard_range(32, rank, world_size)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(X[s]), y[s]).backward()
        if isinstance(ddp, NaiveDDP):
            ddp.sync_gradients()
        opt.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.layers[0].parameters()))
    no_grad = all(p.grad is None for p in model.layers[0].parameters())
    return unchanged, no_grad, _flat_params(model)


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_frozen_parameters_untouched(cluster, kind):
    ours = cluster.run(frozen_run, kind)
    theirs = cluster.run(frozen_run, "torch")
    for r, (unchanged, no_grad, _) in enumerate(ours):
        assert unchanged, f"rank {r}: a frozen parameter changed"
        assert no_grad, f"rank {r}: a frozen parameter received a gradient"
    _assert_all_ranks_equal([o[2] for o in ours], theirs[0][2], f"{kind} DDP with a frozen layer vs torch DDP")


def tied_grads(rank, world_size, kind):
    """One backward of TinyGPT (lm_head.weight is wte.weight); return the tied weight's grad."""
    import torch.nn.functional as F

    from course_lib.data_parallel import NaiveDDP, trainable_parameters
    from course_lib.models import TinyGPT, make_tokens

    torch.manual_seed(3)
    model = TinyGPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    assert model.lm_head.weight is model.wte.weight
    n_unique = len(trainable_parameters(model))
    n_registered = len(list(model.named_parameters(remove_duplicate=False)))
    ddp = _make(kind, model, 1 << 20)
    X, y = make_tokens(16, 8, 32, seed=4)
    s = shard_range(16, rank, world_size)
    F.cross_entropy(ddp(X[s]).reshape(-1, 32), y[s].reshape(-1)).backward()
    if isinstance(ddp, NaiveDDP):
        n_comm = ddp.sync_gradients()
    else:
        n_comm = getattr(ddp, "last_comm_count", None)
    return model.wte.weight.grad.clone(), n_unique, n_registered, n_comm


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_tied_weights_reduced_once(cluster, kind):
    import torch.nn.functional as F

    from course_lib.models import TinyGPT, make_tokens

    torch.manual_seed(3)
    model = TinyGPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    X, y = make_tokens(16, 8, 32, seed=4)
    F.cross_entropy(model(X).reshape(-1, 32), y.reshape(-1)).backward()
    ref = model.wte.weight.grad
    ours = cluster.run(tied_grads, kind)
    for r, (g, n_unique, n_registered, n_comm) in enumerate(ours):
        assert n_registered == n_unique + 1, "TinyGPT should register the tied weight twice"
        assert torch.allclose(g, ref, **TOL), (
            f"rank {r}: tied weight grad off by {(g - ref).abs().max():.3e} (x2 would mean reduced twice)")
    if kind == "naive":
        assert ours[0][3] == ours[0][1], "naive DDP must issue one all-reduce per unique parameter"
    else:
        assert ours[0][3] == 1, "one bucket of 1 MiB holds the whole tiny GPT: one all-reduce"


class _Branchy(torch.nn.Module):
    """``a`` always used; ``b`` used only on rank 0; ``c`` never used."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 4)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


def unused_run(rank, world_size, kind):
    torch.manual_seed(5)
    model = _Branchy()
    ddp = _make(kind, model, 64, find_unused=True)  # 64 B: several buckets, b's among them
    from course_lib.data_parallel import NaiveDDP

    results = []
    for it in range(2):
        ddp.zero_grad(set_to_none=True)
        x = torch.full((2, 4), float(rank + 1 + it))
        ddp(x, rank == 0).pow(2).sum().backward()
        if isinstance(ddp, NaiveDDP):
            ddp.sync_gradients()
        results.append({n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()})
    return results


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_unused_parameters_match_torch_find_unused(cluster, kind):
    ours = cluster.run(unused_run, kind)
    theirs = cluster.run(unused_run, "torch")
    for r in range(WORLD):
        for it in range(2):
            for name, g in theirs[r][it].items():
                mine = ours[r][it][name]
                if name.startswith("c."):
                    assert g is None and mine is None, f"never-used {name} must keep grad None"
                    continue
                assert mine is not None, f"rank {r}: {name} used on some rank but got no grad"
                assert torch.allclose(mine, g, **TOL), f"rank {r} iter {it}: {name} differs from torch DDP"
    # b is used on rank 0 only, yet every rank must hold the same averaged gradient
    assert torch.allclose(ours[1][0]["b.weight"], ours[0][0]["b.weight"])


# --------------------------------------------------------------------------------- no_sync
def accumulate_run(rank, world_size, kind, k):
    """k micro-batches per step (no_sync on the first k-1), 5 steps; return params and comm counts."""
    import contextlib

    import torch.nn.functional as F

    from course_lib import trace
    from course_lib.models import TinyMLP, make_regression

    torch.manual_seed(11)
    model = TinyMLP(16, 32, 1, 3)
    ddp = _make(kind, model, 2048)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    X, y = make_regression(5 * k * world_size * 4, 16, 1, seed=3)
    X = X.view(5, k, world_size, 4, 16)
    y = y.view(5, k, world_size, 4, 1)
    comm_per_step = []
    with trace.Recorder() as rec:
        for step in range(5):
            before = rec.totals()["n_comm"]
            opt.zero_grad(set_to_none=True)
            for j in range(k):
                ctx = ddp.no_sync() if j < k - 1 else contextlib.nullcontext()
                with ctx:
                    (F.mse_loss(ddp(X[step, j, rank]), y[step, j, rank]) / k).backward()
            opt.step()
            comm_per_step.append(rec.totals()["n_comm"] - before)
    n_buckets = len(ddp.buckets) if hasattr(ddp, "buckets") else None
    return _flat_params(model), comm_per_step, n_buckets


def test_no_sync_accumulation_equals_large_batch_and_torch(cluster):
    import torch.nn.functional as F

    from course_lib.models import TinyMLP, make_regression

    k = 3
    ours = cluster.run(accumulate_run, "bucketed", k)
    theirs = cluster.run(accumulate_run, "torch", k)
    torch.manual_seed(11)
    model = TinyMLP(16, 32, 1, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = make_regression(5 * k * WORLD * 4, 16, 1, seed=3)
    X, y = X.view(5, -1, 16), y.view(5, -1, 1)
    for step in range(5):  # one batch of k * world * 4 samples per step
        opt.zero_grad()
        F.mse_loss(model(X[step]), y[step]).backward()
        opt.step()
    ref = _flat_params(model)
    _assert_all_ranks_equal([o[0] for o in ours], ref, "no_sync accumulation vs one large batch")
    _assert_all_ranks_equal([o[0] for o in ours], theirs[0][0], "no_sync accumulation vs torch DDP no_sync")
    params, comm, n_buckets = ours[0]
    assert n_buckets > 1, "the test wants several buckets"
    assert comm == [n_buckets] * 5, (
        f"expected one all-reduce per bucket per accumulation window ({n_buckets}), got {comm}")


# ------------------------------------------------------------------------- buckets and overlap
def bucket_layout(rank, world_size, cap):
    from course_lib.data_parallel import BucketedDDP
    from course_lib.models import TinyMLP

    torch.manual_seed(0)
    model = TinyMLP(16, 32, 1, 3)
    ddp = BucketedDDP(model, bucket_cap_bytes=cap)
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b.params] for b in ddp.buckets], ddp.bucket_sizes()


def test_buckets_reverse_order_and_cap(cluster):
    layout, sizes = cluster.run(bucket_layout, 2048)[0]
    order = [n for b in layout for n in b]
    from course_lib.models import TinyMLP

    expected = [n for n, _ in TinyMLP(16, 32, 1, 3).named_parameters()][::-1]
    assert order == expected, f"buckets must walk the parameters in reverse: {order}"
    # a bucket is closed once it reaches the cap: without its last parameter it was below the cap
    from course_lib.models import TinyMLP as _M

    nbytes = {n: p.numel() * 4 for n, p in _M(16, 32, 1, 3).named_parameters()}
    for b, s in zip(layout, sizes):
        assert s == sum(nbytes[n] for n in b)
        assert s - nbytes[b[-1]] < 2048, f"bucket {b} ({s} B) should have closed earlier"
    for b, s in zip(layout[:-1], sizes[:-1]):
        assert s >= 2048, f"bucket {b} ({s} B) was closed before reaching the 2048 B cap"
    assert len(layout) > 1
    one, _ = cluster.run(bucket_layout, 1 << 30)[0]
    assert len(one) == 1


def overlap_run(rank, world_size):
    import torch.nn.functional as F

    from course_lib import trace
    from course_lib.data_parallel import BucketedDDP
    from course_lib.models import TinyMLP

    torch.manual_seed(0)
    model = TinyMLP(64, 256, 1, 6)
    ddp = BucketedDDP(model, bucket_cap_bytes=256 * 256 * 4)
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    with trace.Recorder() as rec:
        F.mse_loss(ddp(x), y).backward()
    comm = [e for e in rec.events if e["kind"] == "comm"]
    compute = [e for e in rec.events if e["kind"] == "compute"]
    return comm, compute, len(ddp.buckets)


def test_comm_launched_during_backward(cluster):
    comm, compute, n_buckets = cluster.run(overlap_run)[0]
    assert len(comm) == n_buckets > 2
    bwd_end = max(e["end"] for e in compute)
    launched_early = [e for e in comm if e["start"] < bwd_end]
    assert len(launched_early) >= n_buckets - 1, (
        "all but possibly the last bucket must be launched before backward finishes "
        f"({len(launched_early)} of {n_buckets} were)")
    assert all(e["bytes_sent"] > 0 for e in comm)


def grad_views_run(rank, world_size):
    """Where the buckets and the gradients live, after backward with both kinds of zero_grad."""
    import torch.nn.functional as F

    from course_lib.data_parallel import BucketedDDP
    from course_lib.models import TinyMLP

    torch.manual_seed(0)
    model = TinyMLP(16, 32, 1, 3)
    ddp = BucketedDDP(model, bucket_cap_bytes=2048)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    (buf,) = ddp.grad_buffers
    base = buf.untyped_storage().data_ptr()
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    out = {"n_buckets": len(ddp.buckets),
           "buf_numel": buf.numel(),
           "bucket_storage": [b.flat.untyped_storage().data_ptr() == base for b in ddp.buckets],
           # the buckets tile the buffer back to back: start offsets and lengths
           "bucket_spans": [(b.flat.storage_offset(), b.flat.numel()) for b in ddp.buckets],
           "grads": {}}
    for how in ("set_to_none", "zero_"):
        grads_ptr = []
        for _ in range(2):
            opt.zero_grad(set_to_none=how == "set_to_none")
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            grads_ptr.append([p.grad.data_ptr() for p in model.parameters()])
        out["grads"][how] = {
            "in_buffer": all(p.grad.untyped_storage().data_ptr() == base and lo <= p.grad.data_ptr() < hi
                             for p in model.parameters()),
            "same_memory_each_step": grads_ptr[0] == grads_ptr[1],
        }
    return out


def test_gradients_are_views_into_one_flat_buffer(cluster):
    out = cluster.run(grad_views_run)[0]
    assert out["n_buckets"] > 1, "the test wants several buckets"
    assert all(out["bucket_storage"]), "every bucket must be a view into the one flat gradient buffer"
    spans = out["bucket_spans"]
    assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])), (
        f"buckets must tile the buffer back to back, got (offset, numel) = {spans}")
    assert spans[-1][0] + spans[-1][1] == out["buf_numel"]
    for how, g in out["grads"].items():
        assert g["in_buffer"], f"after backward (zero_grad {how}) every .grad must be a view into the buffer"
        assert g["same_memory_each_step"], f"zero_grad {how}: .grad must reuse the buffer every step"


# ------------------------------------------------------------------------------------ bad inputs
def bad_inputs(rank, world_size):
    from course_lib.data_parallel import BucketedDDP, NaiveDDP

    msgs = []
    for make in (lambda: BucketedDDP(torch.nn.Linear(2, 2), bucket_cap_bytes=0),
                 lambda: BucketedDDP(torch.nn.Linear(2, 2), bucket_cap_bytes=-5),
                 lambda: BucketedDDP(torch.nn.Linear(2, 2), bucket_cap_bytes=1.5),
                 lambda: BucketedDDP(torch.nn.Linear(2, 2).requires_grad_(False)),
                 lambda: NaiveDDP("not a model")):
        try:
            make()
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append((type(e).__name__, str(e)))
    return msgs


def test_bad_inputs(cluster):
    msgs = cluster.run(bad_inputs)[0]
    assert msgs[0][0] == "ValueError" and "bucket_cap_bytes must be positive" in msgs[0][1]
    assert msgs[1][0] == "ValueError" and "-5" in msgs[1][1]
    assert msgs[2][0] == "TypeError" and "int number of bytes" in msgs[2][1]
    assert msgs[3][0] == "ValueError" and "no trainable parameters" in msgs[3][1]
    assert msgs[4][0] == "TypeError" and "torch.nn.Module" in msgs[4][1]


def test_needs_process_group():
    from course_lib.data_parallel import NaiveDDP

    with pytest.raises(RuntimeError, match="not initialised"):
        NaiveDDP(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------- parameter server
def _ps_args(mode, n_workers, delays=None, n_updates=12):
    from course_lib.models import TinyMLP, make_regression
    from course_lib.param_server import parameter_server_sgd

    torch.manual_seed(0)
    model = TinyMLP(8, 16, 1, 2)
    X, y = make_regression(96, 8, 1, seed=0)
    return partial(parameter_server_sgd, model=model, X=X, y=y, n_updates=n_updates, lr=0.05,
                   batch_size=8, mode=mode, n_workers=n_workers, delays=delays or {}, seed=0), model, X, y


def test_sync_parameter_server_equals_single_process_sgd(cluster):
    import torch.nn.functional as F
    from torch.nn.utils import parameters_to_vector

    fn, model, X, y = _ps_args("sync", 3)
    res = cluster.run(fn)
    server = res[0]
    assert server["staleness"] == [0] * (12 * 3), "synchronous SGD never uses stale parameters"
    assert [r["n_grads"] for r in res[1:]] == [12, 12, 12]
    # replay the same mini-batches in one process: average the 3 workers' gradients per step
    s = len(X) // 3
    gens = {w: torch.Generator().manual_seed(0 + w) for w in (1, 2, 3)}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(12):
        opt.zero_grad()
        loss = 0
        for w in (1, 2, 3):
            idx = torch.randint(0, s, (8,), generator=gens[w])
            loss = loss + F.mse_loss(model(X[(w - 1) * s:w * s][idx]), y[(w - 1) * s:w * s][idx]) / 3
        loss.backward()
        opt.step()
    ref = parameters_to_vector(model.parameters()).detach()
    assert torch.allclose(server["params"], ref, **TOL)
    assert server["loss"][-1] < server["loss"][0]
    # traffic: initial params + one reply per gradient, each (1 + P) float32
    msg = (1 + ref.numel()) * 4
    assert server["bytes_recv"] == 12 * 3 * msg
    assert server["bytes_sent"] == (3 + 12 * 3) * msg


def test_async_parameter_server_staleness_and_traffic(cluster):
    # The fast workers are throttled too (5 ms per gradient), so that the run lasts several of the
    # slow worker's 20 ms gradients however fast the machine is: 60 updates / 2 fast workers x 5 ms.
    fn, model, X, y = _ps_args("async", 3, delays={1: 0.005, 2: 0.005, 3: 0.02}, n_updates=60)
    res = cluster.run(fn)
    server = res[0]
    assert len(server["staleness"]) == 60 and len(server["loss"]) == 61
    assert sum(r["n_grads"] for r in res[1:]) == 60 + 3, "each worker's last gradient is answered with stop"
    slow = [s for s, w in zip(server["staleness"], server["worker"]) if w == 3]
    fast = [s for s, w in zip(server["staleness"], server["worker"]) if w != 3]
    assert slow and sum(slow) / len(slow) > sum(fast) / len(fast), (
        f"the slow worker's gradients should be staler: slow {slow}, fast {fast}")
    assert res[3]["n_grads"] < res[1]["n_grads"], "the straggler should contribute fewer gradients"
    assert server["loss"][-1] < server["loss"][0]


def test_parameter_server_bad_inputs():
    # validation happens before any communication, so it can be checked in this process
    fn, *_ = _ps_args("async", 4)  # 4 workers need 5 ranks
    with pytest.raises(ValueError, match="n_workers must be an int"):
        fn(0, WORLD)
    fn, *_ = _ps_args("hogwild", 2)
    with pytest.raises(ValueError, match="mode must be"):
        fn(0, WORLD)
    fn, *_ = _ps_args("sync", 3, delays={2: -1.0})
    with pytest.raises(ValueError, match="negative"):
        fn(1, WORLD)


# ------------------------------------------------------------------------- accumulate_gradients
def test_accumulate_gradients_equals_large_batch_single_process():
    import torch.nn.functional as F

    from course_lib.data_parallel import accumulate_gradients
    from course_lib.models import TinyMLP, make_regression

    X, y = make_regression(13, 16, 1, seed=5)
    torch.manual_seed(0)
    model = TinyMLP(16, 32, 1, 3)
    F.mse_loss(model(X), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    for sizes in ([13], [5, 5, 3], [1] * 13):
        model.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, F.mse_loss, zip(X.split(sizes), y.split(sizes)))
        assert loss == pytest.approx(F.mse_loss(model(X), y).item(), rel=1e-5)
        for p, g in zip(model.parameters(), ref):
            assert torch.allclose(p.grad, g, **TOL), f"micro-batch sizes {sizes}: gradient differs"
    with pytest.raises(ValueError, match="micro_batches is empty"):
        accumulate_gradients(model, F.mse_loss, [])
