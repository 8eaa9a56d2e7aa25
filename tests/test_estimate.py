"""Tests of course_lib.estimate: the published formulas and tables, and measurements in PyTorch.

Expected values are written out by hand from the papers (the formula as printed, evaluated here),
never by calling the function under test twice.
"""

import math

import pytest
import torch
import torch.nn as nn

from course_lib import estimate as E
from course_lib.models import Block, TinyGPT


# --------------------------------------------------------------------------- FLOPs vs FlopCounterMode

@pytest.mark.parametrize("B,d_in,d_out", [(1, 1, 1), (3, 5, 7), (8, 64, 16)])
def test_dense_flops_match_flop_counter(B, d_in, d_out):
    torch.manual_seed(0)
    layer = nn.Linear(d_in, d_out)
    x = torch.randn(B, d_in, requires_grad=True)
    _, fwd, _ = E.count_flops(layer, x)
    assert fwd == E.dense_forward_flops(B, d_in, d_out) == 2 * B * d_in * d_out

    _, train, per_op = E.count_flops(lambda: layer(x).sum().backward())
    assert train == E.dense_training_flops(B, d_in, d_out) == 6 * B * d_in * d_out
    # the backward's two matmuls (dX and dW) are both counted as aten.mm
    assert per_op["aten.mm"] == 4 * B * d_in * d_out

    x_data = torch.randn(B, d_in)  # data input: no dX in the backward
    _, train_first, _ = E.count_flops(lambda: layer(x_data).sum().backward())
    assert train_first == E.dense_training_flops(B, d_in, d_out, input_requires_grad=False)
    assert train_first == 4 * B * d_in * d_out


@pytest.mark.parametrize("B,n,d,a", [(2, 16, 32, 4), (3, 7, 24, 3), (1, 33, 16, 1)])
def test_transformer_layer_flops_match_flop_counter(B, n, d, a):
    torch.manual_seed(0)
    block = Block(d, a)
    x = torch.randn(B, n, d, requires_grad=True)
    expected = 24 * B * n * d * d + 4 * B * n * n * d  # Narayanan et al. 2021, §5.1
    _, fwd, _ = E.count_flops(block, x)
    assert fwd == E.transformer_layer_flops(B, n, d) == expected
    _, train, _ = E.count_flops(lambda: block(x).sum().backward())
    assert train == 3 * expected


def test_breakdown_terms_and_ffn_mult():
    B, n, d = 2, 5, 8
    parts = E.transformer_layer_flops_breakdown(B, n, d)
    assert parts == {"qkv": 6 * B * n * d * d, "scores": 2 * B * n * n * d,
                     "weighted_sum": 2 * B * n * n * d, "out_proj": 2 * B * n * d * d,
                     "ffn": 16 * B * n * d * d}
    # a 2d FFN halves the FFN term only
    assert E.transformer_layer_flops_breakdown(B, n, d, ffn_mult=2)["ffn"] == 8 * B * n * d * d


def test_gpt_training_flops_match_flop_counter_and_6N():
    torch.manual_seed(0)
    L, V, T, d, a, B = 2, 64, 16, 32, 4, 3
    model = TinyGPT(vocab_size=V, block_size=T, n_layer=L, n_head=a, n_embd=d)
    idx = torch.randint(0, V, (B, T))
    _, counted, _ = E.count_flops(lambda: model(idx).sum().backward())
    assert counted == E.gpt_training_flops(L, B, T, d, vocab_size=V)
    # Kaplan's 6N per token counts the matmul weights N' = 12 L d^2 + V d (the tied LM head), and
    # leaves out the attention term 12 L n d per token (forward 4 B n^2 d per layer, times 3).
    tokens = B * T
    n_matmul = 12 * L * d * d + V * d
    assert counted == E.training_flops(n_matmul, tokens) + 12 * L * T * d * tokens


@pytest.mark.parametrize("L,d,V,T", [(2, 32, 64, 32), (3, 48, 50, 7), (1, 8, 1, 1)])
def test_param_count_matches_tinygpt(L, d, V, T):
    model = TinyGPT(vocab_size=V, block_size=T, n_layer=L, n_head=2 if d % 2 == 0 else 1, n_embd=d)
    assert E.gpt_param_count(L, d, V, T) == sum(p.numel() for p in model.parameters())


def test_param_count_gpt2_sizes():
    # GPT-2 small and medium (Radford et al. 2019), by hand: L(12d^2+13d) + Vd + n_ctx d + 2d
    assert E.gpt_param_count(12, 768, 50257, 1024) == 124_439_808
    assert E.gpt_param_count(24, 1024, 50257, 1024) == 354_823_168
    # the source's count is the per-layer part only
    assert E.gpt_param_count(24, 1024) == 24 * (12 * 1024 ** 2 + 13 * 1024) + 2 * 1024
    assert E.gpt_param_count(1, 4, 10, 0, tied_embeddings=False) == 12 * 16 + 13 * 4 + 2 * 40 + 8


def test_6N():
    assert E.training_flops_per_token(7e9) == 42e9
    assert E.training_flops(1e9, 2e12) == 6 * 1e9 * 2e12


# --------------------------------------------------------------------------- model states

def test_source_7b_fp32_adam_is_112_gb():
    s = E.model_state_bytes(7e9, "fp32", "adam")
    assert s == {"parameters": 28e9, "gradients": 28e9, "optimizer_states": 56e9}
    assert sum(s.values()) / E.GB == 112.0
    # mixed precision Adam is also 16 bytes per parameter (2 + 2 + 12), ZeRO §3.1
    assert sum(E.model_state_bytes(7e9, "mixed", "adam").values()) == 112e9


@pytest.mark.parametrize("precision,optimizer,per_param,k", [
    ("fp32", "adam", 16, 8), ("fp32", "sgd", 8, 0), ("fp32", "sgd_momentum", 12, 4),
    ("mixed", "adam", 16, 12), ("mixed", "sgd", 8, 4), ("mixed", "sgd_momentum", 12, 8),
])
def test_bytes_per_param(precision, optimizer, per_param, k):
    assert sum(E.model_state_bytes(1000, precision, optimizer).values()) == per_param * 1000
    assert E.optimizer_k(precision, optimizer) == k


def test_zero_figure_1():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB
    psi, N, K = 7.5e9, 64, 12
    by_hand = [(4 + K) * psi, 4 * psi + K * psi / N, 2 * psi + (2 + K) * psi / N, (4 + K) * psi / N]
    printed = [120.0, 31.4, 16.6, 1.9]
    for stage in range(4):
        total = sum(E.zero_model_state_bytes(psi, stage, N).values())
        assert total == pytest.approx(by_hand[stage], rel=1e-12)
        assert round(total / E.GB, 1) == printed[stage]


def test_zero_parts_and_one_device():
    parts = E.zero_model_state_bytes(100, 2, 4)
    assert parts == {"parameters": 200, "gradients": 50, "optimizer_states": 300}
    for stage in range(4):  # with N = 1 partitioning changes nothing
        assert E.zero_model_state_bytes(10, stage, 1) == E.model_state_bytes(10, "mixed", "adam")


def test_largest_model_that_fits():
    M = 80e9
    assert E.largest_model_that_fits(M, 0, 8) == pytest.approx(5e9)          # 80 GB / 16 B
    assert E.largest_model_that_fits(M, 3, 8) == pytest.approx(40e9)         # 80 GB * 8 / 16 B
    assert E.largest_model_that_fits(M, 1, 4) == pytest.approx(80e9 / (4 + 12 / 4))
    assert E.largest_model_that_fits(M, 0, 1, reserved_bytes=16e9) == pytest.approx(4e9)
    for stage in range(4):  # the answer fills the device exactly
        psi = E.largest_model_that_fits(M, stage, 16, reserved_bytes=1e9)
        assert sum(E.zero_model_state_bytes(psi, stage, 16).values()) + 1e9 == pytest.approx(M)


def test_measured_model_states_of_tinygpt():
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 64, (2, 32))
    n = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))

    for opt_cls, name, extra in [(torch.optim.Adam, "adam", 4 * n_tensors),  # Adam's 1-element fp32 step
                                 (torch.optim.SGD, "sgd", 0)]:
        model.zero_grad(set_to_none=True)
        opt = opt_cls(model.parameters(), lr=1e-3)
        model(idx).sum().backward()
        opt.step()
        measured = E.measured_model_state_bytes(model, opt)
        predicted = E.model_state_bytes(n, "fp32", name)
        assert measured["parameters"] == predicted["parameters"]
        assert measured["gradients"] == predicted["gradients"]
        assert measured["optimizer_states"] == predicted["optimizer_states"] + extra

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.step()
    assert (E.measured_model_state_bytes(model, opt)["optimizer_states"]
            == E.model_state_bytes(n, "fp32", "sgd_momentum")["optimizer_states"])


# --------------------------------------------------------------------------- activations

# Korthikanti et al. 2022, Table 2, typed in as printed (bytes per layer)
TABLE_2 = {
    ("none", 1, False): lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    ("none", "t", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", "t", True): lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    ("selective", "t", False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", "t", True): lambda s, b, h, a, t: s * b * h * (34 / t),
    ("full", "t", False): lambda s, b, h, a, t: 2 * s * b * h,
}


@pytest.mark.parametrize("s,b,h,a,t", [
    (2048, 1, 12288, 96, 8),    # GPT-3 175B in Korthikanti Table 3
    (2048, 1, 20480, 128, 8),   # 530B
    (1024, 8, 1024, 16, 4),     # GPT-2 medium-like
    (100, 3, 40, 5, 5),
])
def test_korthikanti_table_2(s, b, h, a, t):
    for (recompute, tdeg, sp), formula in TABLE_2.items():
        tt = 1 if tdeg == 1 else t
        got = E.activation_bytes_per_layer(s, b, h, a, tp=tt, sequence_parallel=sp,
                                           recompute=recompute)
        assert got == pytest.approx(formula(s, b, h, a, tt), rel=1e-12), (recompute, tt, sp)


def test_gpt3_per_layer_numbers():
    # s=2048, b=1, h=12288, a=96: 5as/h = 80, so 114 sbh without parallelism; t=8 with SP: 14.25 sbh
    s, b, h, a = 2048, 1, 12288, 96
    assert E.activation_bytes_per_layer(s, b, h, a) == 114 * s * b * h
    assert E.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True) == 14.25 * s * b * h


def test_terms_sum_to_eq_1():
    s, b, h, a = 64, 2, 32, 4
    terms = E.activation_bytes_terms(s, b, h, a)
    attention = sum(terms[k] for k in ("qkv_input", "q_k", "v", "softmax_output",
                                       "softmax_dropout_mask", "softmax_dropout_output",
                                       "out_proj_input")) + s * b * h  # + attention dropout mask
    mlp = terms["mlp_input"] + terms["gelu_input"] + terms["fc2_input"] + s * b * h
    assert attention == 11 * s * b * h + 5 * a * s * s * b  # §4.1, attention block
    assert mlp == 19 * s * b * h                            # §4.1, MLP
    assert terms["layernorm_inputs"] == 4 * s * b * h        # §4.1, layer norms
    assert sum(terms.values()) == 34 * s * b * h + 5 * a * s * s * b


@pytest.mark.parametrize("dtype,p", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("B,n,d,a", [(2, 16, 32, 4), (3, 10, 24, 3)])
def test_saved_activations_of_block_match_formula(dtype, p, B, n, d, a):
    """PyTorch saves exactly the no-dropout terms, plus two implementation extras:
    each LayerNorm's per-row mean and 1/std (2 LN x 2 x s*b values) and the causal mask (n*n bools)."""
    torch.manual_seed(0)
    block = Block(d, a).to(dtype)
    x = torch.randn(B, n, d, dtype=dtype, requires_grad=True)
    _, measured, _ = E.saved_activation_bytes(block, x, exclude=list(block.parameters()))
    formula = E.activation_bytes_per_layer(n, B, d, a, bytes_per_value=p, dropout=False)
    assert formula == n * B * d * 16 * p + a * n * n * B * p
    extras = 2 * 2 * n * B * p + n * n
    assert measured == formula + extras


def test_full_recompute_saves_only_the_input():
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    B, n, d, a = 2, 16, 32, 4
    block = Block(d, a)
    x = torch.randn(B, n, d, requires_grad=True)
    _, measured, _ = E.saved_activation_bytes(
        lambda: checkpoint(block, x, use_reentrant=False), exclude=list(block.parameters()))
    assert measured == E.activation_bytes_per_layer(n, B, d, a, recompute="full", bytes_per_value=4)


def test_training_memory_combines_parts():
    mem = E.training_memory(7e9, 32, 4096, 1, 4096, 32, zero_stage=3, dp_degree=8, tp=2,
                            sequence_parallel=True, recompute="selective")
    assert mem["parameters"] == pytest.approx(2 * 7e9 / 8 / 2)
    assert mem["optimizer_states"] == pytest.approx(12 * 7e9 / 8 / 2)
    assert mem["activations"] == pytest.approx(32 * 4096 * 4096 * 34 / 2)
    fp32 = E.training_memory(1e6, 2, 16, 2, 32, 4, precision="fp32")
    # fp32 values are 4 bytes; dropout masks stay 1 byte: sbh(16*4 + 2) + as^2b(2*4 + 1)
    assert fp32["activations"] == 2 * (16 * 2 * 32 * 66 + 4 * 16 * 16 * 2 * 9)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,match", [
    (lambda: E.dense_forward_flops(-1, 4, 4), "batch must be >= 1"),
    (lambda: E.transformer_layer_flops(2, 0, 8), "seq must be >= 1"),
    (lambda: E.gpt_param_count(2, 8, vocab_size=-5), "vocab_size must be >= 0"),
    (lambda: E.model_state_bytes(-7e9), "n_params must be positive"),
    (lambda: E.model_state_bytes(7e9, "fp8"), "precision='fp8'"),
    (lambda: E.model_state_bytes(7e9, optimizer="lion"), "optimizer='lion'"),
    (lambda: E.zero_model_state_bytes(7e9, 4, 8), "stage must be 0, 1, 2 or 3"),
    (lambda: E.zero_model_state_bytes(7e9, 1, 0), "dp_degree must be >= 1"),
    (lambda: E.activation_bytes_per_layer(128, 1, 96, 12, tp=5), "tp=5 does not divide heads=12"),
    (lambda: E.activation_bytes_per_layer(10, 1, 96, 12, tp=4, sequence_parallel=True),
     "divisible by 4"),
    (lambda: E.activation_bytes_per_layer(16, 1, 30, 4), "hidden=30 is not divisible by heads=4"),
    (lambda: E.activation_bytes_per_layer(16, 1, 32, 4, recompute="some"), "recompute='some'"),
    (lambda: E.largest_model_that_fits(80e9, 0, 1, reserved_bytes=90e9), "nothing fits"),
    (lambda: E.largest_model_that_fits(-1, 0, 1), "device_bytes must be positive"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_non_integer_sizes_raise_type_error():
    with pytest.raises(TypeError, match="batch must be an integer"):
        E.dense_forward_flops(2.5, 4, 4)
    with pytest.raises(TypeError, match="n_params must be a number"):
        E.model_state_bytes("7B")


def test_gb_is_decimal():
    assert E.GB == 1e9 and not math.isclose(E.GB, 2 ** 30)


# --------------------------------------------------------------------------- the widget calculator

def test_memory_calculator_update_matches_library():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.widgets import MemoryCalculator

    calc = MemoryCalculator()
    got = calc.update(n_params_billion=7.5, zero_stage=2, dp_degree=64, precision="mixed",
                      optimizer="adam", micro_batch=2, seq=1024, hidden=4096, n_layer=32, heads=32)
    expected = E.training_memory(7.5e9, 32, 1024, 2, 4096, 32, zero_stage=2, dp_degree=64)
    assert got == pytest.approx(expected)
    # the figure's bars are the four ZeRO stages; the selected one's stack sums to the total
    ax = calc.figure.axes[0]
    heights = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        heights[x] = heights.get(x, 0.0) + patch.get_height()
    assert len(heights) == 4
    assert heights[2] == pytest.approx(sum(expected.values()) / E.GB)
    # a control change (as a user would make) redraws through the observer
    calc.controls["zero_stage"].value = 3
    assert calc.figure is not None and "(selected)" in calc.figure.axes[0].get_xticklabels()[3].get_text()


def test_memory_calculator_reports_invalid_settings():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.widgets import MemoryCalculator

    calc = MemoryCalculator()
    assert calc.update(heads=12, tp=8) is None  # 8 does not divide 12 heads
    assert calc.figure is None
    with pytest.raises(ValueError, match="unknown setting"):
        calc.update(batch=3)


# --------------------------------------------------------------------------- FLOPs -> time

def test_gpt3_training_time_on_1024_a100s_is_34_days():
    # Narayanan et al. 2021, §5.1: T = 300B tokens, P = 175B, n = 1024 A100s at X = 140 TFLOP/s per
    # GPU (achieved, recomputation included): 8 T P / (n X) = "34 days". With 6ND model FLOPs the
    # same run has MFU = (6/8) * 140 / 312.
    C = E.training_flops(175e9, 300e9)
    assert C == pytest.approx(6 * 175e9 * 300e9)
    mfu = 6 / 8 * 140e12 / 312e12
    t = E.training_seconds(C, E.A100_BF16_PEAK_FLOPS, mfu, n_devices=1024)
    assert t == pytest.approx(8 * 300e9 * 175e9 / (1024 * 140e12))
    assert round(t / 86400) == 34
    assert E.human_duration(t) == "34 days"
    assert E.model_flops_utilization(C, t, E.A100_BF16_PEAK_FLOPS, 1024) == pytest.approx(mfu)
    # one GPU: 1024 times longer
    assert E.training_seconds(C, 312e12, mfu) == pytest.approx(1024 * t)


def test_training_seconds_simple_and_bad_input():
    assert E.training_seconds(1e15, 1e12, 0.5, n_devices=2) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="mfu=1.5 is above 1"):
        E.training_seconds(1e15, 1e12, 1.5)
    with pytest.raises(ValueError, match="mfu must be positive"):
        E.training_seconds(1e15, 1e12, 0)
    with pytest.raises(ValueError, match="n_devices must be >= 1"):
        E.training_seconds(1e15, 1e12, 0.5, n_devices=0)


@pytest.mark.parametrize("seconds, text", [(3 * 365.25 * 86400, "3 years"), (95.4 * 365.25 * 86400, "95 years"),
                                           (1.5 * 86400, "1.5 days"), (7200, "2 hours"),
                                           (90, "1.5 minutes"), (0.5, "0.5 s")])
def test_human_duration(seconds, text):
    assert E.human_duration(seconds) == text


def test_output_layer_is_4sbh_times_1_plus_v_over_h():
    s, b, h, v = 16, 3, 32, 96
    assert E.output_layer_activation_bytes(s, b, h, v) == 4 * s * b * h * (1 + v / h)   # §4.3, p=2
    assert E.output_layer_activation_bytes(s, b, h, v, bytes_per_value=4) == 8 * s * b * h + 4 * s * b * v
    with pytest.raises(ValueError, match="vocab_size"):
        E.output_layer_activation_bytes(s, b, h, 0)


@pytest.mark.parametrize("L,B,n,d,a,V", [(1, 4, 32, 64, 2, 64), (2, 3, 10, 24, 3, 50)])
def test_gpt_activation_bytes_match_tinygpt(L, B, n, d, a, V):
    """TinyGPT saves the formula's bytes plus the implementation extras of the layer test (LayerNorm
    statistics, causal mask), the final LayerNorm's statistics, the token ids, positions and targets
    (int64) and the cross-entropy's one-element total weight."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    gpt = TinyGPT(vocab_size=V, block_size=n, n_layer=L, n_head=a, n_embd=d)
    x = torch.randint(0, V, (B, n))
    y = torch.randint(0, V, (B, n))
    _, measured, _ = E.saved_activation_bytes(
        lambda: F.cross_entropy(gpt(x).reshape(-1, V), y.reshape(-1)), exclude=list(gpt.parameters()))
    formula = E.gpt_activation_bytes(L, n, B, d, a, V, bytes_per_value=4, dropout=False)
    assert formula == L * E.activation_bytes_per_layer(n, B, d, a, bytes_per_value=4, dropout=False) \
        + 8 * n * B * d + 4 * n * B * V
    extras = L * (2 * 2 * n * B * 4 + n * n) + 2 * n * B * 4 + 8 * n * B + 8 * n + 8 * n * B + 4
    assert measured == formula + extras
    # linear in the micro-batch: k micro-batches alive together keep k times the bytes
    assert E.gpt_activation_bytes(L, n, 4 * B, d, a, V) == 4 * E.gpt_activation_bytes(L, n, B, d, a, V)


# --------------------------------------------------------------------------- MFU vs HFU, cost

def test_hardware_flops_six_vs_eight_nd():
    N, D = 1e9, 2e10
    assert E.hardware_flops(N, D) == pytest.approx(6 * N * D)
    # full recomputation: forward 2ND, forward again 2ND, backward 4ND
    assert E.hardware_flops(N, D, recompute="full") == pytest.approx(2 * N * D + 2 * N * D + 4 * N * D)
    with pytest.raises(ValueError, match="recompute"):
        E.hardware_flops(N, D, recompute="selective")


def test_hfu_is_four_thirds_of_mfu_with_full_recompute():
    C, t, peak = 6e21, 1e5, 312e12
    mfu = E.model_flops_utilization(C, t, peak, n_devices=400)
    assert mfu == pytest.approx(6e21 / (1e5 * 400 * 312e12))
    assert E.hardware_flops_utilization(C, t, peak, n_devices=400) == pytest.approx(mfu)
    assert E.hardware_flops_utilization(C, t, peak, 400, recompute="full") == pytest.approx(mfu * 8 / 6)
    with pytest.raises(ValueError):
        E.hardware_flops_utilization(C, t, peak, 400, recompute="yes")


def test_gpt3_costs_about_0p7_million_a100_hours_at_40_percent_mfu():
    # 6 * 175e9 * 300e9 = 3.15e23 FLOPs; one A100 at 312e12 * 0.4 = 1.248e14 FLOP/s
    C = E.training_flops(175e9, 300e9)
    assert C == pytest.approx(3.15e23)
    want_hours = 3.15e23 / (312e12 * 0.4) / 3600            # = 701,122 GPU-hours
    got = E.training_cost(C, peak_flops=312e12, mfu=0.4, gpu_hour_price=2.0, gpu_power_watts=400,
                          pue=1.1, n_devices=1024)
    assert got["gpu_hours"] == pytest.approx(want_hours)
    assert 0.69e6 < got["gpu_hours"] < 0.71e6
    assert got["dollars"] == pytest.approx(2.0 * want_hours)
    assert got["energy_kwh"] == pytest.approx(want_hours * 0.4 * 1.1)     # kW x h x PUE
    assert got["wall_seconds"] == pytest.approx(want_hours * 3600 / 1024)
    assert "wall_seconds" not in E.training_cost(C, peak_flops=312e12, mfu=0.4, gpu_hour_price=2.0,
                                                 gpu_power_watts=400)


@pytest.mark.parametrize("kwargs,err,words", [
    ({"mfu": 1.5}, ValueError, "above 1"),
    ({"mfu": 0}, ValueError, "mfu"),
    ({"gpu_hour_price": -1}, ValueError, "gpu_hour_price"),
    ({"gpu_power_watts": "400"}, TypeError, "gpu_power_watts"),
    ({"pue": 0.9}, ValueError, "pue"),
    ({"n_devices": 0}, ValueError, "n_devices"),
])
def test_training_cost_rejects_bad_input(kwargs, err, words):
    args = dict(peak_flops=312e12, mfu=0.4, gpu_hour_price=2.0, gpu_power_watts=400)
    args.update(kwargs)
    with pytest.raises(err, match=words):
        E.training_cost(1e21, **args)
    with pytest.raises(TypeError):
        E.training_cost(1e21, 312e12, 0.4, 2.0, 400)        # keyword-only: no positional mix-ups


def test_published_runs_have_sources_and_agree_with_6nd():
    names = [r["name"] for r in E.PUBLISHED_TRAINING_RUNS]
    assert {"GPT-3 175B", "Chinchilla 70B", "Llama 2 70B"} <= set(names)
    for r in E.PUBLISHED_TRAINING_RUNS:
        assert r["source"] and r["params"] > 0 and r["tokens"] > 0, r["name"]
        if "training_flops" in r:     # the published compute is 6ND to within 10 %
            assert r["training_flops"] / E.training_flops(r["params"], r["tokens"]) == pytest.approx(1, abs=0.1), r["name"]
    llama2 = E.PUBLISHED_TRAINING_RUNS[names.index("Llama 2 70B")]
    # 6ND = 8.4e23 FLOPs in 1,720,320 A100-hours at 312 TFLOP/s: an implied MFU of 43 %
    mfu = E.model_flops_utilization(E.training_flops(70e9, 2e12), llama2["gpu_hours"] * 3600, 312e12)
    assert mfu == pytest.approx(8.4e23 / (1_720_320 * 3600 * 312e12)) and 0.4 < mfu < 0.47
