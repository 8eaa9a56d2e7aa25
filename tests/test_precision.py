"""Tests for course_lib.precision: formats against IEEE facts and torch's own rounding, the loss
scalers against torch.amp.GradScaler, master weights against an FP32 optimizer."""

import math
import random
import struct

import pytest
import torch
import torch.nn.functional as F

from course_lib import precision as P
from course_lib.models import TinyMLP, make_regression

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------------- formats


def test_bit_layouts_match_ieee_and_bfloat16():
    assert P.bit_layout(torch.float32) == P.BitLayout(1, 8, 23)
    assert P.bit_layout(torch.float16) == P.BitLayout(1, 5, 10)
    assert P.bit_layout(torch.bfloat16) == P.BitLayout(1, 8, 7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_format_summary_range_is_what_torch_rounds_to(dtype):
    s = P.format_summary(dtype)
    assert s["exponent_bits"] + s["mantissa_bits"] + 1 == s["bits"]

    def r(x):  # round a float64 to dtype and back
        return torch.tensor(x, dtype=torch.float64).to(dtype).item()

    assert r(s["max"]) == s["max"]
    assert math.isinf(r(s["max"] * (1 + s["eps"])))  # one ulp above max overflows
    assert r(s["smallest_subnormal"]) == s["smallest_subnormal"] > 0
    assert r(s["smallest_subnormal"] * 0.5) == 0.0  # half of it ties to even: 0
    assert r(s["smallest_normal"] * 0.5) > 0  # subnormals exist below the smallest normal
    assert r(1 + s["eps"]) > 1 and r(1 + s["eps"] * 0.49) == 1


def test_bits_of_matches_struct_for_fp32_and_known_fp16_patterns():
    for x in [1.0, -2.5, 3.14159, 1e-40, 65504.0]:
        raw = format(struct.unpack(">I", struct.pack(">f", x))[0], "032b")
        assert "".join(P.bits_of(x, torch.float32)) == raw
    assert P.bits_of(1.0, torch.float16) == ("0", "01111", "0" * 10)
    assert P.bits_of(-2.0, torch.bfloat16) == ("1", "10000000", "0" * 7)
    assert P.bits_of(65504.0, torch.float16) == ("0", "11110", "1" * 10)
    # BF16 is the top half of FP32 (for a value that BF16 represents exactly)
    assert "".join(P.bits_of(1.5, torch.bfloat16)) == "".join(P.bits_of(1.5, torch.float32))[:16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ulp_is_the_gap_to_the_next_number(dtype):
    int_dtype = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    for x in [1.0, 0.1, 3.0, 1000.0, 1e-6, 0.0]:
        t = torch.tensor([x], dtype=dtype)
        nxt = (t.view(int_dtype) + 1).view(dtype)  # next representable number above |x| (x >= 0)
        assert P.ulp(x, dtype) == (nxt.double() - t.double()).item(), (x, dtype)


def test_lost_update_threshold_is_half_an_ulp():
    w = 1.0
    for dtype in DTYPES:
        u = P.ulp(w, dtype)
        wt = torch.tensor(w, dtype=dtype)
        assert (wt + torch.tensor(0.49 * u, dtype=dtype)).item() == w
        assert (wt + torch.tensor(0.51 * u, dtype=dtype)).item() != w


def test_format_functions_reject_non_float_dtypes():
    with pytest.raises(TypeError, match="torch.float32"):
        P.bit_layout(torch.int32)
    with pytest.raises(TypeError):
        P.format_summary("fp16")
    with pytest.raises(ValueError, match="non-finite"):
        P.ulp(1e6, torch.float16)  # 1e6 overflows FP16


def test_plot_bit_layouts_runs():
    import matplotlib

    matplotlib.use("Agg")
    ax = P.plot_bit_layouts(value=-1.5)
    assert ax.get_title() and ax.get_xlabel()


# ---------------------------------------------------------------------------- loss scaling


def _torch_scale_sequence(found_infs, **kw):
    """Drive torch.amp.GradScaler with found_inf flags through real gradients; return scales
    (after each update) and growth trackers."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", **kw)
    gs.scale(torch.tensor(1.0))  # lazily creates the scale tensor
    scales, trackers = [], []
    for bad in found_infs:
        p.grad = torch.tensor([float("inf") if bad else 1.0, 1.0])
        gs.step(opt)
        gs.update()
        scales.append(gs.get_scale())
        trackers.append(gs._get_growth_tracker())
    return scales, trackers


@pytest.mark.parametrize("kw", [
    dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2),
    dict(init_scale=5.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1),
])
def test_update_scale_matches_gradscaler(kw):
    rng = random.Random(0)
    flags = [rng.random() < 0.3 for _ in range(60)]
    ref_scales, ref_trackers = _torch_scale_sequence(flags, **kw)
    scale, tracker = kw["init_scale"], 0
    for i, bad in enumerate(flags):
        scale, tracker = P.update_scale(scale, tracker, bad, kw["growth_factor"],
                                        kw["backoff_factor"], kw["growth_interval"])
        assert (scale, tracker) == (ref_scales[i], ref_trackers[i]), f"step {i}"


def test_scale_never_grows_to_inf_like_gradscaler():
    kw = dict(init_scale=2.0**126, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)
    ref, _ = _torch_scale_sequence([False] * 4, **kw)
    s, t, mine = kw["init_scale"], 0, []
    for _ in range(4):
        s, t = P.update_scale(s, t, False, 2.0, 0.5, 1)
        mine.append(s)
    assert mine == ref == [2.0**127] * 4


def test_dynamic_scaler_matches_gradscaler_step_by_step_on_a_gradient_sequence():
    torch.manual_seed(0)
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    p_ref = torch.nn.Parameter(torch.randn(5))
    p_me = torch.nn.Parameter(p_ref.detach().clone())
    opt_ref = torch.optim.SGD([p_ref], lr=0.01, momentum=0.9)
    opt_me = torch.optim.SGD([p_me], lr=0.01, momentum=0.9)
    gs = torch.amp.GradScaler("cpu", **kw)
    me = P.DynamicLossScaler(**kw)
    for step in range(40):
        g = torch.randn(5)
        if step % 7 == 3:
            g[step % 5] = float("inf")
        if step % 11 == 5:
            g[0] = float("nan")
        # the same *unscaled* gradient, scaled by each scaler's current scale through backward
        gs.scale((p_ref * g).sum()).backward()
        me.scale((p_me * g).sum()).backward()
        before = p_ref.detach().clone()
        gs.step(opt_ref)
        gs.update()
        ref_stepped = not torch.equal(before, p_ref.detach())
        stepped = me.step(opt_me)
        me.update(found_inf=not stepped)
        assert stepped == ref_stepped, f"step {step}: skip decision differs"
        assert me.get_scale() == gs.get_scale(), f"step {step}"
        assert torch.equal(p_me, p_ref), f"step {step}: parameters differ"
        opt_ref.zero_grad()
        opt_me.zero_grad()


def test_static_scaler_skips_on_inf_and_keeps_scale():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    s = P.StaticLossScaler(128.0)
    s.scale((p * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
    assert s.step(opt)
    assert torch.equal(p.detach(), torch.tensor([0.0, -1.0, -2.0]))  # unscaled exactly
    opt.zero_grad()
    p.grad = torch.tensor([float("inf"), 0.0, 0.0])
    assert not s.step(opt)
    s.update(True)
    assert s.get_scale() == 128.0
    assert torch.equal(p.detach(), torch.tensor([0.0, -1.0, -2.0]))


def test_unscale_grads_fp16_is_done_in_fp32():
    # 2**-20 * 2**16 = 2**-4: representable; dividing in FP16 by multiplying with 2**-16 (a
    # subnormal in FP16) would still be exact, but with scale 2**30 the inverse 2**-30
    # underflows to 0 in FP16 -- the FP32 path must not.
    g = torch.tensor([2.0**-4], dtype=torch.float16)
    assert not P.unscale_grads_([g], 2.0**16)
    assert g.item() == 2.0**-20
    g = torch.tensor([1.0], dtype=torch.float16)
    P.unscale_grads_([g], 2.0**24)
    assert g.item() == 2.0**-24  # the smallest FP16 subnormal, not 0


def test_unscale_grads_reports_inf_and_nan():
    assert P.unscale_grads_([torch.ones(2), None, torch.tensor([float("nan")])], 2.0)
    assert P.unscale_grads_([torch.tensor([-float("inf")])], 2.0)
    assert not P.has_non_finite([torch.ones(3), None])
    with pytest.raises(ValueError, match="positive finite"):
        P.unscale_grads_([torch.ones(1)], 0.0)


@pytest.mark.parametrize("kw,match", [
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
])
def test_dynamic_scaler_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        P.DynamicLossScaler(**kw)


# --------------------------------------------------------------------------- master weights


def test_master_step_equals_fp32_optimizer_on_the_upcast_gradients():
    torch.manual_seed(0)
    model = TinyMLP(8, 16, 2, 2).half()
    X, y = make_regression(33, 8, 2, seed=1)  # 33: not a power of two
    opt = P.MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  P.DynamicLossScaler(init_scale=2.0**8, growth_interval=2))
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    for step in range(5):
        scale = opt.scaler.get_scale()
        loss = F.mse_loss(model(X.half()).float(), y)
        opt.scaler.scale(loss).backward()
        grads = [p.grad.float() / scale for p in model.parameters()]
        assert opt.step()
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.step()
        for m, r, p in zip(opt.master_params, ref, model.parameters()):
            assert torch.equal(m, r), f"step {step}: master weights differ"
            assert p.dtype == torch.float16 and torch.equal(p, r.half()), "model copy != rounded master"
            assert p.grad is None
    assert opt.scaler.get_scale() == 2.0**10  # grew twice (interval 2, 5 clean steps)


def test_master_step_skips_on_overflow_and_backs_off():
    model = torch.nn.Linear(3, 1).half()
    opt = P.MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                  P.DynamicLossScaler(init_scale=2.0**16))
    before = [m.detach().clone() for m in opt.master_params]
    x = torch.full((1, 3), 100.0, dtype=torch.float16)
    opt.scaler.scale(model(x).float().sum() * 100).backward()  # 2**16 * 1e4 overflows FP16
    assert P.has_non_finite(p.grad for p in model.parameters())
    assert not opt.step()
    assert opt.skipped == 1 and opt.scaler.get_scale() == 2.0**15
    for b, m in zip(before, opt.master_params):
        assert torch.equal(b, m)


def test_master_weights_keep_updates_that_pure_fp16_loses():
    w16 = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    lr, g = 1e-3, 0.1  # update 1e-4 < ulp(1)/2 = 2**-11 in FP16
    assert lr * g < P.ulp(1.0, torch.float16) / 2
    pure = torch.optim.SGD([w16], lr=lr)
    model16 = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    mw = P.MasterWeightOptimizer([model16], lambda ps: torch.optim.SGD(ps, lr=lr))
    for _ in range(100):
        w16.grad = torch.full((4,), -g, dtype=torch.float16)
        pure.step()
        model16.grad = torch.full((4,), -g, dtype=torch.float16)
        mw.step()
    assert torch.all(w16 == 1.0)  # every update was rounded away
    expected = 1.0 + 100 * lr * torch.tensor(-g, dtype=torch.float16).abs().float()
    assert torch.allclose(mw.master_params[0], expected.expand(4), rtol=1e-5)
    assert torch.all(model16 > 1.0)


def test_master_step_rejects_mismatched_params():
    a = [torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]
    with pytest.raises(ValueError, match="make_master_params"):
        P.master_step(a, [], torch.optim.SGD(a, lr=1.0), P.StaticLossScaler(1.0))
    with pytest.raises(ValueError, match="empty"):
        P.make_master_params([])


# ----------------------------------------------------------------------------------- memory


def _tiny_run(B, d_in, h, dtype=None):
    torch.manual_seed(0)
    model = TinyMLP(d_in, h, 1, 3)
    X, y = make_regression(B, d_in, 1, seed=0)

    def fwd():
        if dtype is None:
            return F.mse_loss(model(X), y)
        with torch.autocast("cpu", dtype=dtype):
            out = model(X)
        return F.mse_loss(out.float(), y)

    return model, P.saved_tensors_report(fwd)


def test_saved_tensors_report_counts_exact_bytes():
    B, d_in, h = 37, 5, 24
    model, rep = _tiny_run(B, d_in, h)
    # saved: x, two (pre-GELU, post-GELU) pairs of (B, h), output and target (B, 1)
    assert rep["activations"] == {"float32": 4 * (B * d_in + 4 * B * h + 2 * B)}
    # layers 2 and 3 save their weights (layer 1 does not: x needs no gradient)
    assert rep["parameters"] == {"float32": 4 * (h * h + h)}
    rep["loss"].backward()
    n = sum(p.numel() for p in model.parameters())
    assert P.grad_bytes(model.parameters()) == {"float32": 4 * n}


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_autocast_halves_saved_activations_but_not_weight_grads(dtype, name):
    B, d_in, h = 37, 5, 24
    model, rep = _tiny_run(B, d_in, h, dtype)
    assert rep["activations"] == {name: 2 * (B * d_in + 4 * B * h), "float32": 4 * 2 * B}
    assert rep["parameters"] == {name: 2 * (h * h + h)}  # autocast's 16-bit weight copies
    rep["loss"].backward()
    n = sum(p.numel() for p in model.parameters())
    assert P.grad_bytes(model.parameters()) == {"float32": 4 * n}


def test_lost_update_is_asymmetric_at_a_power_of_two():
    u = P.ulp(1.0, torch.float16)
    one = torch.tensor(1.0, dtype=torch.float16)
    assert (one - torch.tensor(0.3 * u, dtype=torch.float16)).item() < 1.0  # gap below 1 is u/2
    assert (torch.tensor(1.5, dtype=torch.float16) - torch.tensor(0.49 * u, dtype=torch.float16)).item() == 1.5


# ---------------------------------------------------------------------------------- FP8, INT4

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_fp8_format_summaries_match_micikevicius_table_1():
    e4, e5 = P.format_summary(E4M3), P.format_summary(E5M2)
    assert (e4["exponent_bits"], e4["mantissa_bits"], e5["exponent_bits"], e5["mantissa_bits"]) == (4, 3, 5, 2)
    assert e4["max"] == 448.0 and e5["max"] == 57344.0             # (2 - 2**-2) * 2**8, (2 - 2**-2) * 2**15
    assert e4["smallest_normal"] == 2.0 ** -6 and e5["smallest_normal"] == 2.0 ** -14
    assert e4["smallest_subnormal"] == 2.0 ** -9 and e5["smallest_subnormal"] == 2.0 ** -16
    assert e4["eps"] == 2.0 ** -3 and e5["eps"] == 2.0 ** -2
    assert P.bits_of(448.0, E4M3) == ("0", "1111", "110")           # S.1111.111 is E4M3's only NaN
    assert P.dtype_name(E5M2) == "FP8-E5M2"


def test_per_tensor_scaled_e4m3_error_is_at_most_half_an_ulp():
    torch.manual_seed(0)
    # magnitudes spread over 3 decades, far below E4M3's normal range without a scale
    x = torch.exp(torch.empty(4096).uniform_(math.log(5e-7), math.log(5e-4))) * torch.sign(torch.randn(4096))
    q, scale = P.quantize_fp8(x)
    assert q.dtype == E4M3 and scale.item() == pytest.approx(448.0 / x.abs().max().item())
    back = P.dequantize_fp8(q, scale)
    rel = ((back - x).abs() / x.abs()).max().item()
    assert rel <= 2.0 ** -4 * (1 + 1e-6), rel                        # eps / 2, every element
    assert rel > 2.0 ** -6                                           # and the bound is nearly reached
    # without scaling these values are below E4M3's smallest subnormal (2**-9) and vanish
    assert (x.to(E4M3).float() == 0).all()


def test_fp8_saturates_instead_of_overflowing_and_takes_a_given_scale():
    q, s = P.quantize_fp8(torch.tensor([1.0, 1000.0]), scale=1.0)
    assert q.float().tolist() == [1.0, 448.0] and s.item() == 1.0
    q, s = P.quantize_fp8(torch.zeros(3))
    assert s.item() == 1.0 and (P.dequantize_fp8(q, s) == 0).all()
    q, s = P.quantize_fp8(torch.tensor([3.0]), margin=1)             # amax -> 448 / 2
    assert q.float().item() == 224.0 and s.item() == pytest.approx(224.0 / 3.0)
    assert P.dequantize_fp8(q, s).item() == pytest.approx(3.0, rel=1e-6)


def test_fp8_matmul_error_e4m3_below_e5m2_and_scaling_matters():
    torch.manual_seed(1)
    a, b = torch.randn(96, 64), torch.randn(64, 80)
    exact = a @ b
    err4 = P.relative_error(P.fp8_matmul(a, b, E4M3), exact)
    err5 = P.relative_error(P.fp8_matmul(a, b, E5M2), exact)
    assert 1e-3 < err4 < 2.0 ** -4 < err5 < 2.0 ** -3                # one mantissa bit fewer: ~2x the error
    tiny = 1e-4 * a                                                  # unscaled, most of it underflows in E4M3
    unscaled = tiny.to(E4M3).float() @ b.to(E4M3).float()
    assert P.relative_error(P.fp8_matmul(tiny, b), tiny @ b) < 2.0 ** -4 < P.relative_error(unscaled, tiny @ b)


def test_int4_codes_in_range_error_bounded_and_smaller_groups_help():
    torch.manual_seed(2)
    w = torch.randn(32, 512)
    w[:, ::97] *= 20                                                 # a few outlier input channels
    errors = []
    for g in (512, 128, 32):
        codes, scales = P.quantize_int4(w, g)
        assert codes.dtype == torch.int8 and codes.shape == w.shape and scales.shape == (32, 512 // g)
        assert codes.min() >= -8 and codes.max() <= 7
        back = P.dequantize_int4(codes, scales)
        per_weight = scales.repeat_interleave(g, dim=1)
        assert ((back - w).abs() <= per_weight / 2 + 1e-6).all()     # round to nearest: half a step
        errors.append(P.relative_error(back, w))
    assert errors[0] > errors[1] > errors[2]
    assert P.int4_bits_per_weight(128) == 4.125 and P.int4_bits_per_weight(32) == 4.5
    codes, scales = P.quantize_int4(torch.zeros(2, 8), 4)
    assert (codes == 0).all() and (scales == 1).all()


def test_low_precision_bad_input():
    with pytest.raises(TypeError, match="float8"):
        P.quantize_fp8(torch.ones(2), dtype=torch.float16)
    with pytest.raises(TypeError, match="floating-point"):
        P.quantize_fp8(torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        P.quantize_fp8(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="positive"):
        P.quantize_fp8(torch.ones(2), scale=0.0)
    with pytest.raises(ValueError, match="does not divide"):
        P.quantize_int4(torch.ones(4, 100), 128)
    with pytest.raises(ValueError, match="positive int"):
        P.quantize_int4(torch.ones(4, 8), 0)
    with pytest.raises(ValueError, match=r"\(m, k\) @ \(k, n\)"):
        P.fp8_matmul(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="all zeros"):
        P.relative_error(torch.ones(2), torch.zeros(2))
    with pytest.raises(TypeError, match="int8"):
        P.dequantize_int4(torch.ones(2, 4), torch.ones(2, 1))


# ------------------------------------------------------------------ FP8 scaling recipes, accumulation

E4M3_MAX = 448.0


def test_round_mantissa_nearest_is_torch_rounding_and_truncate_rounds_toward_zero():
    torch.manual_seed(3)
    x = torch.randn(4096) * torch.exp2(torch.randint(-20, 20, (4096,)).float())
    x[:3] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(2.0 - 2.0 ** -9)])  # ties to even, carry
    assert torch.equal(P.round_mantissa(x, 7, "nearest"), x.bfloat16().float())     # BF16: 7 bits, RNE
    small = x[x.abs() < 60000]
    small = small[small.abs() > 2.0 ** -14]                                           # FP16's normal range
    assert torch.equal(P.round_mantissa(small, 10, "nearest"), small.half().float())
    t = P.round_mantissa(x, 13)                                                       # truncate (default)
    step = torch.exp2(torch.floor(torch.log2(x.abs().double())) - 13)                 # ulp at 13 bits
    ref = torch.trunc(x.double() / step) * step                                       # toward zero, exact
    assert torch.equal(t.double(), ref)
    assert torch.equal(P.round_mantissa(x, 23), x)


def test_limited_accumulator_error_grows_with_k_and_promotion_brings_it_back():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(8, 2048, generator=g).to(E4M3).float()
    b = torch.randn(2048, 8, generator=g).to(E4M3).float()
    exact = a.double() @ b.double()
    full = P.limited_precision_matmul(a, b, 23)                        # a float32 running sum
    assert P.relative_error(full, exact) < 1e-5
    err = {k: P.relative_error(P.limited_precision_matmul(a[:, :k], b[:k]), exact_k)
           for k, exact_k in ((128, a[:, :128].double() @ b[:128].double()), (2048, exact))}
    promoted = P.relative_error(P.limited_precision_matmul(a, b, promote_every=128), exact)
    assert err[2048] > 5 * err[128] > 0                                # grows with K
    assert promoted < 2 * err[128] < err[2048] / 2                     # back to one 128-chunk's error
    # promotion after the last element is no promotion at all
    assert torch.equal(P.limited_precision_matmul(a[:, :128], b[:128], promote_every=128),
                       P.limited_precision_matmul(a[:, :128], b[:128]))


def test_fp8_matmul_accumulate_options_and_default_unchanged():
    torch.manual_seed(5)
    a, b = torch.randn(8, 1024), torch.randn(1024, 8)
    qa, sa = P.quantize_fp8(a)
    qb, sb = P.quantize_fp8(b)
    assert torch.equal(P.fp8_matmul(a, b), (qa.float() @ qb.float()) / (sa * sb))   # the default
    limited = P.fp8_matmul(a, b, accumulate="limited")
    assert torch.equal(limited, P.limited_precision_matmul(qa.float(), qb.float()) / (sa * sb))
    promoted = P.fp8_matmul(a, b, accumulate="promoted")
    assert torch.equal(promoted, P.limited_precision_matmul(qa.float(), qb.float(), promote_every=128) / (sa * sb))
    ideal = P.fp8_matmul(a, b)
    assert P.relative_error(promoted, ideal) < P.relative_error(limited, ideal) / 3


def test_blockwise_is_per_block_current_scaling_and_isolates_an_outlier():
    torch.manual_seed(6)
    x = torch.randn(4, 256)
    x[0, 5] = 1e5                                                     # one outlier, in tile (0, 0)
    q, s = P.quantize_blockwise(x, (1, 128))
    assert q.dtype == E4M3 and s.shape == (4, 2)
    for r in range(4):                                               # reference: each tile on its own
        for c in range(2):
            ref_q, ref_s = P.quantize_fp8(x[r, 128 * c : 128 * (c + 1)])
            assert torch.equal(q[r, 128 * c : 128 * (c + 1)].view(torch.uint8), ref_q.view(torch.uint8))
            assert s[r, c] == ref_s
    back = P.dequantize_blockwise(q, s)
    other = torch.ones_like(x, dtype=torch.bool)
    other[0, :128] = False                                           # every tile but the outlier's
    assert P.relative_error(back[other], x[other]) < 2.0 ** -4
    per_tensor = P.dequantize_fp8(*P.quantize_fp8(x))
    assert P.relative_error(per_tensor[other], x[other]) > 4 * P.relative_error(back[other], x[other])
    w = torch.randn(256, 384)
    qw, sw = P.quantize_blockwise(w, (128, 128))
    assert sw.shape == (2, 3) and sw[1, 2] == E4M3_MAX / w[128:, 256:].abs().max()
    assert P.relative_error(P.dequantize_blockwise(qw, sw), w) < 2.0 ** -4


def test_fp8_matmul_block_scaling_equals_dequantised_operands():
    torch.manual_seed(7)
    a, b = torch.randn(6, 256), torch.randn(256, 200)                 # n = 200: a partial 128-block
    a[:, 3] *= 1000                                                  # an outlier channel
    da = P.dequantize_blockwise(*P.quantize_blockwise(a, (1, 128)))
    bp = torch.cat([b, torch.zeros(256, 56)], dim=1)
    db = P.dequantize_blockwise(*P.quantize_blockwise(bp, (128, 128)))[:, :200]
    out = P.fp8_matmul(a, b, scaling="block")
    torch.testing.assert_close(out, da @ db, rtol=1e-5, atol=1e-3)
    exact = a @ b
    promoted = P.fp8_matmul(a, b, scaling="block", accumulate="promoted")
    assert P.relative_error(promoted, exact) < 1.2 * P.relative_error(out, exact)
    assert P.relative_error(out, exact) < P.relative_error(P.fp8_matmul(a, b), exact)


def test_mx_scale_is_the_specs_power_of_two_and_clips_above_448():
    x = torch.tensor([[1.0, -3.0, 0.25, 2.0] * 8 + [0.5] * 31 + [500.0]])  # two 32-blocks
    x = torch.cat([x, torch.zeros(1, 64)])                               # a zero row
    q, codes = P.quantize_mx(x)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 2)
    # floor(log2 amax) - 8 (E4M3's emax), biased by 127: 3 -> 2**1 = 2; 500 -> 2**8 = 256
    assert codes[0].tolist() == [1 - 8 + 127, 8 - 8 + 127] and codes[1].tolist() == [127, 127]
    back = P.dequantize_mx(q, codes)
    assert torch.equal(back[0, :32], x[0, :32])                          # exact in E4M3 after / 2**-7
    assert back[0, 63].item() == 448.0                                   # 500 / X = 500 > 448: clipped
    y = torch.tensor([[1.9 * 2.0 ** 5] + [1.0] * 31])                    # amax 60.8: X = 2**(5-8)
    qy, cy = P.quantize_mx(y)
    assert cy.item() == 5 - 8 + 127 and P.dequantize_mx(qy, cy)[0, 0].item() == 448 * 2.0 ** -3  # clipped
    torch.manual_seed(8)
    z = torch.randn(16, 256)
    assert P.relative_error(P.dequantize_mx(*P.quantize_mx(z)), z) < 2.0 ** -4


def test_delayed_scaler_uses_the_history_and_saturates_on_a_spike():
    d = P.DelayedScaler(history_len=3)
    assert d.scale() == 1.0                                            # nothing recorded yet
    for amax in (2.0, 4.0, 1.0):
        d.quantize(torch.tensor([amax, -amax / 2]))
    assert d.scale() == E4M3_MAX / 4.0                                 # max of the last 3
    q, s = d.quantize(torch.tensor([100.0, 1.0]))                      # a spike: saturates at 448
    assert s.item() == E4M3_MAX / 4.0 and P.dequantize_fp8(q, s)[0].item() == 4.0
    assert d.history == [4.0, 1.0, 100.0] and d.scale() == E4M3_MAX / 100.0
    for _ in range(3):
        d.quantize(torch.tensor([1.0]))
    assert d.scale() == E4M3_MAX / 1.0                                 # the spike left the window


def _fp8_all_gather_work(rank, world_size):
    from course_lib import precision as P, trace
    w = torch.randn(30, 11, generator=torch.Generator().manual_seed(9)) * 0.02   # 330: no multiple of 4
    w[7, 3] = 0.5
    out = {}
    for name, ranks in (("world", list(range(world_size))), ("pair", [0, 2])):
        group = torch.distributed.new_group(ranks)
        if rank not in ranks:
            continue
        r, n = ranks.index(rank), len(ranks)
        full = w.reshape(-1)[: 110 * n]
        shard = full[110 * r : 110 * (r + 1)]
        with trace.Recorder() as rec:
            q, s = P.fp8_all_gather(shard, group=group)
        built_q, built_s = P.fp8_all_gather(shard, group=group, builtin=True)
        out[name] = (q.view(torch.uint8), s, built_q.view(torch.uint8), built_s, full,
                     rec.totals()["bytes_sent"], n)
    return out


def test_fp8_all_gather_equals_one_process_quantisation_with_half_the_bytes():
    from course_lib.launch import run
    res = run(_fp8_all_gather_work, 3)
    for rank, out in enumerate(res):
        assert set(out) == ({"world", "pair"} if rank != 1 else {"world"})
        for q, s, bq, bs, full, sent, n in out.values():
            ref_q, ref_s = P.quantize_fp8(full)
            assert torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            assert torch.equal(bq, q) and torch.equal(bs, s)
            assert sent == (n - 1) * (112 + 4)                       # 110 FP8 bytes padded to 112, one amax
            assert sent < 0.53 * (n - 1) * 2 * 110                    # vs a BF16 all-gather


def test_scaling_recipes_bad_input():
    with pytest.raises(ValueError, match="does not tile"):
        P.quantize_blockwise(torch.ones(4, 100))
    with pytest.raises(ValueError, match="2-D"):
        P.quantize_blockwise(torch.ones(128))
    with pytest.raises(ValueError, match="does not divide"):
        P.quantize_mx(torch.ones(2, 40))
    with pytest.raises(TypeError, match="uint8"):
        P.dequantize_mx(torch.ones(2, 32).to(E4M3), torch.ones(2, 1))
    with pytest.raises(ValueError, match="history_len"):
        P.DelayedScaler(history_len=0)
    with pytest.raises(ValueError, match="margin"):
        P.DelayedScaler(margin=-1)
    with pytest.raises(TypeError, match="float32"):
        P.round_mantissa(torch.ones(2, dtype=torch.float64), 13)
    with pytest.raises(ValueError, match=r"\[0, 23\]"):
        P.round_mantissa(torch.ones(2), 24)
    with pytest.raises(ValueError, match="accumulate"):
        P.fp8_matmul(torch.ones(2, 128), torch.ones(128, 2), accumulate="fp16")
    with pytest.raises(ValueError, match="multiple of 128"):
        P.fp8_matmul(torch.ones(2, 100), torch.ones(100, 2), scaling="block")
    with pytest.raises(ValueError, match="promoted"):
        P.fp8_matmul(torch.ones(2, 128), torch.ones(128, 2), scaling="block", accumulate="limited")
    with pytest.raises(ValueError, match="interval=128"):
        P.fp8_matmul(torch.ones(2, 256), torch.ones(256, 2), scaling="block", accumulate="promoted", interval=64)


def test_fp8_matmul_equals_torch_scaled_mm():
    """The default (FP32-accumulated) emulation is PyTorch's own FP8 GEMM on the same scaled inputs."""
    torch.manual_seed(10)
    a, b = torch.randn(12, 256), torch.randn(256, 20)
    qa, sa = P.quantize_fp8(a)
    qb, sb = P.quantize_fp8(b)
    ref = torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=1 / sa, scale_b=1 / sb, out_dtype=torch.float32)
    assert P.relative_error(P.fp8_matmul(a, b), ref) < 1e-6
