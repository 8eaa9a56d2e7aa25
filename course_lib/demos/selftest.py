"""Self-test for a new cluster: backend, GPUs seen, an all-reduce bandwidth sweep, PASS/FAIL.

    python -m course_lib.demos.selftest                                  # this node: one rank per GPU (else 2 CPU ranks)
    torchrun --standalone --nproc_per_node=8 -m course_lib.demos.selftest
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m course_lib.demos.selftest

For each message size it times ``dist.all_reduce`` (SUM, float32) and reports, in nccl-tests' terms
(nccl-tests, doc/PERFORMANCE.md): algorithm bandwidth ``algbw = bytes / time`` and bus bandwidth
``busbw = algbw * 2 (n - 1) / n``, the figure comparable with the hardware's link speed whatever the
number of ranks ``n``. Every result is checked (rank r contributes r + 1, so each element must equal
n (n + 1) / 2); the exit status is 0 on PASS and 1 on FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib.launch import device, init_from_env


def all_reduce_sweep(rank: int, world_size: int, sizes: list[int], iters: int = 5) -> dict:
    """Time ``all_reduce`` for each size in bytes; return per-size ``seconds`` (median) and ``ok``."""
    dev = device()
    out = {"backend": dist.get_backend(), "device": str(dev),
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "rows": []}
    expected = world_size * (world_size + 1) / 2
    for nbytes in sizes:
        n = max(1, nbytes // 4)  # float32 elements
        x = torch.empty(n, dtype=torch.float32, device=dev)
        times, ok = [], True
        for i in range(iters + 1):  # the first call is a warm-up
            x.fill_(rank + 1)
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            ok = ok and bool(torch.all(x == expected).item())
        t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the collective's time
        okt = torch.tensor([0.0 if ok else 1.0], device=dev)
        dist.all_reduce(okt)
        out["rows"].append({"bytes": n * 4, "seconds": t.item(), "ok": okt.item() == 0})
    return out


def bandwidths(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s for an all-reduce (nccl-tests, doc/PERFORMANCE.md)."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


def report(res: dict, world_size: int) -> tuple[str, bool]:
    lines = [f"backend {res['backend']}, {world_size} ranks, device of rank 0: {res['device']}, "
             f"GPUs visible on rank 0's node: {res['gpus']}",
             f"{'size (B)':>12}  {'time (us)':>10}  {'algbw (GB/s)':>12}  {'busbw (GB/s)':>12}  result"]
    for r in res["rows"]:
        alg, bus = bandwidths(r["bytes"], r["seconds"], world_size)
        lines.append(f"{r['bytes']:>12}  {r['seconds'] * 1e6:>10.1f}  {alg / 1e9:>12.3f}  {bus / 1e9:>12.3f}  "
                     f"{'ok' if r['ok'] else 'WRONG'}")
    ok = bool(res["rows"]) and all(r["ok"] for r in res["rows"])
    lines.append("PASS" if ok else "FAIL: an all-reduce gave a wrong result")
    return "\n".join(lines) + "\n", ok


def _sizes(max_bytes: int) -> list[int]:
    sizes, s = [], 1024
    while s <= max_bytes:
        sizes.append(s)
        s *= 8
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.demos.selftest", description=__doc__.split("\n")[0])
    p.add_argument("--max-bytes", type=int, default=16 * 2**20, help="largest message (default 16 MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per size (default 5)")
    p.add_argument("--ranks", type=int, default=None,
                   help="without torchrun: ranks to start (default: one per GPU, else 2 on CPU)")
    a = p.parse_args(argv)
    if a.max_bytes < 1024 or a.iters < 1:
        p.error("--max-bytes must be >= 1024 and --iters >= 1")
    sizes = _sizes(a.max_bytes)
    if "RANK" in os.environ:  # under torchrun
        rank, world_size = init_from_env()
        res = all_reduce_sweep(rank, world_size, sizes, a.iters)
        dist.destroy_process_group()
        text, ok = report(res, world_size)
        if rank == 0:
            sys.stdout.write(text)
            sys.stdout.flush()
        return 0 if ok else 1
    from course_lib.launch import run
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world_size = a.ranks or (n_gpu if n_gpu >= 2 else 2)
    res = run(all_reduce_sweep, world_size, sizes, a.iters)[0]
    text, ok = report(res, world_size)
    sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
