"""GPU benchmark (the last step of ``make test-gpu``): the MFU gap, the frontier recipe and the allocator's
real peak, on one CUDA GPU.

(a) MFU. The course's ``TinyGPT`` at GPT-2 small's shape (12 layers, 12 heads, d = 768, vocabulary
    50,257, context 1,024) trains on 16 x 1,024 tokens a step in bf16 autocast with fused AdamW, three
    ways: the course's written-out attention, ``F.scaled_dot_product_attention``
    (``TinyGPT(attention="sdpa")``), and that model under ``torch.compile``. MFU = model FLOPs of a step /
    (seconds per step x peak) (Chowdhery et al. 2022, §4.1): the FLOPs from
    ``course_lib.estimate.gpt_training_flops`` (3 x (24 B s h^2 + 4 B s^2 h) per layer plus the LM head;
    the causal half of the attention that a fused kernel skips still counts, as in the papers), the peak
    the GPU's dense BF16 figure from ``course_lib.landscape.HARDWARE`` when the device name matches a
    row, else ``--peak-tflops``. Warm-up steps, then timed steps between two ``torch.cuda.synchronize()``
    (``course_lib.gpu.measure_gpt_step``, which notebook 01 runs too when it finds a GPU).
(b) The frontier recipe (``course_lib.frontier``, notebook 14) with dp = pp = tp = 1 on one GPU, in a
    one-rank NCCL cluster: its time per step and MFU with the FLOPs ``frontier.step_flops`` counts.
(c) Memory. fp32 Adam's model states, predicted at 16 bytes per parameter
    (``estimate.model_state_bytes``), next to the bytes of the tensors
    (``estimate.measured_model_state_bytes``) and ``torch.cuda.memory_allocated()`` after a step; and per
    attention, ``torch.cuda.max_memory_allocated()`` during a step: model states plus the activations,
    whose prediction (``estimate.gpt_activation_bytes``, Korthikanti et al. 2022, bf16, no dropout; the
    fused kernel keeps no score matrix, like their selective recomputation) is printed next to it.

Prints a table; ``--json FILE`` also writes the figures. Without CUDA it says so and exits 0 (``make
bench`` runs every benchmark); it exits 1 when a part failed, after printing the others.

    python benchmarks/bench_gpu.py [--json FILE] [--peak-tflops T] [--steps 10] [--warmup 3] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict

import torch

from course_lib import estimate as E
from course_lib.gpu import GPT2_SMALL, measure_gpt_step, peak_flops

BATCH = 16
#: (label, TinyGPT's attention, compiled)
VARIANTS = (("course attention", "course", False), ("SDPA", "sdpa", False), ("SDPA + torch.compile", "sdpa", True))


def frontier_on_one_gpu(peak: float | None, steps: int) -> dict:
    """The frontier recipe at dp = pp = tp = 1 on this GPU (one NCCL rank): median seconds per step
    (the first step, which pays the start-up, left out) and MFU with ``frontier.step_flops``."""
    from course_lib import frontier as FR
    from course_lib.launch import run

    recipe = FR.Recipe(dp=1, pp=1, tp=1, vocab=256, block=64, layers=4, heads=4, hidden=256, experts=4,
                       top_k=2, batch=16, micro=4, steps=steps, checkpoint_every=steps)
    flops = FR.step_flops(recipe)                                 # counted once, on the CPU
    with tempfile.TemporaryDirectory(prefix="bench-gpu-frontier-") as d:
        out = run(FR.train, 1, 0, d, recipe, backend="nccl", timeout=300)[0]
    s = statistics.median(out["seconds"][1:] or out["seconds"])
    return {"recipe": asdict(recipe), "flops_per_step": flops, "seconds_per_step": s,
            "mfu": flops / (s * peak) if peak else None, "losses": out["losses"],
            "state_bytes": out["state_bytes"]}


def _gb(x: float) -> str:
    return f"{x / E.GB:7.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures to FILE")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense BF16 peak in TFLOP/s (default: course_lib.landscape.HARDWARE by name)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--frontier-steps", type=int, default=8, help="steps of the frontier recipe (default 8)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variant")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.frontier_steps < 2:
        ap.error("--steps and --warmup must be >= 1, --frontier-steps >= 2")
    if not torch.cuda.is_available():
        print(f"bench_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda}). Run it on a GPU machine (make test-gpu); nothing measured.")
        return 0

    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    if args.peak_tflops:
        peak, peak_source = args.peak_tflops * 1e12, "--peak-tflops"
    else:
        found = peak_flops(name)
        peak, peak_source = found if found else (None, None)
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "peak_flops": peak, "peak_source": peak_source, "failures": {}}
    print(f"GPU: {name} (torch {torch.__version__}, CUDA {torch.version.cuda}); peak "
          + (f"{peak / 1e12:.1f} TFLOP/s dense BF16 ({peak_source})" if peak else
             "unknown: no course_lib.landscape.HARDWARE row matches this name; pass --peak-tflops for MFU"))

    # (a) MFU, three attentions ----------------------------------------------------------------------
    L, T, h, V = (GPT2_SMALL[k] for k in ("n_layer", "block_size", "n_embd", "vocab_size"))
    flops = E.gpt_training_flops(L, BATCH, T, h, V)
    runs = {}
    for label, attention, compiled in VARIANTS:
        if compiled and args.no_compile:
            continue
        try:
            runs[label] = measure_gpt_step(GPT2_SMALL, BATCH, attention, device=dev, compiled=compiled,
                                           steps=args.steps, warmup=args.warmup)
        except Exception as exc:  # noqa: BLE001 - report it, measure the rest
            report["failures"][label] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            torch.cuda.empty_cache()
    n = next(iter(runs.values()))["n_params"] if runs else E.gpt_param_count(L, h, V, T)
    print(f"\n(a) TinyGPT at GPT-2 small ({n / 1e6:.1f} M parameters), {BATCH} x {T} tokens a step, bf16 "
          f"autocast, fused AdamW: {flops / 1e12:.2f} TFLOP a step (estimate.gpt_training_flops)")
    print(f"    {'attention':<22}{'ms/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>8}{'peak memory':>13}"
          f"{'warm-up':>9}")
    for label, r in runs.items():
        s = r["seconds_per_step"]
        r.update(tflops=flops / s / 1e12, mfu=flops / (s * peak) if peak else None, tokens_per_s=BATCH * T / s)
        mfu = f"{r['mfu']:8.1%}" if peak else f"{'-':>8}"
        print(f"    {label:<22}{s * 1e3:9.1f}{r['tokens_per_s']:11,.0f}{r['tflops']:9.1f}{mfu}"
              f"{r['peak_bytes'] / E.GB:10.1f} GB{r['warmup_seconds']:8.1f} s")
    for label, err in report["failures"].items():
        print(f"    {label:<22}FAILED: {err}")
    report["gpt"] = {"config": {**GPT2_SMALL, "batch": BATCH}, "flops_per_step": flops, "runs": runs}

    # (b) the frontier recipe on one GPU ---------------------------------------------------------------
    try:
        fr = frontier_on_one_gpu(peak, args.frontier_steps)
        rc = fr["recipe"]
        mfu = f"MFU {fr['mfu']:.2%}" if peak else "MFU - (no peak)"
        print(f"\n(b) frontier recipe on one GPU (dp=pp=tp=1, {rc['layers']} layers, hidden {rc['hidden']}, "
              f"{'bf16' if rc['bf16'] else 'fp32'}, ZeRO-1, recompute, MoE {rc['experts']} experts top-"
              f"{rc['top_k']}, {rc['batch']} x {rc['block']} tokens): {fr['flops_per_step'] / 1e9:.1f} GFLOP a "
              f"step (frontier.step_flops), {fr['seconds_per_step'] * 1e3:.1f} ms a step, {mfu}; loss "
              f"{fr['losses'][0]:.3f} -> {fr['losses'][-1]:.3f}. At this toy size the GPU waits on kernel "
              f"launches and the Python around them, not on arithmetic.")
        report["frontier"] = fr
    except Exception as exc:  # noqa: BLE001 - report it after the rest
        report["failures"]["frontier"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[-1]
        print(f"\n(b) frontier recipe on one GPU: FAILED: {report['failures']['frontier']}")

    # (c) memory -------------------------------------------------------------------------------------
    if runs:
        first = next(iter(runs.values()))
        predicted = sum(E.model_state_bytes(n, "fp32", "adam").values())
        tensors = sum(first["state_tensor_bytes"].values())
        print(f"\n(c) model states, fp32 Adam, {n / 1e6:.1f} M parameters (after a step of the "
              f"{next(iter(runs))}):")
        for what, value in (("predicted, 16 B/parameter (estimate.model_state_bytes)", predicted),
                            ("tensors: parameters, gradients, AdamW (measured_model_state_bytes)", tensors),
                            ("torch.cuda.memory_allocated() after the step", first["allocated_after_step_bytes"]),
                            ("torch.cuda.memory_reserved(): the caching allocator's pool", first["reserved_bytes"])):
            print(f"    {what:<68}{_gb(value)}")
        print("    activations: torch.cuda.max_memory_allocated() during a step minus parameters and AdamW, "
              "vs Korthikanti et al. (bf16, no dropout):")
        predicted_act = {}
        for label, r in runs.items():
            recompute = "none" if label == "course attention" else "selective"
            predicted_act[label] = E.gpt_activation_bytes(L, T, BATCH, h, GPT2_SMALL["n_head"], V,
                                                          bytes_per_value=2, dropout=False, recompute=recompute)
            st = r["state_tensor_bytes"]
            r["activation_bytes"] = r["peak_bytes"] - (r["allocated_after_step_bytes"] - st["gradients"])
            print(f"    {label:<22} measured {_gb(r['activation_bytes'])}   predicted "
                  f"{_gb(predicted_act[label])} (recompute={recompute!r} row)")
        report["memory"] = {"predicted_state_bytes": predicted, "state_tensor_bytes": first["state_tensor_bytes"],
                            "allocated_after_step_bytes": first["allocated_after_step_bytes"],
                            "predicted_activation_bytes": predicted_act}

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"\nfigures written to {args.json}")
    if report["failures"]:
        print(f"FAILED: {', '.join(report['failures'])}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
