"""What a GPU adds to the course's lessons: the MFU gap between attentions, and the allocator's real peak.

The course runs on CPU processes; two of its lessons look different on a GPU and are measured here, by
notebook 01 (when a CUDA GPU is present) and by ``benchmarks/bench_gpu.py`` (``make test-gpu``):

* **The MFU gap.** The same model, counted the same way (``estimate.gpt_training_flops``: the causal half
  of the attention that a fused kernel skips still counts, as in the papers), trains at very different
  rates with the course's written-out attention and with ``F.scaled_dot_product_attention``
  (:class:`course_lib.models.TinyGPT`'s ``attention=``). MFU = model FLOPs of a step / (seconds per step x
  peak) (Chowdhery et al. 2022, section 4.1).
* **The allocator's real peak.** fp32 Adam's model states are 16 bytes per parameter
  (``estimate.model_state_bytes``); ``torch.cuda.memory_allocated()`` after a step shows them, and
  ``torch.cuda.max_memory_allocated()`` during a step adds the activations.

:func:`measure_gpt_step` also runs on the CPU (without the CUDA memory figures), which is how the tests
check it on machines without a GPU.
"""

from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F

from course_lib import estimate as E
from course_lib.landscape import HARDWARE
from course_lib.models import TinyGPT

__all__ = ["GPT2_SMALL", "peak_flops", "training_step", "measure_gpt_step"]

#: GPT-2 small's shape (Radford et al. 2019): 12 layers, 12 heads, width 768, vocabulary 50,257, context 1,024.
GPT2_SMALL = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
#: Device-name words for boards whose clocks and power, so peaks, differ from the SXM board of the same chip.
_FORM_FACTORS = {"PCIE", "NVL"}


def _words(name: str) -> set[str]:
    return set(re.split(r"[^A-Z0-9]+", name.upper())) - {""}


def peak_flops(device_name: str) -> tuple[float, str] | None:
    """``(dense 16-bit peak in FLOP/s, row name)`` of the :data:`course_lib.landscape.HARDWARE` row for the
    GPU called ``device_name`` (``torch.cuda.get_device_name()``), or ``None``. A row matches when its chip
    (the first word with a digit, e.g. ``H200``) is a word of the name and the name adds no form factor
    the row lacks (``NVIDIA H100 PCIe`` is not the SXM part: other clocks, another peak)."""
    words = _words(device_name)
    for row in HARDWARE:
        row_words = re.split(r"[^A-Z0-9]+", row["name"].upper())
        chip = next((w for w in row_words if any(c.isdigit() for c in w)), None)
        if row.get("tflops_16bit") and chip in words and not (words & _FORM_FACTORS) - set(row_words):
            return row["tflops_16bit"] * 1e12, row["name"]
    return None


def training_step(net, opt, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """One training step: autocast forward in ``dtype``, fp32 loss, backward, the optimizer's step. The
    gradients are dropped first, so the forward runs next to parameters and optimizer states only, and
    after the step all the model states are alive. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype):
        logits = net(x)                                              # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())   # autocast computes it in fp32
    loss.backward()
    opt.step()
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gpt_step(config: dict, batch: int, attention: str = "course", *, device="cuda",
                     compiled: bool = False, steps: int = 5, warmup: int = 2,
                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """Train :class:`~course_lib.models.TinyGPT` ``(**config, attention=attention)`` on ``device`` with
    fused AdamW (on a GPU) and ``batch`` random sequences of ``config["block_size"]`` tokens, and measure.

    ``warmup`` untimed steps first (cuBLAS, autotuning, compilation), then ``steps`` timed ones between
    two synchronisations. Returns ``seconds_per_step``, ``warmup_seconds``, ``loss``, ``n_params``,
    ``flops_per_step`` (``estimate.gpt_training_flops``), ``tflops`` (achieved), ``state_tensor_bytes``
    (``estimate.measured_model_state_bytes`` after the last step) and, on a CUDA device, ``peak_bytes``
    (``torch.cuda.max_memory_allocated`` during the timed steps), ``allocated_after_step_bytes`` and
    ``reserved_bytes`` (the caching allocator's pool)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    torch.manual_seed(0)
    model = TinyGPT(**config, attention=attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    net = torch.compile(model) if compiled else model
    g = torch.Generator(device=device).manual_seed(0)
    T, V = config["block_size"], config["vocab_size"]
    seq = torch.randint(0, V, (batch, T + 1), device=device, generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()      # (B, T) each
    t0 = time.perf_counter()
    for _ in range(warmup):
        training_step(net, opt, x, y, dtype)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = training_step(net, opt, x, y, dtype)
    _sync(device)
    seconds = (time.perf_counter() - t0) / steps
    flops = E.gpt_training_flops(config["n_layer"], batch, T, config["n_embd"], V)
    out = {"seconds_per_step": seconds, "warmup_seconds": warmup_s, "loss": float(loss.detach()),
           "n_params": sum(p.numel() for p in model.parameters()), "flops_per_step": flops,
           "tflops": flops / seconds / 1e12, "state_tensor_bytes": E.measured_model_state_bytes(model, opt)}
    if device.type == "cuda":
        out.update(peak_bytes=torch.cuda.max_memory_allocated(device),
                   allocated_after_step_bytes=torch.cuda.memory_allocated(device),
                   reserved_bytes=torch.cuda.memory_reserved(device))
    del net, model, opt, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
