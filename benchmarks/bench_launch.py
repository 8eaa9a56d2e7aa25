"""Virtual-cluster overheads: a cold `run` of a 4-rank no-op and warm `Cluster.run` dispatch latency.

Target (issue #2): warm dispatch of a 4-rank no-op under 10 ms; a pipe round trip is well under 1 ms.
Figures are printed, never asserted.   Usage: python benchmarks/bench_launch.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from course_lib.launch import Cluster, run


def noop(rank, world_size):
    return rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--cold", type=int, default=3, help="cold runs (each starts and stops the ranks)")
    ap.add_argument("--repeats", type=int, default=200, help="warm calls")
    a = ap.parse_args()

    cold = []
    for _ in range(a.cold):
        t0 = time.perf_counter()
        run(noop, a.world_size)
        cold.append(time.perf_counter() - t0)

    with Cluster(a.world_size) as cluster:
        cluster.run(noop)  # first call warms the pickling path
        warm = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            cluster.run(noop)
            warm.append(time.perf_counter() - t0)

    warm_ms = sorted(w * 1e3 for w in warm)
    print(f"world_size={a.world_size}")
    print(f"cold run() of a no-op (start + call + stop), median of {a.cold}: {statistics.median(cold):.2f} s")
    print(f"warm Cluster.run dispatch, median of {a.repeats}: {statistics.median(warm_ms):.3f} ms "
          f"(p10 {warm_ms[len(warm_ms) // 10]:.3f} ms, p90 {warm_ms[9 * len(warm_ms) // 10]:.3f} ms); "
          f"target < 10 ms -> {'met' if statistics.median(warm_ms) < 10 else 'MISSED'}")


if __name__ == "__main__":
    main()
