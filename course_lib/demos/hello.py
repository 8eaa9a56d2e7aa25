"""The first multi-process program of the course, runnable two ways.

In a notebook, on the virtual cluster::

    from course_lib.launch import run
    from course_lib.demos.hello import broadcast_and_all_reduce
    run(broadcast_and_all_reduce, 4)

On real GPUs (or CPU processes) with torchrun, one node or several::

    torchrun --standalone --nproc_per_node=2 -m course_lib.demos.hello
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m course_lib.demos.hello

The worker function is the same; only the start-up differs (:func:`course_lib.launch.init_from_env`).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

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


def main() -> None:
    rank, world_size = init_from_env()
    out = broadcast_and_all_reduce(rank, world_size)
    expected = world_size * (world_size + 1) / 2
    ok = all(v == expected for v in out["after_all_reduce"]) and out["after_broadcast"] == list(
        map(float, range(len(out["before"]))))
    line = (f"[rank {rank}/{world_size} on {out['device']} via {out['backend']}] before={out['before']} "
            f"after_broadcast={out['after_broadcast']} after_all_reduce={out['after_all_reduce']} "
            f"{'OK' if ok else 'WRONG'}\n")
    # One write of the whole line: the ranks share torchrun's stdout, and print() may write the
    # text and the newline separately (unbuffered output), letting another rank's line slip between.
    sys.stdout.write(line)
    sys.stdout.flush()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
