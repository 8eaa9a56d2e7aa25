"""Back-of-the-envelope calculators for compute (FLOPs) and memory (bytes) of training.

Every formula here is a pure function of sizes: no framework, no device. Each docstring names the
paper (and section/equation) it reproduces, so a learner or an instructor can check it by hand.
The last section holds three small *measuring* helpers (they import torch lazily) used to check the
formulas against what PyTorch really does.

Units and notation (the course's, stated in GLOSSARY.md; Korthikanti et al. 2022's letters):

* FLOPs are floating-point operations (a multiply-add counts as 2), never FLOP/s.
* Memory is in bytes; ``GB`` is ``1e9`` bytes (decimal, as the ZeRO paper and the course source use).
* ``s`` sequence length, ``b`` micro-batch size (sequences), ``h`` hidden size, ``a`` attention heads,
  ``L`` layers, ``V`` vocabulary size, ``t`` tensor-parallel degree, ``N`` data-parallel degree,
  ``Psi`` parameter count (Kaplan et al. write ``N``: their ``6N`` is ``6 Psi`` here), ``D`` training
  tokens, ``K`` optimizer-state bytes per parameter; ``d_in``, ``d_out`` a dense layer's input and
  output widths. The arguments spell them out: ``seq``, ``batch`` or ``micro_batch``, ``d_model`` or
  ``hidden``, ``heads``, ``n_layer``, ``vocab_size``, ``tp``, ``dp_degree``, ``n_params``, ``tokens``.

Sources:

* Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv:2001.08361), §2.1 and
  Table 1: forward ``2N`` and training ``6N`` FLOPs per token (``2 Psi`` and ``6 Psi`` here).
* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473), §5.1: ``24 b s h^2 + 4 b s^2 h`` forward FLOPs per layer.
* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
  (arXiv:1910.02054), §3.1 and §5.1, Figure 1.
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), §4.1 (Eq. 1), §4.2, §4.3 (output layer) and Table 2.
* Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways" (arXiv:2204.02311),
  §4.1, Table 3 and Appendix B: model FLOPs utilization (MFU) and hardware FLOPs utilization (HFU).
* Patterson et al. 2021, "Carbon Emissions and Large Neural Network Training" (arXiv:2104.10350):
  energy = device power x hours x PUE, and GPT-3's 1,287 MWh.
"""

from __future__ import annotations

import numbers

GB = 1e9  #: bytes in a (decimal) gigabyte, as used by the ZeRO paper and the course source

PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")
RECOMPUTE = ("none", "selective", "full")

# fp32 optimizer-state buffers per parameter: Adam keeps momentum and variance, SGD with momentum
# one buffer, plain SGD none.
_N_STATES = {"adam": 2, "sgd": 0, "sgd_momentum": 1}


# --------------------------------------------------------------------------- input checks

def _check_int(name: str, value, minimum: int = 1) -> int:
    """Reject non-integers and values below ``minimum`` with a message that says how to fix it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; sizes and counts cannot be "
                         f"negative or zero")
    return int(value)


def _check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    return value


# --------------------------------------------------------------------------- FLOPs

def dense_forward_flops(batch: int, d_in: int, d_out: int) -> int:
    """Forward FLOPs of a dense layer ``(batch, d_in) @ (d_in, d_out)``: ``2 * b * d_in * d_out``.

    ``b = batch`` rows (in a transformer, the ``b * s`` tokens of a micro-batch). Each of the
    ``b * d_out`` outputs is a dot product of length ``d_in``: ``d_in`` multiplies and ``d_in`` adds.
    The bias add (``b * d_out``) is not counted, as in Kaplan et al. 2020, §2.1.
    """
    batch, d_in, d_out = (_check_int(k, v) for k, v in
                          (("batch", batch), ("d_in", d_in), ("d_out", d_out)))
    return 2 * batch * d_in * d_out


def dense_training_flops(batch: int, d_in: int, d_out: int, input_requires_grad: bool = True) -> int:
    """Forward + backward FLOPs of a dense layer: ``6 * b * d_in * d_out`` (3x the forward).

    The backward pass computes two matrix products of the forward's size: the gradient with respect
    to the input, ``dX = dY W^T``, and with respect to the weight, ``dW = X^T dY`` (Kaplan et al.
    2020, §2.1: "the backwards pass is approximately twice the compute"). The first layer of a
    network does not need ``dX`` (its input is data), so it costs only 2x the forward:
    ``input_requires_grad=False`` gives ``4 * b * d_in * d_out``.
    """
    fwd = dense_forward_flops(batch, d_in, d_out)
    return fwd * (3 if input_requires_grad else 2)


def transformer_layer_flops_breakdown(batch: int, seq: int, d_model: int, ffn_mult: int = 4) -> dict:
    """Forward matrix-multiply FLOPs of one transformer layer, term by term.

    Returns a dict (FLOPs) with keys ``qkv`` (``6 b s h^2``), ``scores`` (``Q K^T``: ``2 b s^2 h``),
    ``weighted_sum`` (``softmax @ V``: ``2 b s^2 h``), ``out_proj`` (``2 b s h^2``) and ``ffn``
    (``h -> ffn_mult*h -> h``: ``4 * ffn_mult * b s h^2``), for ``b = batch``, ``s = seq``,
    ``h = d_model``. With ``ffn_mult=4`` the sum is ``24 b s h^2 + 4 b s^2 h`` (Narayanan et al. 2021,
    §5.1; notebook 01's exercise 1). The number of heads does not appear: the heads split ``h`` among
    themselves. Softmax, layer norms, GELU, biases and residual adds are element-wise,
    ``O(b s h + a b s^2)``, and are not counted.
    """
    b, s, h = (_check_int(k, v) for k, v in (("batch", batch), ("seq", seq), ("d_model", d_model)))
    ffn_mult = _check_int("ffn_mult", ffn_mult)
    return {
        "qkv": 2 * b * s * h * (3 * h),
        "scores": 2 * b * s * s * h,
        "weighted_sum": 2 * b * s * s * h,
        "out_proj": 2 * b * s * h * h,
        "ffn": 2 * (2 * b * s * h * (ffn_mult * h)),
    }


def transformer_layer_flops(batch: int, seq: int, d_model: int, ffn_mult: int = 4) -> int:
    """Forward FLOPs of one transformer layer: ``24 b s h^2 + 4 b s^2 h`` for a 4h FFN.

    The sum of :func:`transformer_layer_flops_breakdown` (Narayanan et al. 2021, §5.1).
    """
    return sum(transformer_layer_flops_breakdown(batch, seq, d_model, ffn_mult).values())


def gpt_forward_flops(n_layer: int, batch: int, seq: int, d_model: int, vocab_size: int = 0,
                      ffn_mult: int = 4) -> int:
    """Forward FLOPs of a GPT-style model: ``L`` layers plus the LM head ``2 b s h V``.

    Embedding look-ups are gathers, not multiplications, and cost no FLOPs. ``vocab_size=0`` leaves
    out the LM head (the per-layer total only).
    """
    _check_int("vocab_size", vocab_size, minimum=0)
    layers = _check_int("n_layer", n_layer) * transformer_layer_flops(batch, seq, d_model, ffn_mult)
    return layers + 2 * batch * seq * d_model * vocab_size


def gpt_training_flops(n_layer: int, batch: int, seq: int, d_model: int, vocab_size: int = 0,
                       ffn_mult: int = 4) -> int:
    """Training FLOPs of one step (forward + backward): 3x :func:`gpt_forward_flops`.

    Every matrix product of the forward has two of the same size in the backward (see
    :func:`dense_training_flops`); the embedding input needs no input gradient, but the first
    matmul's input is the embedding *output*, which does, so the factor is exactly 3.
    Recomputation (activation checkpointing) would add one more forward: factor 4.
    """
    return 3 * gpt_forward_flops(n_layer, batch, seq, d_model, vocab_size, ffn_mult)


def gpt_param_count(n_layer: int, d_model: int, vocab_size: int = 0, n_ctx: int = 0,
                    tied_embeddings: bool = True, ffn_mult: int = 4) -> int:
    """Parameter count of a GPT-2-style decoder (``course_lib.models.TinyGPT``, nanoGPT).

    Per layer ``12 h^2 + 13 h`` for ``ffn_mult=4`` (``h = d_model``): fused QKV ``3h^2 + 3h``, output
    projection ``h^2 + h``, FFN ``4h^2 + 4h`` and ``4h^2 + h``, two layer norms ``4h``. Around the
    layers: token embedding ``V h``, learned positions ``n_ctx h`` (``n_ctx``: GPT-2's context length,
    the longest sequence), final layer norm ``2h``, and an LM head ``V h`` only when it is not tied
    to the token embedding (GPT-2 ties it). The often quoted ``L (12 h^2 + 13 h)`` is the per-layer
    part only, which is also what Kaplan et al. 2020 (§2.1) call the non-embedding parameter count
    (their ``N ~ 12 L d_model^2``).
    """
    L, h = _check_int("n_layer", n_layer), _check_int("d_model", d_model)
    V, T = _check_int("vocab_size", vocab_size, 0), _check_int("n_ctx", n_ctx, 0)
    f = _check_int("ffn_mult", ffn_mult)
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (f * h * h + f * h) + (f * h * h + h) + 4 * h
    embeddings = V * h + T * h + (0 if tied_embeddings else V * h)
    return L * per_layer + embeddings + 2 * h


def training_flops_per_token(n_params: float) -> float:
    """Training FLOPs per token, ``6 Psi`` for ``Psi = n_params`` (Kaplan et al. 2020, §2.1, Table 1,
    where it reads ``6N``).

    ``2 Psi`` for the forward (one multiply-add per parameter per token) and ``4 Psi`` for the
    backward. It leaves out the attention ``s^2`` term, small while ``s << 6 h``: ``12 L s h`` per
    token with both attention products counted in full, as :func:`gpt_training_flops` does (Kaplan et
    al.'s Eq. 2.2 counts half of it, ``6 L s h``).
    """
    return 6 * _check_positive("n_params", n_params)


def training_flops(n_params: float, tokens: float) -> float:
    """Training FLOPs for ``D = tokens`` tokens (one step: ``tokens = b * s``): ``C = 6 Psi D``."""
    return training_flops_per_token(n_params) * _check_positive("tokens", tokens)


# --------------------------------------------------------------------------- FLOPs -> time

#: NVIDIA A100 peak dense BF16/FP16 Tensor Core throughput, FLOP/s (A100 datasheet: 312 TFLOPS,
#: 624 with structured sparsity, which dense training does not use).
A100_BF16_PEAK_FLOPS = 312e12


def training_seconds(flops: float, peak_flops: float, mfu: float, n_devices: int = 1) -> float:
    """Wall-clock seconds to do ``flops`` of training: ``t = C / (n_devices * peak * MFU)``.

    ``flops`` is the model's training compute ``C`` (e.g. :func:`training_flops`, ``6 Psi D``);
    ``peak_flops`` one device's peak FLOP/s (e.g. :data:`A100_BF16_PEAK_FLOPS`); ``mfu`` the model
    FLOPs utilization, the fraction of the peak that goes into the model's own FLOPs (Chowdhery et
    al. 2022, "PaLM", §4.1 and Table 3; recomputation FLOPs are *not* model FLOPs, so activation
    checkpointing lowers MFU). Narayanan et al. 2021, §5.1, write the same estimate as
    ``8 T P / (n X)``: ``X`` is the achieved FLOP/s per GPU *including* recomputation (hence 8, not 6).
    """
    C = _check_positive("flops", flops)
    peak = _check_positive("peak_flops", peak_flops)
    u = _check_positive("mfu", mfu)
    if u > 1:
        raise ValueError(f"mfu={u} is above 1: it is a fraction of the peak (e.g. 0.4 for 40%)")
    return C / (_check_int("n_devices", n_devices) * peak * u)


def model_flops_utilization(flops: float, seconds: float, peak_flops: float,
                            n_devices: int = 1) -> float:
    """MFU, the inverse of :func:`training_seconds`: ``C / (seconds * n_devices * peak)``.

    ``flops`` are the model FLOPs done in ``seconds`` (not counting recomputation).
    """
    C, t = _check_positive("flops", flops), _check_positive("seconds", seconds)
    peak = _check_positive("peak_flops", peak_flops)
    return C / (t * _check_int("n_devices", n_devices) * peak)


#: The recomputation settings :func:`hardware_flops` knows: none, or every layer's forward run twice.
HFU_RECOMPUTE = ("none", "full")


def hardware_flops(n_params: float, tokens: float, recompute: str = "none") -> float:
    """FLOPs the hardware executes to train on ``tokens`` tokens: ``6 Psi D``, or ``8 Psi D`` with full
    activation recomputation.

    Full recomputation (activation checkpointing of every layer) runs each forward twice: once
    without keeping activations, once again during the backward, so the forward's ``2 Psi D`` is
    paid twice: ``2 Psi D + 2 Psi D + 4 Psi D = 8 Psi D`` (Narayanan et al. 2021, §5.1, the ``8 T P``
    of their Eq. 3; Korthikanti et al. 2022, §5 and Table 4, who report both "model" and "hardware"
    FLOPs). The *model* FLOPs stay ``6 Psi D`` (:func:`training_flops`): recomputation is overhead,
    not progress.
    """
    _check_choice("recompute", recompute, HFU_RECOMPUTE)
    return training_flops(n_params, tokens) * (8 / 6 if recompute == "full" else 1.0)


def hardware_flops_utilization(flops: float, seconds: float, peak_flops: float,
                               n_devices: int = 1, recompute: str = "none") -> float:
    """HFU: the FLOPs the hardware really did per second, over the peak.

    Chowdhery et al. 2022 ("PaLM"), §4.1 and Appendix B, define *model* FLOPs utilization (MFU,
    :func:`model_flops_utilization`) on the model's own FLOPs and *hardware* FLOPs utilization (HFU)
    on everything executed, rematerialisation included; PaLM 540B reports 46.2 % MFU and 57.8 % HFU.
    ``flops`` are the model FLOPs (``6 Psi D``) done in ``seconds``; with ``recompute="full"`` the
    hardware did ``8/6`` of them (:func:`hardware_flops`), so ``HFU = MFU * 4/3``; without
    recomputation HFU equals MFU. HFU says how busy the chips were, MFU how fast the model trains.
    """
    _check_choice("recompute", recompute, HFU_RECOMPUTE)
    mfu = model_flops_utilization(flops, seconds, peak_flops, n_devices)
    return mfu * (8 / 6 if recompute == "full" else 1.0)


def human_duration(seconds: float) -> str:
    """A duration in the largest fitting unit: ``"95 years"``, ``"34 days"``, ``"3.2 hours"``.

    Years of 365.25 days; two significant figures below 10, whole numbers above.
    """
    t = _check_positive("seconds", seconds)
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600),
                       ("minutes", 60)):
        if t >= size:
            v = t / size
            return f"{v:.2g} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{t:.2g} s"


# --------------------------------------------------------------------------- FLOPs -> money, energy

def training_cost(flops: float, *, peak_flops: float, mfu: float, gpu_hour_price: float,
                  gpu_power_watts: float, pue: float = 1.1, n_devices: int | None = None) -> dict:
    """GPU-hours, dollars and energy of ``flops`` of training (e.g. ``6 Psi D``, :func:`training_flops`).

    * ``gpu_hours = C / (peak * MFU) / 3600`` (:func:`training_seconds` on one device: the GPU-hours do
      not depend on how many GPUs share the work, as long as the MFU holds);
    * ``dollars = gpu_hours * gpu_hour_price`` (a rented GPU's hourly price);
    * ``energy_kwh = gpu_hours * gpu_power_watts / 1000 * pue``: the devices' power (their TDP is an
      upper bound; Touvron et al. 2023 count the GPUs' power cap the same way) times the data centre's
      power usage effectiveness, total facility power over IT power (>= 1; Patterson et al. 2021 take
      1.1 for GPT-3's data centre). CPUs, network and storage are left out;
    * ``wall_seconds = gpu_hours * 3600 / n_devices`` when ``n_devices`` is given.

    Keyword-only after ``flops`` so that a price is never passed as a power. Returns a dict with
    ``gpu_hours``, ``dollars``, ``energy_kwh`` (and ``wall_seconds``).
    """
    seconds_one = training_seconds(flops, peak_flops, mfu, 1)
    price = _check_positive("gpu_hour_price", gpu_hour_price)
    watts = _check_positive("gpu_power_watts", gpu_power_watts)
    if isinstance(pue, bool) or not isinstance(pue, numbers.Real) or not pue >= 1:
        raise ValueError(f"pue must be a number >= 1 (facility power / IT power, e.g. 1.1), got {pue!r}")
    hours = seconds_one / 3600
    out = {"gpu_hours": hours, "dollars": hours * price, "energy_kwh": hours * watts / 1000 * pue}
    if n_devices is not None:
        out["wall_seconds"] = seconds_one / _check_int("n_devices", n_devices)
    return out


#: Published training runs, for checking the estimates above against reality. Each entry: ``name``,
#: ``params``, ``tokens``, the published figures that exist (``training_flops``, ``gpu_hours``,
#: ``hardware``, ``device_power_watts``, ``energy_mwh``, ``estimated_cost_usd``) and ``source``.
#: Only numbers a paper, model card or the cited estimate states; anything not published is absent.
PUBLISHED_TRAINING_RUNS = [
    {
        "name": "GPT-3 175B", "params": 175e9, "tokens": 300e9,
        "training_flops": 3.14e23, "hardware": "NVIDIA V100 (Microsoft cluster)",
        "energy_mwh": 1287.0, "estimated_cost_usd": 4.6e6,
        "source": ("Brown et al. 2020, arXiv:2005.14165, Table 2.1 (size), §2.2 (300B tokens), Table D.1 "
                   "(3.14e23 FLOPs); Patterson et al. 2021, arXiv:2104.10350, Table 4 (1,287 MWh); "
                   "Lambda Labs 2020, 'OpenAI's GPT-3 Language Model: A Technical Overview' (~$4.6M "
                   "on the cheapest V100 cloud instances, an estimate, not OpenAI's bill)"),
    },
    {
        "name": "Chinchilla 70B", "params": 70e9, "tokens": 1.4e12,
        "training_flops": 5.76e23, "hardware": "TPUv3/TPUv4",
        "source": ("Hoffmann et al. 2022, arXiv:2203.15556, §4.1 (70B, 1.4T tokens, the same 5.76e23 "
                   "FLOPs budget as Gopher) and §3 (trained on TPUv3/TPUv4)"),
    },
    {
        "name": "Llama 2 70B", "params": 70e9, "tokens": 2e12,
        "gpu_hours": 1_720_320, "hardware": "NVIDIA A100-80GB", "device_power_watts": 400,
        "source": ("Touvron et al. 2023, 'Llama 2', arXiv:2307.09288, Table 1 (2.0T tokens) and Table 2 "
                   "(1,720,320 GPU-hours, 400 W power cap per GPU)"),
    },
    {
        "name": "Llama 3.1 405B", "params": 405e9, "tokens": 15.6e12,
        "training_flops": 3.8e25, "gpu_hours": 30.84e6, "hardware": "NVIDIA H100-80GB",
        "device_power_watts": 700,
        "source": ("Meta Llama 3.1 model card (github.com/meta-llama/llama-models, models/llama3_1/"
                   "MODEL_CARD.md: 30.84M H100-80GB GPU-hours at 700 W TDP); Dubey et al. 2024, 'The "
                   "Llama 3 Herd of Models', arXiv:2407.21783, §3 (15.6T tokens, 3.8e25 FLOPs)"),
    },
]


# --------------------------------------------------------------------------- model states

def model_state_bytes(n_params: float, precision: str = "fp32", optimizer: str = "adam") -> dict:
    """Bytes of parameters, gradients and optimizer states for ``n_params`` parameters.

    ``precision="fp32"``: 4-byte parameters and gradients, 4-byte optimizer buffers
    (Adam: momentum + variance, ``16`` bytes/parameter in all; a 7B model: 112 GB).

    ``precision="mixed"``: the accounting of ZeRO §3.1 for mixed-precision training: fp16/bf16
    parameters (2 bytes) and gradients (2 bytes), plus ``K`` bytes of fp32 optimizer state, where
    ``K`` counts the fp32 master copy of the weights (4) and the fp32 buffers (4 each):
    ``K = 12`` for Adam, 8 for SGD with momentum, 4 for plain SGD. Mixed-precision Adam is also
    ``16`` bytes/parameter: it saves activation memory and time, not model-state memory.

    Returns ``{"parameters", "gradients", "optimizer_states"}`` in bytes.
    """
    n_params = _check_positive("n_params", n_params)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    buffers = 4 * _N_STATES[optimizer]
    if precision == "fp32":
        per = {"parameters": 4, "gradients": 4, "optimizer_states": buffers}
    else:
        per = {"parameters": 2, "gradients": 2, "optimizer_states": 4 + buffers}
    return {k: v * n_params for k, v in per.items()}


def optimizer_k(precision: str = "mixed", optimizer: str = "adam") -> int:
    """``K``, the optimizer-state bytes per parameter (ZeRO §3.1: ``K = 12`` for mixed-precision Adam)."""
    return int(model_state_bytes(1, precision, optimizer)["optimizer_states"])


def zero_model_state_bytes(n_params: float, stage: int, dp_degree: int,
                           precision: str = "mixed", optimizer: str = "adam") -> dict:
    """Per-device bytes of parameters, gradients and optimizer states under ZeRO stage 0-3.

    ZeRO-DP (Rajbhandari et al. 2020, §5.1 and Figure 1) partitions across the ``N = dp_degree``
    data-parallel devices: stage 1 (``P_os``) the optimizer states, stage 2 (``P_os+g``) also the
    gradients, stage 3 (``P_os+g+p``) also the parameters. Stage 0 is plain data parallelism. With
    mixed-precision Adam the totals are ``(2 + 2 + K) Psi``, ``4 Psi + K Psi / N``,
    ``2 Psi + (2 + K) Psi / N`` and ``(4 + K) Psi / N`` with ``K = 12``; Figure 1 (``Psi = 7.5B``,
    ``N = 64``) gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.

    Returns ``{"parameters", "gradients", "optimizer_states"}``, bytes on one device.
    """
    stage = _check_int("stage", stage, 0)
    if stage > 3:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    N = _check_int("dp_degree", dp_degree)
    full = model_state_bytes(n_params, precision, optimizer)
    sharded = {"optimizer_states": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    return {k: v / N if sharded[k] else v for k, v in full.items()}


def largest_model_that_fits(device_bytes: float, stage: int, dp_degree: int,
                            precision: str = "mixed", optimizer: str = "adam",
                            reserved_bytes: float = 0.0) -> float:
    """The largest parameter count ``Psi`` whose model states fit in ``device_bytes`` on one device.

    Model states per device are linear in ``Psi`` (:func:`zero_model_state_bytes`), so the
    inequality ``c * Psi + reserved <= M`` gives ``Psi = (M - reserved) / c`` with ``c`` the
    per-device bytes per parameter (for mixed-precision Adam: ``16``, ``4 + K/N``,
    ``2 + (2+K)/N``, ``(4+K)/N``). ``reserved_bytes`` holds what is not model state (activations,
    buffers, fragmentation). Returns a float number of parameters.
    """
    M = _check_positive("device_bytes", device_bytes)
    if reserved_bytes < 0:
        raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes}")
    if reserved_bytes >= M:
        raise ValueError(f"reserved_bytes={reserved_bytes:.3g} leaves no room in "
                         f"device_bytes={M:.3g}; nothing fits")
    per_param = sum(zero_model_state_bytes(1, stage, dp_degree, precision, optimizer).values())
    return (M - reserved_bytes) / per_param


# --------------------------------------------------------------------------- activations

def activation_bytes_terms(seq: int, micro_batch: int, hidden: int, heads: int,
                           bytes_per_value: int = 2, dropout: bool = True) -> dict:
    """What one transformer layer stores for the backward, term by term (Korthikanti et al. §4.1).

    Values are in bytes, for no parallelism, with ``p = bytes_per_value`` (the paper: ``p = 2``,
    16-bit activations) and dropout masks at 1 byte per element:

    ==========================  ===================  ======================================
    key                         bytes                what is saved
    ==========================  ===================  ======================================
    ``layernorm_inputs``        ``2 p sbh``          the inputs of both layer norms
    ``qkv_input``               ``p sbh``            LN1 output, shared by Q, K, V matmuls
    ``q_k``                     ``2 p sbh``          Q and K, for ``Q K^T``
    ``v``                       ``p sbh``            V, for ``softmax @ V``
    ``softmax_output``          ``p as^2b``          for the softmax backward
    ``softmax_dropout_mask``    ``as^2b``            (dropout only)
    ``softmax_dropout_output``  ``p as^2b``          for ``@ V`` (dropout only; else the
                                                     softmax output is reused)
    ``out_proj_input``          ``p sbh``            the attention output before projection
    ``mlp_input``               ``p sbh``            LN2 output, the first FFN matmul's input
    ``gelu_input``              ``4 p sbh``
    ``fc2_input``               ``4 p sbh``          the GELU output
    ``dropout_masks``           ``2 sbh``            after attention and after the MLP
                                                     (dropout only)
    ==========================  ===================  ======================================

    With ``p = 2`` and dropout the sum is ``sbh (34 + 5 a s / h)`` (the paper's Eq. 1).
    """
    s, b, h, a = (_check_int(k, v) for k, v in
                  (("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden), ("heads", heads)))
    p = _check_int("bytes_per_value", bytes_per_value)
    if h % a:
        raise ValueError(f"hidden={h} is not divisible by heads={a}; each head needs h/a channels")
    sbh, as2b = s * b * h, a * s * s * b
    return {
        "layernorm_inputs": 2 * p * sbh,
        "qkv_input": p * sbh,
        "q_k": 2 * p * sbh,
        "v": p * sbh,
        "softmax_output": p * as2b,
        "softmax_dropout_mask": as2b if dropout else 0,
        "softmax_dropout_output": p * as2b if dropout else 0,
        "out_proj_input": p * sbh,
        "mlp_input": p * sbh,
        "gelu_input": 4 * p * sbh,
        "fc2_input": 4 * p * sbh,
        "dropout_masks": 2 * sbh if dropout else 0,
    }


# Which terms sit inside the tensor-parallel regions (split t ways) and which stay replicated
# (Korthikanti et al. §4.2.1: layer norms and dropouts are not split by tensor parallelism).
_TP_SHARDED = ("q_k", "v", "out_proj_input", "gelu_input", "fc2_input")
_ATTENTION_CORE = ("softmax_output", "softmax_dropout_mask", "softmax_dropout_output")


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int,
                               tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", bytes_per_value: int = 2,
                               dropout: bool = True) -> float:
    """Activation bytes one transformer layer keeps for the backward, on one tensor-parallel rank.

    Korthikanti et al. 2022, Table 2 (``p = 2``, with dropout), ``s`` = sequence, ``b`` =
    micro-batch, ``h`` = hidden, ``a`` = heads, ``t = tp``:

    ===============================  ==============================
    configuration                    bytes per layer
    ===============================  ==============================
    no parallelism                   ``sbh (34 + 5as/h)``
    tensor parallel                  ``sbh (10 + 24/t + 5as/(ht))``
    tensor + sequence parallel       ``sbh (34/t + 5as/(ht))``
    tensor parallel + selective      ``sbh (10 + 24/t)``
    tensor + sequence + selective    ``sbh (34/t)``
    full recompute                   ``2 sbh`` (the layer input)
    ===============================  ==============================

    ``recompute="selective"`` recomputes the attention core (softmax, its dropout, ``@ V``) and so
    drops the ``5as/h`` term; ``"full"`` keeps only the layer's input (Table 2 lists ``2sbh``
    whatever ``t``; we follow it). ``bytes_per_value`` and ``dropout`` generalise the table (for
    fp32, or a model without dropout) term by term via :func:`activation_bytes_terms`.
    Raises ``ValueError`` when ``tp`` does not divide ``heads`` (heads are split across ranks) or,
    with sequence parallelism, ``seq``.
    """
    terms = activation_bytes_terms(seq, micro_batch, hidden, heads, bytes_per_value, dropout)
    t = _check_int("tp", tp)
    _check_choice("recompute", recompute, RECOMPUTE)
    if heads % t:
        raise ValueError(f"tp={t} does not divide heads={heads}; tensor parallelism gives each "
                         f"rank heads/tp whole heads, so choose a tp that divides {heads}")
    if sequence_parallel and seq % t:
        raise ValueError(f"sequence parallelism splits seq={seq} into tp={t} chunks; choose a "
                         f"sequence length divisible by {t}")
    if recompute == "full":
        return bytes_per_value * seq * micro_batch * hidden
    total = 0.0
    for key, value in terms.items():
        if recompute == "selective" and key in _ATTENTION_CORE:
            continue
        split = key in _TP_SHARDED or key in _ATTENTION_CORE or sequence_parallel
        total += value / t if split else value
    return total


def output_layer_activation_bytes(seq: int, micro_batch: int, hidden: int, vocab_size: int,
                                  bytes_per_value: int = 2) -> int:
    """Activation bytes the output layer of a GPT keeps for the backward (Korthikanti et al. §4.3).

    ``p sbh`` (the final layer norm's input) + ``p sbh`` (the LM head's input, the layer norm's
    output) + ``4 sbv`` (the logits' softmax, kept in fp32 by the cross-entropy whatever ``p``):
    with ``p = 2`` this is the paper's ``4sbh (1 + v/h)``. ``v = vocab_size``; no tensor parallelism.
    """
    s, b, h, v = (_check_int(k, x) for k, x in (("seq", seq), ("micro_batch", micro_batch),
                                                 ("hidden", hidden), ("vocab_size", vocab_size)))
    p = _check_int("bytes_per_value", bytes_per_value)
    return 2 * p * s * b * h + 4 * s * b * v


def gpt_activation_bytes(n_layer: int, seq: int, micro_batch: int, hidden: int, heads: int,
                         vocab_size: int, bytes_per_value: int = 2, dropout: bool = True,
                         recompute: str = "none") -> float:
    """Activation bytes a whole GPT keeps for the backward of one micro-batch (no parallelism).

    ``n_layer`` times :func:`activation_bytes_per_layer` (Korthikanti et al. Table 2, first row,
    ``sbh (34 + 5as/h)`` per layer for ``p = 2`` with dropout) plus
    :func:`output_layer_activation_bytes` (§4.3). Linear in ``micro_batch``: ``k`` micro-batches
    whose graphs are alive together (e.g. their losses summed before one backward) keep ``k`` times
    this, while gradient accumulation (one backward per micro-batch) keeps it once. Embedding
    activations (the token ids) are left out, as in the paper.
    """
    per_layer = activation_bytes_per_layer(seq, micro_batch, hidden, heads,
                                           bytes_per_value=bytes_per_value, dropout=dropout,
                                           recompute=recompute)
    return (_check_int("n_layer", n_layer) * per_layer
            + output_layer_activation_bytes(seq, micro_batch, hidden, vocab_size, bytes_per_value))


# --------------------------------------------------------------------------- the whole picture

def training_memory(n_params: float, n_layer: int, seq: int, micro_batch: int, hidden: int,
                    heads: int, precision: str = "mixed", optimizer: str = "adam",
                    zero_stage: int = 0, dp_degree: int = 1, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none",
                    dropout: bool = True) -> dict:
    """Per-device training memory in bytes: model states (ZeRO) plus activations (Korthikanti).

    ``{"parameters", "gradients", "optimizer_states", "activations"}``. Model states come from
    :func:`zero_model_state_bytes` and are further divided by ``tp`` (tensor parallelism splits the
    weights; a simplification that ignores the replicated layer norms and biases). Activations are
    ``n_layer`` times :func:`activation_bytes_per_layer`, 2-byte values for ``"mixed"`` and 4-byte
    values for ``"fp32"``. Embedding, final-norm and loss activations are left out (Korthikanti
    §4.3 shows they are small next to the layers).
    """
    t = _check_int("tp", tp)
    states = zero_model_state_bytes(n_params, zero_stage, dp_degree, precision, optimizer)
    out = {k: v / t for k, v in states.items()}
    p = 4 if precision == "fp32" else 2
    out["activations"] = _check_int("n_layer", n_layer) * activation_bytes_per_layer(
        seq, micro_batch, hidden, heads, tp=t, sequence_parallel=sequence_parallel,
        recompute=recompute, bytes_per_value=p, dropout=dropout)
    return out


# --------------------------------------------------------------------------- measuring

def count_flops(fn, *args, **kwargs) -> tuple:
    """Run ``fn(*args, **kwargs)`` under ``torch.utils.flop_counter.FlopCounterMode``.

    Returns ``(result, total_flops, per_op)`` where ``per_op`` maps an aten op name
    (``"aten.mm"``...) to FLOPs. FlopCounterMode counts matrix products and convolutions only
    (``2 m n k`` for an ``(m, k) @ (k, n)``), which is the same convention as the formulas above.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return result, counter.get_total_flops(), per_op


def saved_tensors(fn, *args, **kwargs) -> tuple:
    """Run ``fn(*args, **kwargs)`` and return ``(result, saved)``: ``saved`` holds one tensor per
    distinct storage that autograd saved for the backward, in saving order.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor an op saves for its backward
    passes through the pack hook. A view and its base share a storage, and several ops may save the
    same tensor, so storages are counted once (``t.untyped_storage().nbytes()`` is the memory).
    The one place the course measures saved activations; :func:`saved_activation_bytes` and
    ``course_lib.precision.saved_tensors_report`` build on it.
    """
    import torch

    seen, saved = set(), []

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return result, saved


def saved_activation_bytes(fn, *args, exclude=(), **kwargs) -> tuple:
    """Bytes autograd saves for the backward while running ``fn(*args, **kwargs)``.

    Counts each saved storage once (see :func:`saved_tensors`), skipping the storages of the
    tensors in ``exclude`` (pass the model's parameters: they are model state, not activations).
    Returns ``(result, total_bytes, saved)`` with ``saved`` a list of ``(shape, dtype, nbytes)``,
    one per counted storage, in saving order.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    result, tensors = saved_tensors(fn, *args, **kwargs)
    saved = [(tuple(t.shape), t.dtype, t.untyped_storage().nbytes()) for t in tensors
             if t.untyped_storage().data_ptr() not in skip]
    return result, sum(n for _, _, n in saved), saved


def measured_model_state_bytes(model, optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state actually held by ``model``/``optimizer``.

    Call it after at least one ``optimizer.step()`` (optimizers allocate their state lazily).
    ``optimizer_states`` adds every tensor in ``optimizer.state`` (Adam's ``exp_avg``,
    ``exp_avg_sq`` and its one-element ``step`` counter per parameter tensor).
    """
    params = list(model.parameters())
    out = {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_states": 0,
    }
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "element_size"):
                out["optimizer_states"] += value.numel() * value.element_size()
    return out
