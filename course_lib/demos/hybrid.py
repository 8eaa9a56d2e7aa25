"""Train the course's tiny GPT with data x pipeline x tensor parallelism, runnable two ways.

On the virtual cluster (notebook 09)::

    from course_lib.launch import Cluster
    from course_lib.demos.hybrid import train
    with Cluster(8) as c:
        out = c.run(train, 2, 2, 2)          # dp, pp, tp

With torchrun, on GPUs (NCCL, one per process) or CPU processes (gloo)::

    torchrun --standalone --nproc_per_node=8 -m course_lib.demos.hybrid --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=4 -m course_lib.demos.hybrid --tp 2 --pp 2 --check

``dp`` is what is left: ``world_size / (tp * pp)``. ``--check`` also trains the same model in one
process on every rank and compares the loss curves (the hybrid run must equal it to rounding).
The model is tiny on purpose (2 cores run 8 ranks); scale it with ``--layers/--hidden/--heads``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from course_lib.demos import finish
from course_lib.launch import device, init_from_env

DEFAULTS = dict(vocab=64, block=16, layers=2, heads=2, hidden=32, batch=16, micro=4, steps=10, lr=3e-3,
                seed=0)


def make_model(vocab=64, block=16, layers=2, heads=2, hidden=32, seed=0, dtype=torch.float64):
    """The seeded TinyGPT every rank builds (the same weights everywhere)."""
    from course_lib.models import TinyGPT
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=hidden).to(dtype)


def make_batches(steps, batch=16, block=16, vocab=64, seed=0):
    """``steps`` seeded ``(x, y)`` token batches of ``batch`` sequences (the same on every rank)."""
    from course_lib.models import make_tokens
    return [make_tokens(batch, block, vocab, seed=seed + 1 + i) for i in range(steps)]


def train_reference(steps=10, dtype=torch.float64, **cfg) -> list[float]:
    """The same training in one process: the losses the hybrid run must reproduce."""
    c = {**DEFAULTS, **cfg}
    model = make_model(c["vocab"], c["block"], c["layers"], c["heads"], c["hidden"], c["seed"], dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"])
    losses = []
    for x, y in make_batches(steps, c["batch"], c["block"], c["vocab"], c["seed"]):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train(rank: int, world_size: int, dp: int, pp: int, tp: int, steps: int = 10, *,
          dtype=torch.float64, schedule: str = "1f1b", **cfg) -> dict:
    """One rank of a ``dp x pp x tp`` training run of the tiny GPT (AdamW, ``steps`` steps).

    Returns ``{"coords", "stage", "losses"}`` (the replica's mean loss per step on last-stage ranks,
    else ``None``), ``"seconds"`` per step and ``"n_params"`` (this rank's). To count bytes per axis,
    wrap a step in :class:`course_lib.mesh.CommMeter` (notebook 09 does)."""
    from course_lib import mesh as M

    c = {**DEFAULTS, **cfg}
    dev = device()
    pm = M.init_process_mesh((dp, pp, tp))
    model = make_model(c["vocab"], c["block"], c["layers"], c["heads"], c["hidden"], c["seed"], dtype).to(dev)
    h = M.HybridGPT(model, pm, schedule=schedule)
    opt = torch.optim.AdamW(h.parameters(), lr=c["lr"])
    losses, seconds = [], []
    for x, y in make_batches(steps, c["batch"], c["block"], c["vocab"], c["seed"]):
        t0 = time.perf_counter()
        h.zero_grad()
        loss = h.forward_backward(x.to(dev), y.to(dev), c["micro"])
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"coords": pm.coords, "stage": h.stage, "losses": losses if h.last else None, "seconds": seconds,
            "n_params": sum(p.numel() for p in h.parameters())}


def replica_losses(results: list[dict]) -> list[float]:
    """The global loss per step from :func:`train`'s per-rank results: the mean over data-parallel
    replicas of the last stage's loss (every tp rank of a stage reports the same value)."""
    last = [r["losses"] for r in results if r["losses"] is not None and r["coords"]["tp"] == 0]
    return [sum(col) / len(col) for col in zip(*last)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m course_lib.demos.hybrid", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides --heads)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (at most --layers)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--micro", type=int, default=DEFAULTS["micro"], help="micro-batches per replica and step")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="global batch (sequences)")
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
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
    out = train(rank, world, dp, args.pp, args.tp, args.steps, dtype=dtype, schedule=args.schedule, **cfg)
    import torch.distributed as dist
    # gather every rank's losses on rank 0 (a tiny object collective) to print the global curve once
    results = [None] * world
    dist.all_gather_object(results, {k: out[k] for k in ("coords", "losses", "seconds")})
    ok, text = True, None
    if rank == 0:
        losses = replica_losses(results)
        step_s = sorted(out["seconds"])[len(out["seconds"]) // 2]
        lines = [f"hybrid training: dp={dp} pp={args.pp} tp={args.tp} on {world} processes "
                 f"({dist.get_backend()}, {device()}), median step {step_s * 1e3:.1f} ms"]
        lines += [f"step {i:3d}  loss {v:.6f}" for i, v in enumerate(losses)]
        if args.check:
            ref = train_reference(args.steps, dtype, **cfg)
            err = max(abs(a - b) for a, b in zip(losses, ref))
            tol = 1e-4 if args.float32 else 1e-9
            ok = err <= tol
            lines.append(f"single-process reference: max |loss difference| = {err:.2e} "
                         f"({'OK' if ok else 'WRONG'}, tolerance {tol:g})")
        text = "\n".join(lines)
    finish(text, ok)


if __name__ == "__main__":
    main()
