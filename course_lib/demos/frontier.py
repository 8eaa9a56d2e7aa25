"""The frontier recipe (notebook 14) under torchrun: dp x pp x tp, ZeRO-1 in bf16, recomputation, an MoE
block and sharded checkpoints, with the model FLOPs utilisation of every step.

    torchrun --standalone --nproc_per_node=8 -m course_lib.demos.frontier --tp 2 --pp 2 --steps 12 --check
    torchrun --standalone --nproc_per_node=4 -m course_lib.demos.frontier --tp 2 --pp 2 --fp32 --check

``dp`` is what is left: ``world_size / (tp * pp)``. Every step prints its time and its MFU:
``step FLOPs / (seconds * world_size * peak)``, the FLOPs counted once by ``torch.utils.flop_counter``
on the one-process model (``course_lib.frontier.step_flops``: matmuls of the forward and backward, the
MoE's active experts only, not recomputation's extra forward: MFU, not HFU). ``--peak-tflops`` is the
peak of one device; without it each rank measures a matmul's rate on its own device and uses that (a
CPU core has no datasheet number that means the same; on a GPU, pass the datasheet's). ``--check``
trains the same model in one process on the CPU and compares the loss curves (bf16: within 0.1;
``--fp32``: within 1e-4). Checkpoints go to ``--dir`` (default: a new temporary folder); a restart
(``--max-restarts``) resumes from the newest one.

The backend is chosen as :func:`course_lib.launch.init_from_env` does (NCCL with a GPU per local rank,
else gloo; ``--backend gloo`` forces CPU processes), and the model and the batches are created on
the rank's device (:func:`course_lib.launch.device`). Run on CPU processes with gloo; written for
NCCL, not yet run on GPUs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from course_lib.demos import finish
from course_lib.launch import device, init_from_env


def measure_peak_flops(n: int = 256, seconds: float = 0.5, dtype=torch.float32,
                       device: torch.device | str = "cpu") -> float:
    """FLOP/s of an ``n x n`` matmul on ``device`` (on the CPU: this process, one thread), best of a few
    timed batches (on a GPU each batch is waited for: its kernels run asynchronously)."""
    device = torch.device(device)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sync()
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def main(argv: list[str] | None = None) -> None:
    from dataclasses import asdict
    from datetime import timedelta

    import torch.distributed as dist

    from course_lib import frontier as FR

    p = argparse.ArgumentParser(prog="torchrun ... -m course_lib.demos.frontier", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 parameters and messages")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--dir", default=None, help="checkpoint directory (shared by all ranks)")
    p.add_argument("--peak-tflops", type=float, default=None, help="one device's peak (default: measured)")
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="force a backend (default: NCCL with one GPU per local rank, else gloo)")
    args = p.parse_args(argv)
    rank, world = init_from_env(backend=args.backend, timeout=timedelta(seconds=60))
    dev = device()
    if args.tp < 1 or args.pp < 1 or world % (args.tp * args.pp):
        raise SystemExit(f"--tp {args.tp} x --pp {args.pp} must divide the world size {world}")
    try:
        recipe = FR.Recipe(dp=world // (args.tp * args.pp), pp=args.pp, tp=args.tp, layers=args.layers,
                           hidden=args.hidden, heads=args.heads, experts=args.experts, batch=args.batch,
                           micro=args.micro, steps=args.steps, checkpoint_every=args.every,
                           bf16=not args.fp32, recompute=not args.no_recompute)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    directory = [args.dir or (tempfile.mkdtemp(prefix="course-frontier-") if rank == 0 else None)]
    dist.broadcast_object_list(directory, src=0)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    flops = FR.step_flops(recipe)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else measure_peak_flops(dtype=recipe.dtype, device=dev)
    out = FR.train(rank, world, attempt, directory[0], recipe, device=dev)
    lines = []
    if rank == 0:
        lines.append(f"frontier recipe ({dist.get_backend()}, rank 0 on {dev}): "
                     f"dp={recipe.dp} pp={recipe.pp} tp={recipe.tp}, "
                     f"{'bf16' if recipe.bf16 else 'fp32'}, ZeRO-1, recompute={recipe.recompute}, "
                     f"MoE {recipe.experts} experts top-{recipe.top_k}; {flops / 1e6:.1f} MFLOP per step; "
                     f"peak {peak / 1e9:.2f} GFLOP/s per rank ({'given' if args.peak_tflops else 'measured'})")
        for i, s in enumerate(out["seconds"]):
            step = out["resumed_from"] + i
            lines.append(f"step {step + 1:3d}  loss {out['losses'][step]:.4f}  {s * 1e3:7.1f} ms  "
                         f"MFU {flops / (s * world * peak):6.2%}")
    ok = True
    if args.check and rank == 0:
        ref = FR.train_reference(recipe)
        diff = max(abs(a - b) for a, b in zip(out["losses"], ref))
        tol = 0.1 if recipe.bf16 else 1e-4
        ok = diff <= tol
        lines.append(f"check: max |loss - one-process loss| = {diff:.2e} (tolerance {tol:g}): "
                     f"{'OK' if ok else 'MISMATCH'}")
    finish("\n".join(lines) if lines else None, ok)


if __name__ == "__main__":
    main()
