"""The first multi-process program of the course, runnable two ways.

In a notebook, on the virtual cluster::

    from course_lib.launch import run
    from course_lib.demos.hello import broadcast_and_all_reduce
    run(broadcast_and_all_reduce, 4)

On real GPUs (or CPU processes) with torchrun, one node or several::

    torchrun --standalone --nproc_per_node=2 -m course_lib.demos.hello
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m course_lib.demos.hello

The worker function is the same; only the start-up differs (:func:`course_lib.launch.init_from_env`).

``--die-rank R`` makes global rank R kill itself (SIGKILL, as the kernel's OOM killer would) after the
process group is up and before the collectives: a rehearsal of a lost process, to see how torchrun
reports it and that the other ranks and nodes stop instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from course_lib.demos import finish
from course_lib.launch import device, init_from_env


def broadcast_and_all_reduce(rank: int, world_size: int, n: int = 4) -> dict:
    """Each rank starts from its own tensor; rank 0's tensor is broadcast, then all ranks are summed.

    Returns this rank's tensors before and after each collective (as lists), plus where it ran.
    """
    dev = device()
    x = torch.arange(n, dtype=torch.float32, device=dev) + 10 * rank  # (n,) different on every rank
    before = x.tolist()
    dist.broadcast(x, src=0)  # every rank now holds rank 0's tensor
    after_broadcast = x.tolist()
    y = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(y, op=dist.ReduceOp.SUM)  # every rank holds 1 + 2 + ... + world_size
    return {"rank": rank, "device": str(dev), "backend": dist.get_backend(), "before": before,
            "after_broadcast": after_broadcast, "after_all_reduce": y.tolist()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m course_lib.demos.hello", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=4, help="elements per tensor (default 4)")
    p.add_argument("--die-rank", type=int, default=None, metavar="R",
                   help="global rank R kills itself (SIGKILL) before the collectives: a failure rehearsal")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.size < 1:
        raise SystemExit(f"--size must be at least 1, got {args.size}")
    rank, world_size = init_from_env()
    if args.die_rank is not None and not 0 <= args.die_rank < world_size:
        raise SystemExit(f"--die-rank {args.die_rank} is not a rank of this job (0..{world_size - 1})")
    if rank == args.die_rank:
        sys.stdout.write(f"[rank {rank}/{world_size}] --die-rank {rank}: killing myself with SIGKILL\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    out = broadcast_and_all_reduce(rank, world_size, args.size)
    expected = world_size * (world_size + 1) / 2
    ok = all(v == expected for v in out["after_all_reduce"]) and out["after_broadcast"] == list(
        map(float, range(len(out["before"]))))
    line = (f"[rank {rank}/{world_size} on {out['device']} via {out['backend']}] before={out['before']} "
            f"after_broadcast={out['after_broadcast']} after_all_reduce={out['after_all_reduce']} "
            f"{'OK' if ok else 'WRONG'}\n")
    finish(line, ok)


if __name__ == "__main__":
    main()
