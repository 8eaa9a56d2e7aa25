"""Mixed precision from scratch: number formats, loss scaling, FP32 master weights.

Sources:

* Micikevicius et al., "Mixed Precision Training", ICLR 2018 -- Sec. 3.1 (FP32 master copy of
  the weights), Sec. 3.2 (loss scaling), Sec. 3.3 (FP32 accumulation).
* Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019 -- the BF16 format.
* IEEE 754-2008 -- binary32 (FP32) and binary16 (FP16) layouts, subnormals, round-to-nearest-even.
* PyTorch ``torch.amp.GradScaler`` -- the dynamic loss-scaling rule we reproduce (init scale
  ``2**16``, back off by 0.5 on inf/NaN, grow by 2 after ``growth_interval`` clean steps).
* Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv:2209.05433) -- E4M3 (max 448,
  no infinities) and E5M2 (max 57344, IEEE-like), per-tensor scaling factors.
* NVIDIA Transformer Engine, ``transformer_engine.common.recipe`` (``DelayedScaling``,
  ``Float8CurrentScaling``) -- the scale maps a tensor's amax to ``fp8_max * 2**-margin``.
* DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), section 3.3 -- FP8 training:
  1x128 / 128x128 block scales, the ~14-bit accumulator of Hopper's FP8 tensor cores, promotion of
  partial sums to FP32 every 128 elements, the operations kept in BF16/FP32.
* Open Compute Project, "OCP Microscaling Formats (MX) Specification" v1.0 (2023) -- 32-element blocks
  with a shared E8M0 (power-of-two) scale; MXFP8.
* Frantar et al. 2023, "GPTQ" (arXiv:2210.17323) and Lin et al. 2024, "AWQ" (arXiv:2306.00978) --
  group-wise 4-bit weight quantisation (group size 128) with round-to-nearest as the baseline.

What lives here:

* formats:       :func:`bit_layout`, :func:`format_summary`, :func:`bits_of`, :func:`ulp`,
                 :func:`plot_bit_layouts`
* loss scaling:  :func:`has_non_finite`, :func:`unscale_grads_`, :func:`update_scale`,
                 :class:`StaticLossScaler`, :class:`DynamicLossScaler`
* master weights: :func:`make_master_params`, :func:`master_step`, :class:`MasterWeightOptimizer`
* memory:        :func:`saved_tensors_report`, :func:`grad_bytes`
* low precision: :data:`FP8_FORMATS`, :func:`quantize_fp8`, :func:`dequantize_fp8`, :func:`fp8_matmul`,
                 :func:`quantize_int4`, :func:`dequantize_int4`, :func:`int4_bits_per_weight`,
                 :func:`relative_error`
* FP8 scaling recipes: :class:`DelayedScaler` (amax history), :func:`quantize_blockwise` /
                 :func:`dequantize_blockwise` (1x128, 128x128), :func:`quantize_mx` / :func:`dequantize_mx`
* accumulation:  :func:`round_mantissa`, :func:`limited_precision_matmul` (``fp8_matmul(accumulate=...)``)
* communication: :func:`fp8_all_gather` (FSDP's weight all-gather in FP8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import collectives

#: The three formats the course compares, by the names used in the prose.
FORMATS: dict[str, torch.dtype] = {
    "FP32": torch.float32,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
}

#: The two FP8 formats of Micikevicius et al. 2022 (H100's and the Transformer Engine's): E4M3 for
#: weights and activations, E5M2 (more range, less precision) for gradients. ``fn``: finite, no infinity.
FP8_FORMATS: dict[str, torch.dtype] = {
    "FP8-E4M3": torch.float8_e4m3fn,
    "FP8-E5M2": torch.float8_e5m2,
}

#: DeepSeek-V3's tile and block edge (arXiv:2412.19437, section 3.3.2: 1 x 128 tiles of activations,
#: 128 x 128 blocks of weights, partial sums promoted every N_C = 128 elements).
BLOCK = 128
#: The OCP Microscaling Formats (MX) specification v1.0's block size: 32 elements share one scale.
MX_BLOCK = 32
#: Mantissa bits of the emulated FP8 tensor-core accumulator: 13 stored + the implicit leading 1 =
#: 14 significant bits, our reading of "around 14 bits" (DeepSeek-V3, arXiv:2412.19437, section 3.3.2).
ACC_MANTISSA_BITS = 13

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}


def _check_float_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in _INT_VIEW:
        raise TypeError(
            f"expected one of torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, "
            f"torch.float8_e5m2, got {dtype!r}; pass a torch dtype, e.g. precision.FORMATS['BF16']"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The course's name for ``dtype`` ("FP32", "FP16", "BF16", "FP8-E4M3", "FP8-E5M2")."""
    _check_float_dtype(dtype)
    return {v: k for k, v in {**FORMATS, **FP8_FORMATS}.items()}[dtype]


# ----------------------------------------------------------------------------------------------
# Number formats
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BitLayout:
    """How the bits of a binary floating-point format are split: 1 sign bit, ``exponent``
    exponent bits, ``mantissa`` explicitly stored fraction bits (the leading 1 is implicit)."""

    sign: int
    exponent: int
    mantissa: int

    @property
    def bits(self) -> int:
        return self.sign + self.exponent + self.mantissa


def bit_layout(dtype: torch.dtype) -> BitLayout:
    """Sign/exponent/mantissa bit counts of ``dtype``, derived from ``torch.finfo`` (not a table).

    ``eps = 2**-mantissa`` (the gap between 1 and the next number), so ``mantissa = -log2(eps)``;
    the exponent gets the remaining ``bits - 1 - mantissa`` bits.
    """
    fi = torch.finfo(_check_float_dtype(dtype))
    mantissa = round(-math.log2(fi.eps))
    return BitLayout(sign=1, exponent=fi.bits - 1 - mantissa, mantissa=mantissa)


def format_summary(dtype: torch.dtype) -> dict:
    """Range and precision of ``dtype``, all read from or computed with ``torch.finfo``.

    Works for the FP8 formats too: E4M3 gives max 448, smallest normal ``2**-6``, smallest subnormal
    ``2**-9``, eps ``2**-3``; E5M2 max 57344, ``2**-14``, ``2**-16``, ``2**-2`` (Micikevicius et al.
    2022, Table 1).

    Returns a dict with ``name, bits, exponent_bits, mantissa_bits, max, smallest_normal,
    smallest_subnormal, eps, decimal_digits``. ``smallest_subnormal = smallest_normal * eps``
    (IEEE 754: subnormals are multiples of ``2**(emin - mantissa)``); ``decimal_digits`` is
    ``(mantissa + 1) * log10(2)``, the significant decimal digits the format carries.
    """
    fi = torch.finfo(_check_float_dtype(dtype))
    lay = bit_layout(dtype)
    return {
        "name": dtype_name(dtype),
        "bits": fi.bits,
        "exponent_bits": lay.exponent,
        "mantissa_bits": lay.mantissa,
        "max": fi.max,
        "smallest_normal": fi.smallest_normal,
        "smallest_subnormal": fi.smallest_normal * fi.eps,
        "eps": fi.eps,
        "decimal_digits": (lay.mantissa + 1) * math.log10(2),
    }


def bits_of(x: float, dtype: torch.dtype) -> tuple[str, str, str]:
    """The stored bits of ``x`` rounded to ``dtype``, as ``(sign, exponent, mantissa)`` strings.

    Example: ``bits_of(1.0, torch.float16) == ("0", "01111", "0000000000")``.
    """
    dtype = _check_float_dtype(dtype)
    lay = bit_layout(dtype)
    raw = torch.tensor([x], dtype=torch.float64).to(dtype).view(_INT_VIEW[dtype]).item()
    raw &= (1 << lay.bits) - 1  # two's complement -> the unsigned bit pattern
    s = format(raw, f"0{lay.bits}b")
    return s[0], s[1 : 1 + lay.exponent], s[1 + lay.exponent :]


def ulp(x: float, dtype: torch.dtype) -> float:
    """Unit in the last place: the gap between ``|x|`` (rounded to ``dtype``) and the next
    larger number of ``dtype``.

    For a normal number ``2**floor(log2|x|) * eps``; in the subnormal range (and at 0) the
    constant ``smallest_subnormal``. An update ``u`` with ``|u| < ulp(w)/2`` is rounded away:
    ``w + u == w`` in ``dtype`` (round to nearest; the lost-update problem, Micikevicius et al.
    2018, Sec. 3.1). Exception: when ``|w|`` is a power of two the gap *below* it is only
    ``ulp(w)/2``, so updates towards zero are lost only below ``ulp(w)/4``.
    """
    dtype = _check_float_dtype(dtype)
    fi = torch.finfo(dtype)
    a = abs(torch.tensor(x, dtype=torch.float64).to(dtype).item())
    if not math.isfinite(a):
        raise ValueError(f"ulp is undefined for a non-finite value (got {x} -> {a} in {dtype})")
    if a < fi.smallest_normal:
        return fi.smallest_normal * fi.eps
    return 2.0 ** math.floor(math.log2(a)) * fi.eps


def plot_bit_layouts(dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
                     value: float | None = None, ax=None):
    """Draw one row of boxes per format: sign (red), exponent (blue), mantissa (green), one box
    per bit, widths to scale. With ``value`` given, each box shows that bit of ``value`` rounded
    to the format. Returns the matplotlib ``Axes``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    dtypes = [_check_float_dtype(d) for d in dtypes]
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 * len(dtypes) + 1.2))
    colours = {"sign": "#e07a7a", "exponent": "#7aa5e0", "mantissa": "#8fd18f"}
    for row, dt in enumerate(dtypes):
        y = len(dtypes) - 1 - row
        lay = bit_layout(dt)
        fields = [("sign", lay.sign), ("exponent", lay.exponent), ("mantissa", lay.mantissa)]
        bits = "".join(bits_of(value, dt)) if value is not None else None
        i = 0
        for field, n in fields:
            for _ in range(n):
                ax.add_patch(Rectangle((i, y + 0.1), 1, 0.8, facecolor=colours[field],
                                       edgecolor="black", linewidth=0.5))
                if bits is not None:
                    ax.text(i + 0.5, y + 0.5, bits[i], ha="center", va="center", fontsize=7)
                i += 1
        ax.text(-0.5, y + 0.5, f"{dtype_name(dt)}\n1 + {lay.exponent} + {lay.mantissa}",
                ha="right", va="center", fontsize=9)
    ax.set_xlim(-6, 33)
    ax.set_ylim(-0.2, len(dtypes) + 0.1)
    ax.set_yticks([])
    ax.set_xlabel("bit position (most significant first)")
    title = "Bit layouts: sign | exponent | mantissa"
    if value is not None:
        title += f"  (bits of {value!r}, rounded to each format)"
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()],
              loc="upper right", ncol=3, fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return ax


# ----------------------------------------------------------------------------------------------
# Loss scaling
# ----------------------------------------------------------------------------------------------


def has_non_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True if any tensor (``None`` entries are skipped) holds an inf or a NaN."""
    return any(t is not None and not bool(torch.isfinite(t).all()) for t in tensors)


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (the scale is stored in FP32, as in PyTorch)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def unscale_grads_(grads: Iterable[torch.Tensor | None], scale: float) -> bool:
    """Divide every gradient by ``scale`` in place and report whether any was inf/NaN.

    The division is a multiplication by ``1/scale`` rounded to FP32 (exact when ``scale`` is a
    power of two, which the dynamic scaler keeps it at). Returns ``found_inf``. Unscale FP32
    gradients: unscaling in 16 bits would underflow again the values scaling just rescued.
    """
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    inv = _f32(1.0 / scale)   # a float32 value: multiplying an FP32 tensor by it rounds as by a tensor
    found_inf = False
    with torch.no_grad():
        for g in grads:
            if g is None:
                continue
            # check the scaled values: they are what overflowed
            found_inf = found_inf or not bool(torch.isfinite(g).all())
            if g.dtype == torch.float32:
                g.mul_(inv)
            else:  # multiply in FP32, then round once to the gradient's dtype
                g.copy_(g.to(torch.float32).mul_(inv))
    return found_inf


def _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval):
    if not (isinstance(init_scale, (int, float)) and init_scale > 0 and math.isfinite(init_scale)):
        raise ValueError(f"init_scale must be a positive finite number (e.g. 2.0**16), got {init_scale!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1 so the scale can grow back, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1) so the scale shrinks on overflow, got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1 (clean steps before growing), got {growth_interval!r}")


def update_scale(scale: float, growth_tracker: int, found_inf: bool, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """One update of the dynamic loss scale; returns ``(new_scale, new_growth_tracker)``.

    ``growth_tracker`` counts consecutive clean (all-finite) steps.

    * inf/NaN found: the step was skipped; ``scale *= backoff_factor`` and the count restarts at 0.
    * clean step: the count goes up by one; when it reaches ``growth_interval`` the scale is
      multiplied by ``growth_factor`` (unless that would overflow FP32) and the count restarts.

    Micikevicius et al. 2018, Sec. 3.2 ("dynamic loss scaling"); the same rule as
    ``torch.amp.GradScaler.update``. The scale is kept in FP32.
    """
    if found_inf:
        return _f32(scale * backoff_factor), 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = _f32(scale * growth_factor)
        # never grow to inf: an infinite scale would turn every gradient into inf/NaN
        return (grown if math.isfinite(grown) else scale), 0
    return scale, growth_tracker


class StaticLossScaler:
    """A constant loss scale ``S``: backward runs on ``S * loss``, so every gradient is ``S``
    times larger (shifted up ``log2 S`` binades, out of the FP16 underflow zone); the optimizer
    sees the gradients divided by ``S`` again. On inf/NaN the step is skipped and ``S`` stays --
    which is the weakness the dynamic scaler fixes. Micikevicius et al. 2018, Sec. 3.2."""

    def __init__(self, scale: float = 2.0**10):
        if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        self._scale = _f32(float(scale))

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (a new tensor; call ``.backward()`` on it)."""
        return loss * self._scale

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divide the gradients by ``S`` in place; returns ``found_inf``."""
        return unscale_grads_(grads, self._scale)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the optimizer's gradients and call ``optimizer.step()`` unless one is inf/NaN.
        Returns whether the step was taken. Call :meth:`update` afterwards with ``not stepped``."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        found_inf = self.unscale_(grads)
        if not found_inf:
            optimizer.step()
        return not found_inf

    def update(self, found_inf: bool) -> None:
        """A static scale never changes."""


class DynamicLossScaler(StaticLossScaler):
    """Dynamic loss scaling: start high, halve on every overflow (and skip that step), double
    after ``growth_interval`` consecutive clean steps -- the scale settles just below the largest
    value that does not overflow. Defaults are ``torch.amp.GradScaler``'s.

    Usage per step (same order as GradScaler's ``scale / step / update``)::

        scaler.scale(loss).backward()
        stepped = scaler.step(optimizer)      # unscale, check, step or skip
        scaler.update(found_inf=not stepped)
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval)
        super().__init__(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        self._scale, self.growth_tracker = update_scale(
            self._scale, self.growth_tracker, bool(found_inf), self.growth_factor,
            self.backoff_factor, self.growth_interval)


# ----------------------------------------------------------------------------------------------
# FP32 master weights
# ----------------------------------------------------------------------------------------------


def make_master_params(model_params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    """FP32 copies of the (low-precision) model parameters: the weights the optimizer updates.
    Micikevicius et al. 2018, Sec. 3.1."""
    params = list(model_params)
    if not params:
        raise ValueError("model_params is empty; pass model.parameters() of the low-precision model")
    return [nn.Parameter(p.detach().to(torch.float32).clone()) for p in params]


def master_step(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                optimizer: torch.optim.Optimizer, scaler: StaticLossScaler) -> bool:
    """One optimizer step with FP32 master weights; returns whether the step was taken.

    1. copy the low-precision gradients of the model into FP32 ``.grad`` of the master weights,
    2. unscale them (in FP32) and check for inf/NaN,
    3. if all finite: ``optimizer.step()`` on the master weights (an update far smaller than
       the weight survives in FP32), then copy the master weights back into the model (rounded
       to the model's dtype); otherwise skip the step,
    4. ``scaler.update(found_inf)``; clear the model's gradients and the FP32 gradient copies.

    Memory: the FP32 gradient copies exist only during this call (4 bytes per parameter on top of
    the model's 2-byte gradients); an implementation can convert one tensor at a time to shrink
    that peak, ours converts all of them at once for clarity.

    ``optimizer`` must have been built over ``master_params``.
    """
    model_params, master_params = list(model_params), list(master_params)
    if len(model_params) != len(master_params):
        raise ValueError(f"{len(model_params)} model params but {len(master_params)} master params; "
                         "build master_params with make_master_params(model.parameters())")
    with torch.no_grad():
        for p, m in zip(model_params, master_params):
            if p.shape != m.shape:
                raise ValueError(f"shape mismatch: model param {tuple(p.shape)} vs master {tuple(m.shape)}")
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        found_inf = scaler.unscale_([m.grad for m in master_params])
        if not found_inf:
            optimizer.step()
            for p, m in zip(model_params, master_params):
                p.copy_(m)  # copy_ rounds FP32 -> the model's dtype
        scaler.update(found_inf)
        # the FP32 gradient copies are only needed during the step; free them (and the model's
        # 16-bit gradients) so neither lives on into the next forward pass
        for p, m in zip(model_params, master_params):
            p.grad = None
            m.grad = None
    return not found_inf


class MasterWeightOptimizer:
    """An optimizer for a low-precision model that keeps FP32 master weights.

    ``make_optimizer(master_params)`` builds the inner optimizer (its state -- e.g. Adam's two
    moments -- is FP32 because the master weights are). ``scaler`` defaults to a
    ``StaticLossScaler(1.0)`` (no scaling, but inf/NaN steps are still skipped).

    Example::

        model = TinyMLP().half()
        opt = MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.Adam(ps, 1e-3),
                                    DynamicLossScaler())
        opt.scaler.scale(loss).backward(); opt.step()
    """

    def __init__(self, model_params: Iterable[torch.Tensor],
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 scaler: StaticLossScaler | None = None):
        self.model_params = list(model_params)
        self.master_params = make_master_params(self.model_params)
        self.optimizer = make_optimizer(self.master_params)
        self.scaler = scaler if scaler is not None else StaticLossScaler(1.0)
        self.skipped = 0

    def step(self) -> bool:
        stepped = master_step(self.model_params, self.master_params, self.optimizer, self.scaler)
        self.skipped += not stepped
        return stepped

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None


# ----------------------------------------------------------------------------------------------
# Memory accounting
# ----------------------------------------------------------------------------------------------

_PASS_THROUGH = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "ExpandBackward0", "UnsafeViewBackward0"}


def _is_parameter_copy(t: torch.Tensor) -> bool:
    """A saved tensor that is a parameter, or a cast/transpose/view of one (autocast saves the
    16-bit copy of a weight it made for the matmul): follow the autograd graph back to a leaf."""
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and fn.name() in _PASS_THROUGH:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


def saved_tensors_report(fn: Callable[[], torch.Tensor]) -> dict:
    """Run ``fn()`` (a forward pass returning the loss) and account for every tensor autograd
    saves for the backward pass, with ``torch.autograd.graph.saved_tensors_hooks``.

    Returns ``{"activations": {dtype_str: bytes}, "parameters": {dtype_str: bytes},
    "loss": tensor}``. Storages are counted once (an op may save a tensor another op also
    saved). "parameters" are the weights themselves or copies made of them (e.g. autocast's
    16-bit weight casts); everything else is activations (including the input batch).
    """
    from course_lib.estimate import saved_tensors

    loss, tensors = saved_tensors(fn)
    out = {"activations": {}, "parameters": {}}
    for t in tensors:
        kind = "parameters" if _is_parameter_copy(t) else "activations"
        d = str(t.dtype).replace("torch.", "")
        out[kind][d] = out[kind].get(d, 0) + t.untyped_storage().nbytes()
    out["loss"] = loss
    return out


def grad_bytes(params: Iterable[torch.Tensor]) -> dict:
    """Bytes held by ``.grad`` of ``params``, per dtype (``{dtype_str: bytes}``)."""
    out: dict = {}
    for p in params:
        if p.grad is not None:
            d = str(p.grad.dtype).replace("torch.", "")
            out[d] = out.get(d, 0) + p.grad.numel() * p.grad.element_size()
    return out


# ----------------------------------------------------------------------------------------------
# Low precision: FP8 with per-tensor scales, INT4 weights with per-group scales
# ----------------------------------------------------------------------------------------------


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius norms, computed in float64)."""
    if approx.shape != exact.shape:
        raise ValueError(f"shapes differ: approx {tuple(approx.shape)} vs exact {tuple(exact.shape)}")
    a, e = approx.double(), exact.double()
    norm = torch.linalg.vector_norm(e).item()
    if norm == 0:
        raise ValueError("exact is all zeros: a relative error is undefined")
    return torch.linalg.vector_norm(a - e).item() / norm


def _check_fp8(dtype) -> torch.dtype:
    if dtype not in FP8_FORMATS.values():
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    return dtype


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, scale=None,
                 margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled cast to FP8: returns ``(q, scale)`` with ``q = fp8(clamp(x * scale))``.

    ``scale = fp8_max * 2**-margin / amax(|x|)`` maps the tensor's largest magnitude onto the format's
    largest finite value, so small tensors use the format's precise range instead of underflowing
    (Micikevicius et al. 2022, §3; Transformer Engine's ``Float8CurrentScaling``, or
    ``DelayedScaling`` with the amax taken from past steps: pass that ``scale``). Values beyond the
    range saturate to ``+-fp8_max`` (E4M3 has no infinity). ``scale`` is a float32 0-d tensor; an
    all-zero ``x`` gets scale 1. Within the normal range every element's relative error is at most
    half an ulp, ``eps / 2``: ``2**-4`` for E4M3, ``2**-3`` for E5M2.
    """
    _check_fp8(dtype)
    if not torch.is_floating_point(x):
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    fmax = torch.finfo(dtype).max
    xf = x.float()
    if scale is None:
        amax = xf.abs().max() if xf.numel() else torch.tensor(0.0, device=xf.device)
        if not torch.isfinite(amax):
            raise ValueError("x holds inf or NaN; per-tensor scaling needs a finite amax")
        scale = _scale_from_amax(amax, dtype, margin)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=xf.device)
    if not (scale > 0 and torch.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale.item()}")
    q = (xf * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale) -> torch.Tensor:
    """Back to float32: ``q / scale`` (Transformer Engine keeps ``scale_inv`` for this)."""
    _check_fp8(q.dtype)
    return q.float() / torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *,
               scaling: str = "tensor", accumulate: str = "fp32", interval: int = 128,
               acc_mantissa_bits: int = ACC_MANTISSA_BITS, rounding: str = "truncate") -> torch.Tensor:
    """``a @ b`` as an FP8 GEMM computes it, emulated in float32 arithmetic (written device-agnostic;
    tested on CPU only). Returns float32.

    Inputs: ``a`` is ``(m, k)``, ``b`` is ``(k, n)``; each is rounded to ``fmt`` with its own scales:

    * ``scaling="tensor"`` (default): one scale per operand (:func:`quantize_fp8`, per-tensor current
      scaling);
    * ``scaling="block"``: DeepSeek-V3's fine-grained recipe (arXiv:2412.19437, section 3.3.2), one scale
      per 1 x 128 tile of ``a`` (a row's run of 128 inner-dimension elements) and per 128 x 128 block of
      ``b`` (:func:`quantize_blockwise`); ``k`` must be a multiple of 128.

    The sum over the inner dimension (the accumulator):

    * ``accumulate="fp32"`` (default): an idealised float32 accumulator; only the inputs' rounding to FP8
      is modelled;
    * ``accumulate="limited"``: the running sum is rounded to ``acc_mantissa_bits`` mantissa bits after
      every addition over all ``k`` (:func:`limited_precision_matmul`), a model of Hopper's FP8 tensor
      cores, which keep "around 14 bits" (DeepSeek-V3, section 3.3.2); per-tensor scaling only, since the
      scales of a block recipe change along ``k``;
    * ``accumulate="promoted"``: the same limited accumulator, but every ``interval`` elements of ``k``
      its partial sum is multiplied by its scales and added into a float32 accumulator (DeepSeek-V3's
      remedy, N_C = 128 elements, section 3.3.2). With ``scaling="block"``, ``interval`` must be 128.

    Products of two FP8 numbers are exact in float32, so the only roundings are the inputs' (to FP8)
    and the accumulator's. Real kernels also round the output (to BF16); that is not modelled.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need (m, k) @ (k, n) matrices, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if scaling not in ("tensor", "block"):
        raise ValueError(f"scaling must be 'tensor' or 'block', got {scaling!r}")
    if accumulate not in ("fp32", "limited", "promoted"):
        raise ValueError(f"accumulate must be 'fp32', 'limited' or 'promoted', got {accumulate!r}")
    _check_positive_int(interval, "interval")
    k = a.shape[1]
    if scaling == "tensor":
        qa, sa = quantize_fp8(a, fmt)
        qb, sb = quantize_fp8(b, fmt)
        if accumulate == "fp32":
            return (qa.float() @ qb.float()) / (sa * sb)
        every = interval if accumulate == "promoted" else None
        return limited_precision_matmul(qa.float(), qb.float(), acc_mantissa_bits, promote_every=every,
                                        rounding=rounding) / (sa * sb)
    if k % BLOCK:
        raise ValueError(f"scaling='block' needs the inner dimension k={k} to be a multiple of {BLOCK}; "
                         f"pad k or use scaling='tensor'")
    if accumulate == "limited":
        raise ValueError("accumulate='limited' with scaling='block' is not a GEMM a kernel can run: the "
                         "scales change every 128 elements of k; use accumulate='promoted' (or 'fp32')")
    if accumulate == "promoted" and interval != BLOCK:
        raise ValueError(f"with scaling='block' the partial sums are promoted where the scales change, "
                         f"every {BLOCK} elements: pass interval={BLOCK}, got {interval}")
    qa, sa = quantize_blockwise(a, (1, BLOCK), fmt)           # sa: (m, k/128)
    n = b.shape[1]
    bp = b if n % BLOCK == 0 else torch.cat([b, b.new_zeros(k, BLOCK - n % BLOCK)], dim=1)
    qb, sb = quantize_blockwise(bp, (BLOCK, BLOCK), fmt)      # sb: (k/128, ceil(n/128))
    sb = sb.repeat_interleave(BLOCK, dim=1)[:, :n]             # (k/128, n): one scale per column of a block
    qa, qb = qa.float(), qb.float()[:, :n]
    out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for j in range(k // BLOCK):                               # one 128-wide slice of k at a time
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        if accumulate == "fp32":
            part = qa[:, cols] @ qb[cols]
        else:
            part = limited_precision_matmul(qa[:, cols], qb[cols], acc_mantissa_bits, rounding=rounding)
        out += part / (sa[:, j : j + 1] * sb[j : j + 1])       # (m, 1) * (1, n): this slice's scales
    return out


# ----------------------------------------------------------------------------------------------
# Scaling recipes: delayed (amax history), fine-grained blocks, MX block formats
# ----------------------------------------------------------------------------------------------



def _last_dim_groups(x: torch.Tensor, size: int, name: str, what: str, fix: str) -> torch.Tensor:
    """``x`` in float32 with its last dimension cut into groups of ``size``: ``(..., n / size, size)``."""
    if not torch.is_floating_point(x) or x.dim() < 1:
        raise TypeError(f"{name} must be a floating-point tensor with at least one dimension, got {x.dtype}")
    n = x.shape[-1]
    if n % size:
        raise ValueError(f"{what}={size} does not divide the last dimension ({n}); {fix}")
    return x.float().reshape(*x.shape[:-1], n // size, size)


def _scale_from_amax(amax: torch.Tensor, fmt: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale that maps ``amax`` (a tensor of them: one per tensor, block or shard) onto ``fmt``'s
    largest value, ``2**-margin`` below it; 1 where ``amax`` is 0 (an all-zero tensor)."""
    return torch.where(amax > 0, torch.finfo(fmt).max * 2.0 ** -margin / amax, torch.ones_like(amax))


def _check_positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


class DelayedScaler:
    """Per-tensor *delayed* scaling, Transformer Engine's ``DelayedScaling`` recipe: the scale used at
    step t comes from the amaxes of earlier steps (the largest of the last ``history_len``, TE's
    ``amax_compute_algo="max"``), so quantising needs no pass over the tensor before the cast; the
    tensor's own amax is recorded afterwards, for the next steps.

    ``scale = fp8_max * 2**-margin / max(history)``; before any amax is recorded the scale is 1 (TE
    starts its scales at 1). A value beyond ``fp8_max / scale`` saturates: delayed scaling pays when a
    tensor's amax jumps (a spike), and keeps a small scale for ``history_len`` steps after one. TE's
    default history is 1024 steps (``amax_history_len=1024``); :func:`quantize_fp8` without a ``scale``
    is the *current* scaling recipe (``Float8CurrentScaling``).

    Usage: ``q, scale = scaler.quantize(x)`` once per step; ``dequantize_fp8(q, scale)``.
    """

    def __init__(self, history_len: int = 16, fmt: torch.dtype = torch.float8_e4m3fn, margin: int = 0):
        self.history_len = _check_positive_int(history_len, "history_len")
        self.fmt = _check_fp8(fmt)
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be an int >= 0 (the scale leaves 2**margin of headroom), got {margin!r}")
        self.margin = margin
        self.history: list[float] = []

    def scale(self) -> float:
        """The scale the next :meth:`quantize` will use."""
        amax = max(self.history, default=0.0)
        return torch.finfo(self.fmt).max * 2.0 ** -self.margin / amax if amax > 0 else 1.0

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast ``x`` with the scale from the history, then record ``amax(|x|)``. Returns ``(q, scale)``."""
        q, s = quantize_fp8(x, self.fmt, scale=self.scale())
        self.history = (self.history + [x.detach().abs().max().item()])[-self.history_len:]
        return q, s


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``(r, c)`` -> ``(r/br, c/bc, br*bc)``: each block's elements on the last axis."""
    if x.dim() != 2:
        raise ValueError(f"block scaling takes a 2-D tensor (rows, cols), got shape {tuple(x.shape)}")
    (r, c), (br, bc) = x.shape, block
    if r % br or c % bc:
        raise ValueError(f"block {block} does not tile a {r} x {c} tensor; choose a block whose sides "
                         f"divide the tensor's, e.g. (1, {BLOCK}) with cols a multiple of {BLOCK}")
    return x.reshape(r // br, br, c // bc, bc).transpose(1, 2).reshape(r // br, c // bc, br * bc)


def _unblocks(g: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`_blocks`."""
    (nr, nc, _), (br, bc) = g.shape, block
    return g.reshape(nr, nc, br, bc).transpose(1, 2).reshape(nr * br, nc * bc)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int] = (1, BLOCK),
                       fmt: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one float32 scale per ``block`` of a 2-D tensor: DeepSeek-V3's fine-grained quantisation
    (arXiv:2412.19437, section 3.3.2, Fig. 7a): ``(1, 128)`` tiles for activations (per token, per 128
    channels), ``(128, 128)`` blocks for weights. Each block gets ``scale = fp8_max / amax(block)``,
    computed from the tensor itself (online, like current scaling), so an outlier only shrinks the
    scale of its own block. Returns ``(q, scales)``: ``q`` of ``x``'s shape in ``fmt``, ``scales``
    float32 of shape ``(rows / br, cols / bc)``; an all-zero block gets scale 1."""
    _check_fp8(fmt)
    if not torch.is_floating_point(x):
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    g = _blocks(x.float(), block)                                     # (nr, nc, br*bc)
    amax = g.abs().amax(dim=-1)                                       # (nr, nc)
    if not torch.isfinite(amax).all():
        raise ValueError("x holds inf or NaN; block scaling needs finite values")
    fmax = torch.finfo(fmt).max
    scales = _scale_from_amax(amax, fmt)
    q = (g * scales.unsqueeze(-1)).clamp(-fmax, fmax).to(fmt)
    return _unblocks(q, block), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Back to float32: each block divided by its scale (the block size follows from the shapes)."""
    _check_fp8(q.dtype)
    (r, c), (nr, nc) = q.shape, scales.shape
    if nr < 1 or nc < 1 or r % nr or c % nc:
        raise ValueError(f"scales {tuple(scales.shape)} do not tile q {tuple(q.shape)}")
    block = (r // nr, c // nc)
    return _unblocks(_blocks(q.float(), block) / scales.unsqueeze(-1), block)


def quantize_mx(x: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn,
                block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """An MX block format (OCP Microscaling Formats specification v1.0, sections 5 and 6.3): every
    ``block`` consecutive elements of the last dimension share one power-of-two scale ``X``, stored as an
    E8M0 number (8 exponent bits, bias 127, no sign, no mantissa). With ``fmt`` E4M3 this is MXFP8.

    The spec's conversion: ``X = 2**(floor(log2 amax) - emax_elem)`` with ``emax_elem`` the element
    format's largest exponent (8 for E4M3, whose max is 1.75 * 2**8 = 448; 15 for E5M2), then each
    ``x / X`` is cast to ``fmt``, saturating at ``fp8_max``. ``amax / X`` lies in [256, 512), so a
    block whose amax has a mantissa above 1.75 clips its largest values to 448 X (at most 12.5 %).

    Emulated: the E8M0 scale is kept as its 8-bit code (``uint8``, ``code = log2 X + 127``) and applied
    as an exact float32 power of two. An all-zero block gets ``X = 1``. Returns ``(q, codes)``:
    ``q`` in ``fmt`` with ``x``'s shape, ``codes`` uint8 of shape ``(*x.shape[:-1], n / block)``;
    :func:`dequantize_mx` inverts it.
    """
    _check_fp8(fmt)
    g = _last_dim_groups(x, _check_positive_int(block, "block"), "x", "block",
                         f"pad it to a multiple of {block}")               # (..., blocks, block)
    amax = g.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("x holds inf or NaN; MX scaling needs finite values")
    fmax = torch.finfo(fmt).max
    emax_elem = math.floor(math.log2(fmax))
    # floor(log2 amax) exactly, from the float32 exponent field (log2 may round up just below 2**e)
    exp = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax))).exponent - 1
    e = torch.where(amax > 0, exp - emax_elem, torch.zeros_like(exp)).clamp(-127, 127)
    q = (g * torch.exp2(-e.float()).unsqueeze(-1)).clamp(-fmax, fmax).to(fmt)
    return q.reshape(x.shape), (e + 127).to(torch.uint8)


def dequantize_mx(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Back to float32: each block of ``q`` times its scale ``2**(code - 127)``."""
    _check_fp8(q.dtype)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be the uint8 E8M0 codes from quantize_mx, got {codes.dtype}")
    n, nb = q.shape[-1], codes.shape[-1]
    if codes.shape[:-1] != q.shape[:-1] or nb < 1 or n % nb:
        raise ValueError(f"codes {tuple(codes.shape)} do not match q {tuple(q.shape)}")
    g = q.float().reshape(*q.shape[:-1], nb, n // nb)
    return (g * torch.exp2(codes.float() - 127).unsqueeze(-1)).reshape(q.shape)


# ----------------------------------------------------------------------------------------------
# Accumulation precision
# ----------------------------------------------------------------------------------------------



def round_mantissa(x: torch.Tensor, bits: int, rounding: str = "truncate") -> torch.Tensor:
    """``x`` (float32) with its mantissa cut to ``bits`` bits (0 to 23), the exponent range kept.

    ``rounding="truncate"`` drops the low bits (round toward zero: what an adder does that aligns its
    operands and shifts out the bits below its width; how Hopper's FP8 accumulator rounds is not
    documented, so this is a model); ``"nearest"`` rounds to nearest, ties to even. Works on the bits
    (an int32 view), so it is exact (written device-agnostic; tested on CPU only). inf and NaN are not
    supported.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_mantissa works on float32 tensors, got {x.dtype}; call .float() first")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 0 <= bits <= 23:
        raise ValueError(f"bits must be an int in [0, 23] (float32 stores 23), got {bits!r}")
    if rounding not in ("truncate", "nearest"):
        raise ValueError(f"rounding must be 'truncate' or 'nearest', got {rounding!r}")
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    i = x.contiguous().view(torch.int32)
    if rounding == "nearest":  # add just under half a step, plus the kept last bit (ties to even)
        i = i + ((1 << (drop - 1)) - 1) + ((i >> drop) & 1)
    return (i & ~((1 << drop) - 1)).view(torch.float32)


def limited_precision_matmul(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int = ACC_MANTISSA_BITS,
                             promote_every: int | None = None, rounding: str = "truncate") -> torch.Tensor:
    """``a @ b`` summed the way a limited-precision accumulator sums it: the products ``a[:, i] * b[i, :]``
    (exact when ``a`` and ``b`` hold FP8 values) are added one ``i`` at a time, and after every addition
    the running sum is rounded to ``mantissa_bits`` (:func:`round_mantissa`).

    With ``promote_every = N_C`` the limited sum restarts every ``N_C`` elements of the inner dimension
    and its partial sum is added into a float32 accumulator (DeepSeek-V3's "promotion to CUDA cores",
    arXiv:2412.19437, section 3.3.2, N_C = 128). ``a``: ``(m, k)``, ``b``: ``(k, n)``, both float32;
    returns float32 ``(m, n)``. A Python loop over ``k``: meant for small ``m, n``.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need (m, k) @ (k, n) matrices, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"a and b must be float32 (FP8 values as float32), got {a.dtype} and {b.dtype}")
    if promote_every is not None:
        _check_positive_int(promote_every, "promote_every")
    m, k = a.shape
    total = torch.zeros(m, b.shape[1], dtype=torch.float32, device=a.device)   # the FP32 accumulator
    acc = torch.zeros_like(total)                                                # the limited one
    for i in range(k):
        acc = round_mantissa(acc + a[:, i : i + 1] * b[i : i + 1, :], mantissa_bits, rounding)
        if promote_every is not None and (i + 1) % promote_every == 0:
            total += acc                                # promotion: add the partial sum in FP32
            acc = torch.zeros_like(total)
    return total + acc


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest INT4 with one scale per group of ``group_size`` consecutive weights
    along the last (input) dimension, the baseline GPTQ and AWQ compare against (group size 128).

    Per group ``scale = amax / 7`` and ``code = round(w / scale)``: codes lie in ``[-7, 7]``, inside
    INT4's ``[-8, 7]`` (symmetric: zero is exact and no zero-point is stored). Returns ``(codes,
    scales)``: ``codes`` int8 with ``w``'s shape (one 4-bit value per int8; packing two per byte is a
    storage detail), ``scales`` float32 of shape ``(*w.shape[:-1], w.shape[-1] // group_size)``.
    An all-zero group gets scale 1. The error of a weight is at most ``scale / 2``; smaller groups
    follow the weights' local range more closely, so the error drops, at
    :func:`int4_bits_per_weight` cost.
    """
    g = _last_dim_groups(w, _check_positive_int(group_size, "group_size"), "w", "group_size",
                         f"choose a divisor of {w.shape[-1] if w.dim() else 0}")  # (..., groups, size)
    amax = g.abs().amax(dim=-1)                                          # (..., groups)
    scales = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
    codes = torch.round(g / scales.unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return codes.reshape(w.shape), scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` per group (the inverse of :func:`quantize_int4`), float32."""
    if codes.dtype != torch.int8:
        raise TypeError(f"codes must be int8 (from quantize_int4), got {codes.dtype}")
    n, groups = codes.shape[-1], scales.shape[-1]
    if codes.shape[:-1] != scales.shape[:-1] or groups < 1 or n % groups:
        raise ValueError(f"scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}")
    g = codes.float().reshape(*codes.shape[:-1], groups, n // groups)
    return (g * scales.unsqueeze(-1)).reshape(codes.shape)


def int4_bits_per_weight(group_size: int = 128, scale_bits: int = 16) -> float:
    """Storage per weight: 4 bits plus the group's scale shared by ``group_size`` weights
    (``4 + 16/128 = 4.125`` bits with 16-bit scales and groups of 128)."""
    return 4 + scale_bits / _check_positive_int(group_size, "group_size")


# ----------------------------------------------------------------------------------------------
# Communication: FSDP's weight all-gather in FP8
# ----------------------------------------------------------------------------------------------


def fp8_all_gather(shard: torch.Tensor, group=None, fmt: torch.dtype = torch.float8_e4m3fn, *,
                   builtin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather a weight sharded across ``group`` (FSDP / ZeRO-3: rank r holds the r-th slice of the
    flattened weight) in FP8 instead of BF16: half the bytes on the wire, and the GEMM that follows takes
    FP8 operands anyway.

    1. every rank's ``amax(|shard|)`` is all-gathered (4 bytes per rank) and the largest sets one
       per-tensor scale, ``fp8_max / amax``, the same on every rank;
    2. each rank casts its shard to ``fmt`` with that scale;
    3. the FP8 shards are all-gathered as their bit patterns, four bytes per ``int32`` word (gloo and the
       course's ring have no float8 types; the bytes on the wire are the same, plus up to 3 bytes of
       padding per shard), with the course's ring (:func:`course_lib.collectives.all_gather_single`;
       torch's own with ``builtin=True``), and viewed as ``fmt`` again.

    Returns ``(q, scale)``: ``q`` the full flattened weight in ``fmt`` (``world_size * shard.numel()``
    elements, rank order), ``scale`` a float32 0-d tensor; ``dequantize_fp8(q, scale)`` is the weight.
    Equal to ``quantize_fp8(full_weight)`` on one process. All shards must have the same size.
    Each rank sends ``(N-1) * shard.numel()`` bytes of FP8 plus ``(N-1) * 4`` of amaxes, against
    ``(N-1) * 2 * shard.numel()`` for a BF16 all-gather.
    """
    _check_fp8(fmt)
    if not torch.is_floating_point(shard):
        raise TypeError(f"shard must be a floating-point tensor, got {shard.dtype}")
    world = dist.get_world_size(group)
    flat = shard.detach().reshape(-1).float()
    amax = (flat.abs().max() if flat.numel() else flat.new_zeros(())).reshape(1)
    amaxes = flat.new_empty(world)
    collectives.all_gather_single(amaxes, amax, group=group, builtin=builtin)
    gmax = amaxes.max()
    if not torch.isfinite(gmax):
        raise ValueError("a shard holds inf or NaN; FP8 scaling needs finite weights")
    scale = _scale_from_amax(gmax, fmt)
    q, scale = quantize_fp8(flat, fmt, scale=scale)
    n = flat.numel()
    pad = -n % 4                          # whole int32 words: 4 FP8 bytes travel as one int32
    payload = torch.cat([q.view(torch.uint8), q.new_zeros(pad, dtype=torch.uint8)]).view(torch.int32)
    out = payload.new_empty(world * payload.numel())
    collectives.all_gather_single(out, payload, group=group, builtin=builtin)
    full = out.view(torch.uint8).reshape(world, n + pad)[:, :n].reshape(-1)   # (world * n,) bytes
    return full.view(fmt), scale
