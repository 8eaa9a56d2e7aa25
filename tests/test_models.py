"""course_lib.models: TinyGPT's two attention implementations compute the same function.

``attention="course"`` writes softmax(Q K^T / sqrt(d) + mask) V out; ``attention="sdpa"`` calls
``F.scaled_dot_product_attention``. Same parameters (one state dict loads into the other), same outputs
and gradients: exactly to float64 rounding, and to float32 rounding in float32. Runs on the CPU; the GPU
benchmark (benchmarks/bench_gpu.py) times the two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.models import ATTENTION, CausalSelfAttention, TinyGPT

SIZES = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _pair(dtype):
    torch.manual_seed(0)
    course = TinyGPT(**SIZES).to(dtype)
    sdpa = TinyGPT(**SIZES, attention="sdpa").to(dtype)
    sdpa.load_state_dict(course.state_dict())      # the same parameters under the same names
    return course, sdpa


def _loss_and_grads(model, idx, target):
    model.zero_grad(set_to_none=True)
    logits = model(idx)                             # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, tol", [(torch.float64, {}), (torch.float32, dict(rtol=1e-5, atol=1e-5))],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("T", [16, 7], ids=["full-context", "shorter"])
def test_sdpa_attention_equals_the_course_attention(dtype, tol, T):
    course, sdpa = _pair(dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, SIZES["vocab_size"], (3, T), generator=g)
    target = torch.randint(0, SIZES["vocab_size"], (3, T), generator=g)
    out_c, grads_c = _loss_and_grads(course, idx, target)
    out_s, grads_s = _loss_and_grads(sdpa, idx, target)
    torch.testing.assert_close(out_s, out_c, **tol)
    assert grads_s.keys() == grads_c.keys()
    for name in grads_c:
        torch.testing.assert_close(grads_s[name], grads_c[name], **tol, msg=lambda m: f"{name}: {m}")


def test_attention_choice_is_checked_and_defaults_to_the_course():
    assert ATTENTION == ("course", "sdpa")
    assert TinyGPT().blocks[0].attn.attention == "course"
    with pytest.raises(ValueError, match=r"attention='flash' is not one of \('course', 'sdpa'\)"):
        CausalSelfAttention(8, 2, attention="flash")
    with pytest.raises(ValueError, match="attention='flash'"):
        TinyGPT(attention="flash")


# ------------------------------------------------------------------ course_lib.gpu, on the CPU
def test_measure_gpt_step_runs_on_the_cpu_and_counts_the_papers_flops():
    """What notebook 01 and bench_gpu.py measure on a GPU, run on the CPU: the step trains (the loss is
    finite), the FLOPs are estimate.gpt_training_flops, fp32 AdamW's states are 16 bytes a parameter
    (plus one step counter per tensor), and no CUDA figure is made up."""
    from course_lib import estimate as E
    from course_lib.gpu import measure_gpt_step

    for attention in ATTENTION:
        out = measure_gpt_step(SIZES, 2, attention, device="cpu", steps=1, warmup=1)
        assert out["flops_per_step"] == E.gpt_training_flops(2, 2, 16, 32, 50)
        assert out["tflops"] == pytest.approx(out["flops_per_step"] / out["seconds_per_step"] / 1e12)
        assert torch.isfinite(torch.tensor(out["loss"])) and out["n_params"] > 0
        st = out["state_tensor_bytes"]
        assert st["parameters"] == st["gradients"] == 4 * out["n_params"]
        assert 8 * out["n_params"] <= st["optimizer_states"] <= 8 * out["n_params"] + 8 * 64
        assert "peak_bytes" not in out
    with pytest.raises(ValueError, match="steps must be >= 1"):
        measure_gpt_step(SIZES, 2, device="cpu", steps=0)


@pytest.mark.parametrize("name, row", [("NVIDIA H200", "NVIDIA H200 SXM"), ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
                                       ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM 80GB"), ("NVIDIA H100 PCIe", None),
                                       ("Tesla T4", None)])
def test_peak_flops_matches_a_landscape_row_by_chip_and_board(name, row):
    from course_lib.gpu import peak_flops

    found = peak_flops(name)
    assert (found[1] if found else None) == row
