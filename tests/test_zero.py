"""ZeRO stages 0-3 from scratch (course_lib.zero) on one warm 4-rank gloo cluster.

Every stage is compared with single-process Adam on the full batch and with FSDP2
(``torch.distributed.fsdp.fully_shard``); the bytes each rank holds are compared with
``estimate.zero_model_state_bytes`` and with FSDP2's own ``FSDPMemTracker``; the bytes each stage
sends are measured with ``course_lib.trace``. The 2-rank cases run on a subgroup of the cluster.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.launch import Cluster, RankError

WORLD = 4
STEPS = 6
LR = 1e-2
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(WORLD, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ models, data, references
def _mlp():
    """85 parameters (units of 36, 42 and 7): divisible by neither 2 nor 4."""
    from course_lib.models import TinyMLP, make_regression

    torch.manual_seed(0)
    X, y = make_regression(16, 5, 1, seed=1)
    return TinyMLP(5, 6, 1, 3), X, y, F.mse_loss


def _gpt():
    """TinyGPT with tied embedding/head, and the attention biases frozen.

    Why frozen: softmax is unchanged when a constant is added to every score, so the key bias gets
    an exactly-zero gradient; the rounding noise of a different summation order then becomes a
    full Adam step of size ``lr`` in a different direction. Freezing it is also our frozen-parameter case.
    """
    from course_lib.models import TinyGPT, make_tokens

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=29, block_size=8, n_layer=2, n_head=3, n_embd=15)
    for b in model.blocks:
        b.attn.qkv.bias.requires_grad_(False)
    X, y = make_tokens(16, 8, 29, seed=1)

    def loss(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), tgt.reshape(-1))
    return model, X, y, loss


MODELS = {"mlp": _mlp, "gpt": _gpt}


def _single_process(model_name, steps=STEPS):
    model, X, y, loss_fn = MODELS[model_name]()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(X), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _group(world):
    import torch.distributed as dist

    # every rank must take part in new_group; ranks outside it get a non-member handle
    return None if world == dist.get_world_size() else dist.new_group(list(range(world)))


def _shard(rank, world, X, y):
    b = X.shape[0] // world
    return X[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


# ------------------------------------------------------------------ worker functions
def train_zero(rank, world_size, model_name, stage, world, steps=STEPS, builtin=False,
               param_dtype=None, trace_comm=False):
    """Train with our ZeRO on the first ``world`` ranks; rank 1+ start from other random values."""
    from course_lib import trace
    from course_lib.zero import ZeRO

    group = _group(world)
    if rank >= world:
        return None
    model, X, y, loss_fn = MODELS[model_name]()
    if rank > 0:  # set-up must broadcast rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    frozen_before = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
    z = ZeRO(model, stage, lr=LR, group=group, builtin=builtin, param_dtype=param_dtype)
    x, t = _shard(rank, world, X, y)
    sent, held = [], None
    for _ in range(steps):
        with trace.Recorder() as rec:
            loss_fn(z(x), t).backward()
            z.reduce_gradients()
            held = z.state_bytes()
            z.step()
            z.zero_grad()
        sent.append(rec.totals()["bytes_sent"])
    params = z.gather_full_parameters()
    frozen_after = [p.detach().float() for p in model.parameters() if not p.requires_grad]
    padded = sum(u.padded for u in z.units)
    n_units = len(z.units)
    z.close()
    return dict(params=params, held=held, sent=sent, padded=padded, n_units=n_units,
                frozen=(frozen_before, frozen_after))


def train_fsdp2(rank, world_size, model_name, reshard_after_forward, bf16=False, steps=STEPS):
    """The same training with FSDP2 ``fully_shard`` (each block, then the root), plus FSDPMemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from course_lib.zero import default_units

    model, X, y, loss_fn = MODELS[model_name]()
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in default_units(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    x, t = _shard(rank, world_size, X, y)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((x,))
    with tracker:
        for _ in range(steps):
            tracker.reset_mod_stats()  # it tracks one iteration at a time
            opt.zero_grad()
            loss_fn(model(x), t).backward()
            opt.step()
    snap = next(iter(tracker.get_tracker_snapshot("current").values()))
    snap = {getattr(k, "value", str(k)): v for k, v in snap.items()}
    params = [p.full_tensor().detach().float() for p in model.parameters()]
    local = [p.to_local() for p in model.parameters() if p.requires_grad]
    return dict(params=params, mem=snap, local_numel=sum(t.numel() for t in local), n_local=len(local),
                # FSDP2 keeps each shard padded to ceil(dim0 / N) rows
                padded_param_bytes=sum(-(-p.shape[0] // world_size) * p[0].numel() * 4
                                       for p in model.parameters()))


def units_live(rank, world_size, prefetch):
    """Most layer units whose full parameters are allocated at once during a stage-3 forward."""
    from course_lib.zero import ZeRO

    model, X, y, loss_fn = MODELS["gpt"]()
    z = ZeRO(model, 3, prefetch=prefetch)
    layers = [u for u in z.units if u is not z.root]
    most = []
    for u in layers:
        u.module.register_forward_pre_hook(lambda *a: most.append(
            sum(v.full.untyped_storage().nbytes() > 0 for v in layers)))
    loss_fn(z(_shard(rank, world_size, X, y)[0]), _shard(rank, world_size, X, y)[1]).backward()
    after = sum(v.full.untyped_storage().nbytes() > 0 for v in z.units)
    z.step()
    z.close()
    return max(most), after


def bad_input(rank, world_size, case):
    import torch.nn as nn

    from course_lib.zero import ZeRO

    if case == "stage":
        ZeRO(nn.Linear(4, 4), 4)
    elif case == "no_params":
        ZeRO(nn.ReLU(), 1)
    elif case == "all_frozen":
        ZeRO(nn.Linear(4, 4).requires_grad_(False), 2)
    elif case == "too_many_ranks":
        ZeRO(nn.Linear(1, 1), 3)  # 2 parameters, 4 ranks
    elif case == "not_module":
        ZeRO(lambda x: x, 1)
    elif case == "transport_and_builtin":
        from course_lib.netem import Link, PacedTransport
        ZeRO(nn.Linear(4, 4), 1, builtin=True, transport=PacedTransport(Link(1e6)))
    elif case == "clip":
        ZeRO(nn.Linear(4, 4), 1).clip_grad_norm_(0)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equals_single_process_adam(cluster, stage, world):
    """85 parameters on 2 and 4 ranks: the padded, sharded training is the full-batch training."""
    ref = _single_process("mlp")
    out = cluster.run(train_zero, "mlp", stage, world)
    for r in range(world):
        for got, want in zip(out[r]["params"], ref):
            torch.testing.assert_close(got, want, **TOL)
    assert all(o is None for o in out[world:])


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_and_frozen_gpt(cluster, stage):
    ref = _single_process("gpt")
    out = cluster.run(train_zero, "gpt", stage, WORLD, builtin=(stage == 3))
    for got, want in zip(out[0]["params"], [p for p, q in zip(ref, MODELS["gpt"]()[0].parameters())
                                            if q.requires_grad]):
        torch.testing.assert_close(got, want, **TOL)
    before, after = out[1]["frozen"]
    assert len(before) == 2  # frozen values are rank 0's (broadcast) and never change
    for b, a, want in zip(before, after, [p for p, q in zip(ref, MODELS["gpt"]()[0].parameters())
                                          if not q.requires_grad]):
        torch.testing.assert_close(a, want, rtol=0, atol=0)


@pytest.mark.parametrize("stage,reshard", [(2, False), (3, True)])
def test_equals_fsdp2(cluster, stage, reshard):
    """ZeRO-2 ~ fully_shard(reshard_after_forward=False), ZeRO-3 ~ True: same parameters, and the
    same sharded parameter and optimizer-state bytes by FSDPMemTracker's own count."""
    ours = cluster.run(train_zero, "gpt", stage, WORLD)
    theirs = cluster.run(train_fsdp2, "gpt", reshard)
    model = MODELS["gpt"]()[0]
    trainable = [q.requires_grad for q in model.parameters()]
    for r in range(WORLD):
        got = iter(ours[r]["params"])
        for want, tr in zip(theirs[r]["params"], trainable):
            if tr:
                torch.testing.assert_close(next(got), want, **TOL)
    psi = sum(p.numel() for p, tr in zip(model.parameters(), trainable) if tr)
    for r in range(WORLD):
        mem, held, f = theirs[r]["mem"], ours[r]["held"], theirs[r]
        # FSDPMemTracker's count is exact for FSDP2's own shards: Adam's two fp32 buffers per
        # element of the local shard, plus one 4-byte step counter per parameter ...
        assert mem["OptState"] == 8 * f["local_numel"] + 4 * f["n_local"], mem
        assert mem["Sharded Param"] == f["padded_param_bytes"], mem
        # ... so over the ranks FSDP2 holds 8 Psi (its shards are uneven: dim 0 split in ceil(dim0/N)
        # rows), while each of our ranks holds 8 Psi / N up to the padding of each unit.
        assert abs(held["optimizer_states"] / (8 * psi / WORLD) - 1) < 0.02, held
        if stage == 3:
            frozen = sum(p.numel() * 4 for p, tr in zip(model.parameters(), trainable) if not tr)
            assert abs((held["parameters"] - frozen) / (4 * psi / WORLD) - 1) < 0.02, held
    assert sum(theirs[r]["local_numel"] for r in range(WORLD)) == psi


def test_mixed_precision_matches_fsdp2_bf16(cluster):
    ours = cluster.run(train_zero, "gpt", 3, WORLD, param_dtype=torch.bfloat16)
    theirs = cluster.run(train_fsdp2, "gpt", True, bf16=True)
    trainable = [q.requires_grad for q in MODELS["gpt"]()[0].parameters()]
    got = iter(ours[0]["params"])
    for want, tr in zip(theirs[0]["params"], trainable):
        if tr:  # bf16 compute and communication: agreement to bf16 precision
            torch.testing.assert_close(next(got), want, rtol=2e-2, atol=2e-2)
    from course_lib.estimate import zero_model_state_bytes

    held, padded = ours[0]["held"], ours[0]["padded"]
    want = zero_model_state_bytes(padded, 3, WORLD, precision="mixed")
    frozen = 2 * sum(p.numel() for p, tr in zip(MODELS["gpt"]()[0].parameters(), trainable) if not tr)
    assert held["parameters"] == want["parameters"] + frozen        # bf16 slice + frozen (bf16)
    assert held["gradients"] == want["gradients"]                   # bf16 gradient slice
    steps = 4 * ours[0]["n_units"]                                 # Adam's fp32 step counters
    assert held["optimizer_states"] == want["optimizer_states"] + steps  # fp32 master + m + v


@pytest.mark.parametrize("world", [2, 4])
def test_state_bytes_and_comm_bytes(cluster, world):
    """Per stage: bytes held == the formula on the padded count (+ Adam's step counters); bytes
    sent per step == 2 (N-1)/N Psi (stages 0-2) or 3 (N-1)/N Psi (stage 3), measured by trace."""
    from course_lib.estimate import zero_model_state_bytes
    from course_lib.zero import comm_bytes_per_step

    for stage in range(4):
        out = cluster.run(train_zero, "mlp", stage, world, steps=2, trace_comm=True)
        for r in range(world):
            o = out[r]
            want = zero_model_state_bytes(o["padded"], stage, world, precision="fp32")
            held = dict(o["held"])
            held["optimizer_states"] -= 4 * o["n_units"]
            assert held == pytest.approx(want, abs=0), (stage, r, held, want)
            assert o["sent"] == [comm_bytes_per_step(o["padded"], stage, world)] * 2, (stage, o["sent"])


def test_prefetch_gathers_next_layer_during_forward(cluster):
    with_prefetch = cluster.run(units_live, True)
    without = cluster.run(units_live, False)
    assert [m for m, _ in with_prefetch] == [2] * WORLD      # this layer + the next one in flight
    assert [m for m, _ in without] == [1] * WORLD
    assert [a for _, a in with_prefetch] == [0] * WORLD      # all freed after backward


@pytest.mark.parametrize("case,match", [
    ("stage", "stage must be 0, 1, 2 or 3"),
    ("no_params", "no trainable parameters"),
    ("all_frozen", "no trainable parameters"),
    ("too_many_ranks", "world_size=4 is larger than the model's 2 trainable parameters"),
    ("not_module", "wraps an nn.Module"),
    ("transport_and_builtin", "pass one or the other"),
    ("clip", "max_norm must be a positive number"),
])
def test_bad_input(cluster, case, match):
    with pytest.raises(RankError, match=match):
        cluster.run(bad_input, case)


# ------------------------------------------------------------------ clipping and the reduce dtype
def clipped_step(rank, world_size, stage, max_norm, skip_first):
    """One step with clip_grad_norm_ on the 4 ranks: the norm it returned and the new parameters."""
    from course_lib.zero import ZeRO

    model, X, y, loss_fn = MODELS["mlp"]()
    first = next(model.parameters())
    z = ZeRO(model, stage, lr=LR)
    x, t = _shard(rank, world_size, X, y)
    loss_fn(z(x), t).backward()
    norm = z.clip_grad_norm_(max_norm, skip=[first] if skip_first else ())
    z.step()
    params = z.gather_full_parameters()
    z.close()
    return float(norm), params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_counts_every_element_once(cluster, stage):
    """The global norm equals torch.nn.utils.clip_grad_norm_'s on the one-process model (each rank owns
    a slice; stage 0 holds everything everywhere), and the clipped step equals one-process Adam after
    torch's clipping; with ``skip`` the skipped parameter leaves the norm (and is still scaled)."""
    model, X, y, loss_fn = MODELS["mlp"]()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn(model(X), y).backward()
    first_sq = float(next(model.parameters()).grad.square().sum())
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    opt.step()
    assert want > 0.05                                                 # it does clip
    out = cluster.run(clipped_step, stage, 0.05, False)
    for norm, params in out:
        assert norm == pytest.approx(want, rel=1e-5)
        for got, ref in zip(params, model.parameters()):
            torch.testing.assert_close(got, ref.detach(), **TOL)
    skipped = cluster.run(clipped_step, stage, 0.05, True)
    assert [n for n, _ in skipped] == pytest.approx([(want ** 2 - first_sq) ** 0.5] * WORLD, rel=1e-5)


def accumulated_gradient(rank, world_size, stage, reduce_dtype):
    """bf16 parameters, 4 micro-batches of one sample per rank: the largest relative error of this
    rank's reduced gradient slice against the exact (float64) mean of the bf16 micro-batch gradients."""
    import copy

    from course_lib.zero import ZeRO

    model, X, y, loss_fn = MODELS["mlp"]()
    plain = copy.deepcopy(model).to(torch.bfloat16)        # the same bf16 weights, no ZeRO
    z = ZeRO(model, stage, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in plain.parameters()]
    for r in range(world_size):                            # every rank's micro-batches, in one process
        xs, ts = _shard(r, world_size, X, y)
        for m in range(xs.shape[0]):
            plain.zero_grad()
            (loss_fn(plain(xs[m:m + 1].bfloat16()), ts[m:m + 1].bfloat16()) / xs.shape[0]).backward()
            for e, p in zip(exact, plain.parameters()):
                e += p.grad.double() / world_size
    xs, ts = _shard(rank, world_size, X, y)
    for m in range(xs.shape[0]):
        (loss_fn(z(xs[m:m + 1]), ts[m:m + 1].bfloat16()) / xs.shape[0]).backward()
    z.reduce_gradients()
    index = {id(p): k for k, p in enumerate(model.parameters())}
    worst = 0.0
    for u in z.units:
        g = (u.grad_full[u.lo:u.hi] if stage <= 1 else u.grad_shard).double()
        flat = torch.zeros(u.padded, dtype=torch.float64)
        for p, off in zip(u.params, u.offsets):
            flat[off:off + p.numel()] = exact[index[id(p)]].reshape(-1)
        want = flat[u.lo:u.hi]
        worst = max(worst, float(((g - want).abs() / want.abs().clamp_min(1e-3)).max()))
    dtype = str((u.grad_full if stage <= 1 else u.grad_shard).dtype)
    z.close()
    return worst, dtype


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_dtype_float32_accumulates_bf16_gradients_in_fp32(cluster, stage):
    """With bf16 parameters the micro-batch gradients are bf16 either way; summed and reduced in fp32
    (``reduce_dtype=torch.float32``) they agree with the exact mean to fp32 rounding, summed in bf16
    (the default) only to bf16's (2^-8 relative)."""
    fp32 = cluster.run(accumulated_gradient, stage, torch.float32)
    bf16 = cluster.run(accumulated_gradient, stage, None)
    assert all(d == "torch.float32" for _, d in fp32) and all(d == "torch.bfloat16" for _, d in bf16)
    assert max(e for e, _ in fp32) < 1e-5, fp32
    assert max(e for e, _ in bf16) > 1e-3, bf16


def stage3_with_checkpoints(rank, world_size, placement):
    """ZeRO-3 on the GPT with every block re-run in the backward: ``"around"`` a unit (the checkpointed
    wrapper is the unit), ``"inside"`` (the unit is the block a checkpoint re-runs), or ``None``."""
    import torch.nn as nn

    from course_lib import trace
    from course_lib.recompute import checkpoint
    from course_lib.zero import ZeRO

    class Recomputed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x)

    model, X, y, loss_fn = MODELS["gpt"]()
    blocks = list(model.blocks)
    if placement:
        model.blocks = nn.ModuleList([Recomputed(b) for b in blocks])
    z = ZeRO(model, 3, lr=LR, units=list(model.blocks) if placement == "around" else blocks)
    x, t = _shard(rank, world_size, X, y)
    sent = []
    for _ in range(3):
        with trace.Recorder() as rec:
            loss_fn(z(x), t).backward()
            z.step()
            z.zero_grad()
        sent.append(rec.totals()["bytes_sent"])
    params = z.gather_full_parameters()
    z.close()
    return params, sent


def test_stage3_composes_with_activation_checkpointing(cluster):
    """Production's default pairing (FSDP + AC): with the blocks re-run in the backward, the same
    parameters to the bit and the same bytes as without, whether the checkpoint wraps the unit or re-runs
    it inside (there the re-run forward must neither free the unit nor prefetch a unit already done)."""
    plain = cluster.run(stage3_with_checkpoints, None)
    for placement in ("around", "inside"):
        got = cluster.run(stage3_with_checkpoints, placement)
        for r in range(WORLD):
            assert got[r][1] == plain[r][1], (placement, got[r][1], plain[r][1])
            for a, b in zip(got[r][0], plain[r][0]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ the layout, described and drawn
def layout_and_bytes(rank, world_size, stage, world, param_dtype=None):
    """Two steps (Adam's states exist from the first on); the layout and the bytes the rank holds after
    the second backward's reduction, when every model state is alive."""
    from course_lib.zero import ZeRO

    group = _group(world)
    if rank >= world:
        return None
    model, X, y, loss_fn = MODELS["mlp"]()
    z = ZeRO(model, stage, lr=LR, group=group, param_dtype=param_dtype)
    x, t = _shard(rank, world, X, y)
    for _ in range(2):
        loss_fn(z(x).float(), t).backward()
        z.reduce_gradients()
        held = z.state_bytes()
        z.step()
        z.zero_grad()
    layout = z.shard_layout()
    z.close()
    return layout, held


SHARDED = {0: (), 1: ("optimizer_states",), 2: ("gradients", "optimizer_states"),
           3: ("parameters", "gradients", "optimizer_states")}


@pytest.mark.parametrize("world,mixed", [(2, False), (4, False), (4, True)], ids=["N2", "N4", "N4-bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shard_layout_is_what_each_rank_holds(cluster, stage, world, mixed):
    """ZeRO.shard_layout(): the full padded vector or the rank's 1/N slice, per state and unit, as the
    paper's stage says; the N slices tile each unit once; and its bytes are the bytes the rank's tensors
    hold (state_bytes, read from the storages; Adam's 4-byte step counters aside)."""
    import pickle

    out = cluster.run(layout_and_bytes, stage, world, torch.bfloat16 if mixed else None)
    assert all(o is None for o in out[world:])
    sizes = {2: [(36, 36), (42, 42), (7, 8)], 4: [(36, 36), (42, 44), (7, 8)]}[world]   # (numel, padded)
    for r, (layout, held) in enumerate(out[:world]):
        pickle.dumps(layout)                                  # plain data: cluster.run returned it
        assert (layout["rank"], layout["world_size"], layout["stage"]) == (r, world, stage)
        assert [(u["numel"], u["padded"]) for u in layout["units"]] == sizes
        assert [u["name"] for u in layout["units"]] == ["layers.0", "layers.1", "layers.2"]
        for u in layout["units"]:
            mine = (r * u["shard_size"], (r + 1) * u["shard_size"])
            assert u["owned"] == ((0, u["padded"]) if stage == 0 else mine)
            for key in ("parameters", "gradients", "optimizer_states"):
                want = mine if key in SHARDED[stage] else (0, u["padded"])
                assert (u[key]["lo"], u[key]["hi"]) == want, (stage, r, u["name"], key)
            assert u["parameters"]["dtype"] == u["gradients"]["dtype"] == ("bfloat16" if mixed else "float32")
            assert (u["optimizer_states"]["dtype"], u["optimizer_states"]["copies"]) == ("float32", 3 if mixed else 2)
        described = {k: sum(u[k]["bytes"] for u in layout["units"]) for k in held}
        described["optimizer_states"] += 4 * len(layout["units"])   # Adam's step counters
        assert described == held, (stage, r, described, held)
    for key in SHARDED[stage]:                                # the slices tile every unit exactly once
        for i in range(3):
            spans = sorted((o[0]["units"][i][key]["lo"], o[0]["units"][i][key]["hi"]) for o in out[:world])
            assert spans[0][0] == 0 and spans[-1][1] == sizes[i][1]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_plot_zero_stages_draws_the_ranks_own_layouts(cluster):
    """The drawing of the 4 stages, from the layouts the ranks return: rank r's coloured bar of each
    state and unit is the full vector or the r-th slice, exactly where the layout puts it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import viz

    per_stage = [[o[0] for o in cluster.run(layout_and_bytes, s, WORLD)] for s in range(4)]
    fig = viz.plot_zero_stages(per_stage)
    try:
        for stage, ax in enumerate(fig.axes[:4]):
            got = {p.get_gid(): p for p in ax.patches if p.get_gid()}
            for r in range(WORLD):
                for u in per_stage[stage][r]["units"]:
                    x0 = got[f"rank{r}:parameters:{u['name']}:full"].get_x()
                    for key in ("parameters", "gradients", "optimizer_states"):
                        lo, hi = (r * u["shard_size"], (r + 1) * u["shard_size"]) if key in SHARDED[stage] \
                            else (0, u["padded"])
                        p = got[f"rank{r}:{key}:{u['name']}"]
                        assert (p.get_x() - x0, p.get_width()) == pytest.approx((lo, min(hi, u["numel"]) - lo))
                        assert (f"rank{r}:{key}:{u['name']}:padding" in got) == (hi > u["numel"])
    finally:
        plt.close(fig)
