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
