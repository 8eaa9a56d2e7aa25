"""Train the course's tiny GPT with data x pipeline x tensor parallelism under torchrun (notebook 09).

On GPUs (NCCL, one per process) or CPU processes (gloo)::

    torchrun --standalone --nproc_per_node=8 -m course_lib.demos.hybrid --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=4 -m course_lib.demos.hybrid --tp 2 --pp 2 --check

``dp`` is what is left: ``world_size / (tp * pp)``. ``--check`` also trains the same model in one
process on every rank and compares the loss curves (the hybrid run must equal it to rounding).
The model is tiny on purpose (2 cores run 8 ranks); scale it with ``--layers/--hidden/--heads``.
The model and the run are :mod:`course_lib.hybrid_gpt`'s (:func:`~course_lib.hybrid_gpt.train`, which
notebook 09 runs on the virtual cluster); this module only parses the command line and prints.
"""

from __future__ import annotations

import argparse

import torch

from course_lib import hybrid_gpt
from course_lib.demos import finish
from course_lib.launch import device, init_from_env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m course_lib.demos.hybrid", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides --heads)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (at most --layers)")
    p.add_argument("--steps", type=int, default=hybrid_gpt.DEFAULTS["steps"])
    p.add_argument("--micro", type=int, default=hybrid_gpt.DEFAULTS["micro"], help="micro-batches per replica and step")
    p.add_argument("--batch", type=int, default=hybrid_gpt.DEFAULTS["batch"], help="global batch (sequences)")
    p.add_argument("--layers", type=int, default=hybrid_gpt.DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=hybrid_gpt.DEFAULTS["heads"])
    p.add_argument("--hidden", type=int, default=hybrid_gpt.DEFAULTS["hidden"])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    p.add_argument("--float32", action="store_true", help="train in float32 (default float64: exact check)")
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    rank, world = init_from_env()
    if args.tp < 1 or args.pp < 1 or world % (args.tp * args.pp):
        raise SystemExit(f"[rank {rank}] --tp {args.tp} x --pp {args.pp} must divide the {world} processes; "
                         f"dp is world / (tp * pp)")
    dp = world // (args.tp * args.pp)
    dtype = torch.float32 if args.float32 else torch.float64
    cfg = dict(batch=args.batch, micro=args.micro, layers=args.layers, heads=args.heads, hidden=args.hidden)
    out = hybrid_gpt.train(rank, world, dp, args.pp, args.tp, args.steps, dtype=dtype, schedule=args.schedule, **cfg)
    import torch.distributed as dist
    # gather every rank's losses on rank 0 (a tiny object collective) to print the global curve once
    results = [None] * world
    dist.all_gather_object(results, {k: out[k] for k in ("coords", "losses", "seconds")})
    ok, text = True, None
    if rank == 0:
        losses = hybrid_gpt.replica_losses(results)
        step_s = sorted(out["seconds"])[len(out["seconds"]) // 2]
        lines = [f"hybrid training: dp={dp} pp={args.pp} tp={args.tp} on {world} processes "
                 f"({dist.get_backend()}, {device()}), median step {step_s * 1e3:.1f} ms"]
        lines += [f"step {i:3d}  loss {v:.6f}" for i, v in enumerate(losses)]
        if args.check:
            ref = hybrid_gpt.train_reference(args.steps, dtype, **cfg)
            err = max(abs(a - b) for a, b in zip(losses, ref))
            tol = 1e-4 if args.float32 else 1e-9
            ok = err <= tol
            lines.append(f"single-process reference: max |loss difference| = {err:.2e} "
                         f"({'OK' if ok else 'WRONG'}, tolerance {tol:g})")
        text = "\n".join(lines)
    finish(text, ok)


if __name__ == "__main__":
    main()
