"""Ring all-reduce from scratch vs ``dist.all_reduce`` (gloo), same processes, same data.

Prints, per world size (2, 3 and 4) and message size (1-64 MB of float32), the median time of our
``course_lib.collectives.ring_all_reduce`` and of ``torch.distributed.all_reduce`` and their ratio
(ours / torch; < 1 means ours is faster), plus the bus bandwidth of both as nccl-tests defines it
(busbw = algbw * 2(N-1)/N, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

Ratios are printed, never asserted: on a shared 2-core machine timings are noisy, and 4 ranks
oversubscribe 2 cores (the ranks take turns on the CPU, which hurts both implementations).

    python benchmarks/bench_collectives.py                 # ~2-3 minutes on 2 cores
    python benchmarks/bench_collectives.py --sizes-mb 1 16 --world-sizes 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from course_lib.launch import Cluster


def _bench(rank, world_size, sizes_mb, repeats, pipeline_bytes):
    """Runs on every rank: time ours and torch's all-reduce, alternating, on the same data."""
    import torch
    import torch.distributed as dist
    from course_lib.collectives import ring_all_reduce

    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        y_ours, y_torch = x.clone(), x.clone()
        ring_all_reduce(y_ours, pipeline_bytes=pipeline_bytes)  # warm-up (and allocations)
        dist.all_reduce(y_torch)
        t_ours, t_torch = [], []
        for _ in range(repeats):
            # Alternate the two so slow drifts of the shared machine hit both equally.
            for fn, ts in ((lambda t: ring_all_reduce(t, pipeline_bytes=pipeline_bytes), t_ours),
                           (dist.all_reduce, t_torch)):
                y = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                fn(y)
                ts.append(time.perf_counter() - t0)
        # A collective ends when its slowest rank ends: report the max over ranks of each repeat.
        times = torch.tensor([t_ours, t_torch], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append((mb, statistics.median(times[0].tolist()), statistics.median(times[1].tolist()),
                     bool(torch.allclose(y_ours, y_torch, rtol=1e-5, atol=1e-4))))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pipeline-bytes", type=int, default=None,
                   help="piece size for pipelining inside a ring step (default: the library's)")
    args = p.parse_args(argv)
    from course_lib.collectives import DEFAULT_PIPELINE_BYTES
    pb = DEFAULT_PIPELINE_BYTES if args.pipeline_bytes is None else args.pipeline_bytes

    print(f"ring_all_reduce (ours) vs dist.all_reduce (gloo), float32, median of {args.repeats}, "
          f"pipeline_bytes={pb}")
    print(f"{'ranks':>5} {'size':>8} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} "
          f"{'busbw ours':>11} {'busbw torch':>12}  equal")
    for ws in args.world_sizes:
        with Cluster(ws, timeout=600) as cluster:
            rows = cluster.run(_bench, args.sizes_mb, args.repeats, pb)[0]
        for mb, t_o, t_t, same in rows:
            nbytes = mb * 2**20
            bus = 2 * (ws - 1) / ws  # nccl-tests: busbw = algbw * 2(N-1)/N for all-reduce
            print(f"{ws:>5} {mb:>6g}MB {t_o * 1e3:>9.1f} {t_t * 1e3:>9.1f} {t_o / t_t:>10.2f} "
                  f"{nbytes / t_o * bus / 1e9:>8.2f}GB/s {nbytes / t_t * bus / 1e9:>9.2f}GB/s  {same}")
    if any(ws > 2 for ws in args.world_sizes):
        print("note: ranks > 2 oversubscribe this machine's CPU cores when it has 2; "
              "both implementations share the penalty")


if __name__ == "__main__":
    main()
