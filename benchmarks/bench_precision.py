"""Benchmark: FSDP's weight all-gather in FP8 (course_lib.precision.fp8_all_gather) vs the same all-gather
in BF16, same weight, same ranks, same run.

Prints, per transport (the course's ring, and torch.distributed's own with ``builtin=True``):

* bytes each rank sends, FP8 / BF16 (``course_lib.trace``; ring only) -- target 0.50 (+ 4 bytes of amax
  per rank and up to 3 bytes of padding);
* median time of one all-gather, FP8 / BF16 -- below 1 where the link, not the cast, is the bottleneck.
  On loopback the cast to FP8 is a visible share of the time, so expect a ratio nearer 1 on a laptop.

Both are timed in interleaved rounds on the same ranks, so background load hits both alike.
Numbers are printed, never asserted (timings are noisy).

    python benchmarks/bench_precision.py [--world-size 4] [--hidden 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rank, world_size, hidden, rounds):
    import torch

    from course_lib import precision as P
    from course_lib import trace
    from course_lib.collectives import all_gather_single

    w = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    shard = w.reshape(-1).chunk(world_size)[rank].contiguous()
    out = {}
    for builtin in (False, True):
        full = torch.empty(hidden * hidden, dtype=torch.bfloat16)

        def bf16():
            all_gather_single(full, shard.bfloat16(), builtin=builtin)

        def fp8():
            P.fp8_all_gather(shard, builtin=builtin)

        sent = {}
        if not builtin:
            for name, fn in (("bf16", bf16), ("fp8", fp8)):
                with trace.Recorder() as rec:
                    fn()
                sent[name] = rec.totals()["bytes_sent"]
        times = {"bf16": [], "fp8": []}
        for _ in range(rounds):
            for name, fn in (("bf16", bf16), ("fp8", fp8)):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        out["builtin" if builtin else "ring"] = {"sent": sent, "median": {k: statistics.median(v) for k, v in times.items()}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from course_lib.launch import run

    res = run(bench, args.world_size, args.hidden, args.rounds)
    print(f"FSDP all-gather of one {args.hidden} x {args.hidden} weight over {args.world_size} ranks")
    for transport in ("ring", "builtin"):
        r = res[0][transport]
        line = f"  {transport:8s}"
        if r["sent"]:
            line += (f" bytes per rank FP8 {r['sent']['fp8']:,} / BF16 {r['sent']['bf16']:,} = "
                     f"{r['sent']['fp8'] / r['sent']['bf16']:.4f} (target 0.50);")
        m = r["median"]
        line += (f" median time FP8 {1e3 * m['fp8']:.1f} ms / BF16 {1e3 * m['bf16']:.1f} ms = "
                 f"{m['fp8'] / m['bf16']:.2f}")
        print(line)


if __name__ == "__main__":
    main()
