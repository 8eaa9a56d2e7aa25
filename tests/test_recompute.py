"""course_lib.recompute: gradients, RNG, memory and FLOPs of activation checkpointing."""

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

from course_lib import estimate as E
from course_lib import recompute as R
from course_lib.memory import track_memory
from course_lib.models import Block, causal_attention


def _stack(L=6, d=32, p=0.2):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(p)) for _ in range(L)])


def _grads(model, f, x, seed=1):
    """Gradients of sum(f(x)) w.r.t. x (if it requires grad) and the parameters, and the next draw
    of the global RNG after the step (where the step left it)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    f(x).sum().backward()
    gs = ([x.grad.clone()] if x.requires_grad else []) + [p.grad.clone() for p in model.parameters()]
    return gs, torch.rand(4)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_checkpoint_matches_plain_and_torch_with_dropout(requires_grad):
    model = _stack()
    x = torch.randn(8, 32, requires_grad=requires_grad)
    g0, r0 = _grads(model, model, x)
    g1, r1 = _grads(model, lambda x: R.checkpoint(model, x), x)
    g2, r2 = _grads(model, lambda x: tc.checkpoint(model, x, use_reentrant=False), x)
    assert _equal(g0, g1) and _equal(g1, g2)
    assert torch.equal(r0, r1) and torch.equal(r1, r2), "global RNG not left where the plain run leaves it"


@pytest.mark.parametrize("which", ["checkpoint", "reentrant"])
def test_recomputation_replays_the_forwards_autocast(which):
    """The AMP pattern: forward under autocast, backward outside it. The recomputation must run in
    bf16 as the forward did (torch.utils.checkpoint records the autocast state for it): equal to the
    plain run and to torch's checkpoint bit for bit. Recomputing in fp32 gives other gradients (the
    non-reentrant version notices the dtypes of its saved tensors changing, or differs)."""
    model = _stack(p=0.0)
    x = torch.randn(8, 32, requires_grad=True)
    ours = R.checkpoint if which == "checkpoint" else R.checkpoint_reentrant
    use_reentrant = which == "reentrant"

    def under_autocast(f):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return f(x).float()
        return run

    g0, _ = _grads(model, under_autocast(model), x)
    g1, _ = _grads(model, under_autocast(lambda x: ours(model, x)), x)
    g2, _ = _grads(model, under_autocast(lambda x: tc.checkpoint(model, x, use_reentrant=use_reentrant)), x)
    assert _equal(g0, g2), "torch's checkpoint should equal the plain run"
    assert _equal(g1, g2), "the recomputation did not run under the forward's autocast"


def test_without_rng_restore_dropout_masks_differ():
    model = _stack()
    x = torch.randn(8, 32, requires_grad=True)
    g0, _ = _grads(model, model, x)
    g1, _ = _grads(model, lambda x: R.checkpoint(model, x, preserve_rng_state=False), x)
    assert not _equal(g0, g1)


def test_reentrant_matches_when_input_requires_grad_and_loses_params_otherwise():
    model = _stack()
    x = torch.randn(8, 32, requires_grad=True)
    g0, r0 = _grads(model, model, x)
    g1, r1 = _grads(model, lambda x: R.checkpoint_reentrant(model, x), x)
    assert _equal(g0, g1) and torch.equal(r0, r1)
    xn = torch.randn(8, 32)
    assert not R.checkpoint_reentrant(model, xn).requires_grad      # backward can never run
    assert R.checkpoint(model, xn).requires_grad                     # ours: parameters connected


def test_saved_bytes_equal_torch_and_only_the_inputs():
    model = _stack()
    x = torch.randn(8, 32, requires_grad=True)
    params = list(model.parameters())
    _, ours, _ = E.saved_activation_bytes(lambda: R.checkpoint(model, x), exclude=params)
    _, ref, _ = E.saved_activation_bytes(lambda: tc.checkpoint(model, x, use_reentrant=False), exclude=params)
    _, plain, _ = E.saved_activation_bytes(model, x, exclude=params)
    assert ours == ref == x.numel() * 4 < plain


def test_multiple_inputs_kwargs_and_tuple_outputs():
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)
    a, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)

    def f(a, b, scale, *, shift):
        return (a @ w).tanh() * scale + shift, (b @ w).sin()

    def loss(fn):
        w.grad = a.grad = None
        o1, o2 = fn(f, a, b, 2.0, shift=1.0) if fn else f(a, b, 2.0, shift=1.0)
        (o1.sum() + o2.square().sum()).backward()
        return w.grad.clone(), a.grad.clone()

    assert _equal(loss(None), loss(R.checkpoint))


def test_inplace_change_of_input_is_caught():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 1.0
    out = R.checkpoint(lambda t: lin(t).tanh(), h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_nondeterministic_fn_is_caught():
    lin = nn.Linear(4, 4)
    calls = []

    def fn(t):
        calls.append(1)
        return lin(t).tanh().tanh() if len(calls) == 1 else lin(t).tanh()

    out = R.checkpoint(fn, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="same operations"):
        out.sum().backward()


def test_bad_input():
    with pytest.raises(TypeError, match="must be callable"):
        R.checkpoint(torch.randn(3), torch.randn(3))
    with pytest.raises(ValueError, match="segments=0"):
        R.segment_bounds(4, 0)
    with pytest.raises(ValueError, match="segments=5"):
        R.checkpoint_sequential(_stack(L=4), 5, torch.randn(2, 32))
    with pytest.raises(ValueError, match="recompute='some'"):
        R.TransformerBlock(8, 2, recompute="some")


@pytest.mark.parametrize("segments", [1, 2, 3, 6])
def test_sequential_matches_torch_grads_and_bytes(segments):
    model = _stack(L=6)
    x = torch.randn(8, 32, requires_grad=True)
    g0, r0 = _grads(model, model, x)
    g1, r1 = _grads(model, lambda x: R.checkpoint_sequential(model, segments, x), x)
    g2, r2 = _grads(model, lambda x: tc.checkpoint_sequential(model, segments, x, use_reentrant=False), x)
    assert _equal(g0, g1) and _equal(g1, g2) and torch.equal(r0, r1) and torch.equal(r1, r2)
    params = list(model.parameters())
    ours = E.saved_activation_bytes(lambda: R.checkpoint_sequential(model, segments, x), exclude=params)[1]
    ref = E.saved_activation_bytes(
        lambda: tc.checkpoint_sequential(model, segments, x, use_reentrant=False), exclude=params)[1]
    assert ours == ref
    assert R.segment_bounds(6, segments) == [(s, e) for s, e in R.segment_bounds(6, segments)]


def test_segment_bounds_follow_torch_partition():
    assert R.segment_bounds(16, 5) == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 16)]
    assert R.segment_bounds(4, 1) == [(0, 4)]


def test_backward_peak_is_u_shaped_in_segments():
    """Peak live bytes over forward+backward: minimum at an intermediate segment count."""
    torch.manual_seed(0)
    L, d = 16, 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(L)])
    x = torch.randn(1024, d, requires_grad=True)      # activations dominate the 16 weight grads
    peaks = {}
    for k in (1, 2, 4, 8, 16):
        model.zero_grad(set_to_none=True)
        with track_memory() as mem:
            R.checkpoint_sequential(model, k, x).sum().backward()
        peaks[k] = mem.peak_bytes
    best = min(peaks, key=peaks.get)
    assert best in (2, 4, 8) and peaks[best] < peaks[1] and peaks[best] < peaks[16], peaks


def test_one_extra_forward_in_flops():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(16, 32, requires_grad=True)
    _, fwd, _ = E.count_flops(model, x)
    _, plain, _ = E.count_flops(lambda: model(x).sum().backward())
    _, ckpt, _ = E.count_flops(lambda: R.checkpoint(model, x).sum().backward())
    assert plain == 3 * fwd and ckpt == plain + fwd


def test_transformer_block_selective_and_full():
    torch.manual_seed(0)
    ref = Block(32, 4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    blocks = {}
    for mode in R.RECOMPUTE:
        blk = R.TransformerBlock(32, 4, dropout=0.1, recompute=mode)
        blk.load_state_dict(ref.state_dict())
        blocks[mode] = blk
    blocks["none"].eval()
    assert torch.allclose(blocks["none"](x), ref(x), atol=1e-6)      # same layer as models.Block
    grads = {m: _grads(b, b, x) for m, b in blocks.items() if m != "none"}
    blocks["none"].train()
    g0 = _grads(blocks["none"], blocks["none"], x)
    for m, g in grads.items():
        assert _equal(g0[0], g[0]) and torch.equal(g0[1], g[1]), m
    params = {m: list(b.parameters()) for m, b in blocks.items()}
    saved = {m: E.saved_activation_bytes(b, x, exclude=params[m])[1] for m, b in blocks.items()}
    B, s, h, a = 2, 16, 32, 4
    assert saved["full"] == 4 * B * s * h
    # selective removes exactly what the attention core saves besides its inputs q, k, v ...
    q, k, v = (torch.randn(B, a, s, h // a, requires_grad=True) for _ in range(3))
    torch.manual_seed(0)
    core = E.saved_activation_bytes(causal_attention, q, k, v, 0.1, exclude=[q, k, v])[1]
    assert saved["none"] - saved["selective"] == core
    # ... which contains Korthikanti et al.'s s^2 terms (fp32: softmax out 4 + dropout out 4 +
    # dropout mask 1 bytes per a*s^2*b element) and the s^2 causal mask
    assert core >= 9 * a * s * s * B + s * s
