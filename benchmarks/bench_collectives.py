"""Ring all-reduce from scratch vs ``dist.all_reduce`` (gloo), same processes, same data.

Prints, per world size (2, 3 and 4) and message size (1-64 MB of float32), the median time of our
``course_lib.collectives.ring_all_reduce`` and of ``torch.distributed.all_reduce`` and their ratio
(ours / torch; < 1 means ours is faster), plus the bus bandwidth of both as nccl-tests defines it
(busbw = algbw * 2(N-1)/N, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

Ratios are printed, never asserted: on a shared 2-core machine timings are noisy, and 4 ranks
oversubscribe 2 cores (the ranks take turns on the CPU, which hurts both implementations).

    python benchmarks/bench_collectives.py                 # ~1 minute on 2 cores
    python benchmarks/bench_collectives.py --sizes-mb 1 16 --world-sizes 2 --repeats 3
    python benchmarks/bench_collectives.py --profile       # where our ring's time goes (~2 minutes)

``--profile`` splits each of our all-reduces into what can be measured separately on the ranks
themselves: the fixed cost of the 2(N-1) ring steps (our ring on a tensor of N elements, one value per
chunk: nothing but posting, matching and waiting for 2(N-1) messages), the N-1 additions of a chunk
and, for N = 2, the one copy out of the receive buffer (both timed on their own tensors), and the
rest, which is moving the bytes through gloo's TCP pairs. It does the same for gloo (fixed cost: its
all-reduce of N values) and times our ring with pieces of 256 KiB, 1 MiB and 4 MiB as well, which is
how ``DEFAULT_PIPELINE_BYTES`` was chosen.
"""

from __future__ import annotations

import argparse
import statistics
import time

from course_lib.launch import Cluster


def _median_max(samples):
    """Median over repeats of the slowest rank's time (a collective ends when its last rank ends)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


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
        rows.append((mb, _median_max(t_ours), _median_max(t_torch),
                     bool(torch.allclose(y_ours, y_torch, rtol=1e-5, atol=1e-4))))
    return rows


def _profile(rank, world_size, sizes_mb, repeats, pieces):
    """Runs on every rank: our ring's time split into fixed per-step cost, additions, copies, the rest.

    All variants of one size are timed in interleaved rounds (gloo, ours, ours with each piece size,
    the additions, the copy), so a slow spell of the shared machine hits them alike.
    """
    import torch
    import torch.distributed as dist
    from course_lib.collectives import chunk_bounds, ring_all_reduce

    def rounds(variants):
        """variants: name -> (fn, make_input). Median over repeats of the slowest rank, per name."""
        for fn, make in variants.values():
            fn(make())  # warm-up
        times = {name: [] for name in variants}
        for _ in range(repeats):
            for name, (fn, make) in variants.items():
                y = make()
                dist.barrier()
                t0 = time.perf_counter()
                fn(y)
                times[name].append(time.perf_counter() - t0)
        return {name: _median_max(ts) for name, ts in times.items()}

    N = world_size
    tiny = lambda: torch.ones(N)  # noqa: E731  one value per chunk: 2(N-1) messages of 4 bytes
    fixed = rounds({"ours": (ring_all_reduce, tiny), "gloo": (dist.all_reduce, tiny)})
    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        chunk = max(hi - lo for lo, hi in chunk_bounds(n, N))
        a, b = torch.randn(chunk), torch.randn(chunk)
        variants = {"gloo": (dist.all_reduce, x.clone), "ours": (ring_all_reduce, x.clone)}
        for pb in pieces:
            variants[pb] = (lambda t, pb=pb: ring_all_reduce(t, pipeline_bytes=pb), x.clone)
        variants["add"] = (lambda _: [a.add_(b) for _ in range(N - 1)], lambda: None)
        if N == 2:  # N > 2 receives the all-gather steps in place
            variants["copy"] = (lambda _: a.copy_(b), lambda: None)
        t = rounds(variants)
        rows.append(dict(mb=mb, ours=t["ours"], gloo=t["gloo"], pieces=[t[pb] for pb in pieces],
                          add=t["add"], copy=t.get("copy", 0.0)))
    return dict(fixed_ours=fixed["ours"], fixed_gloo=fixed["gloo"], rows=rows)


def profile(args) -> None:
    pieces = [256 << 10, 1 << 20, 4 << 20]
    print(f"where our ring all-reduce's time goes (float32, median of {args.repeats}, slowest rank)")
    print("fixed = the 2(N-1) steps' cost with one value per chunk; rest = ours - fixed - adds - copy")
    head = " ".join(f"{'p=' + str(pb >> 10) + 'K':>8}" for pb in pieces)
    print(f"{'ranks':>5} {'size':>6} {'gloo ms':>8} {'ours ms':>8} {'ratio':>6} | {'fixed':>6} "
          f"{'adds':>6} {'copy':>6} {'rest':>7} | pieces / whole chunks: {head}")
    for ws in args.world_sizes:
        with Cluster(ws, timeout=900) as cluster:
            prof = cluster.run(_profile, args.sizes_mb, args.repeats, pieces)[0]
        fo, fg = prof["fixed_ours"], prof["fixed_gloo"]
        print(f"{ws:>5} {'tiny':>6} {fg * 1e3:>8.2f} {fo * 1e3:>8.2f} {fo / fg:>6.2f} | "
              f"per step {fo / (2 * (ws - 1)) * 1e3:.2f} ms ({2 * (ws - 1)} steps)")
        for r in prof["rows"]:
            rest = r["ours"] - fo - r["add"] - r["copy"]
            ratios = " ".join(f"{t / r['ours']:>8.2f}" for t in r["pieces"])
            print(f"{ws:>5} {r['mb']:>4g}MB {r['gloo'] * 1e3:>8.1f} {r['ours'] * 1e3:>8.1f} "
                  f"{r['ours'] / r['gloo']:>6.2f} | {fo * 1e3:>6.1f} {r['add'] * 1e3:>6.1f} "
                  f"{r['copy'] * 1e3:>6.1f} {rest * 1e3:>7.1f} | {'':22s}{ratios}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--pipeline-bytes", type=int, default=None,
                   help="piece size for pipelining inside a ring step (default: the library's)")
    p.add_argument("--profile", action="store_true",
                   help="split our ring's time into per-step cost, additions, copies and the rest")
    args = p.parse_args(argv)
    if args.profile:
        return profile(args)
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
