"""Benchmark: from-scratch DDP vs torch.nn.parallel.DistributedDataParallel, same model, same run.

Prints two ratios of median step times (forward + backward + gradient sync + SGD step):

* bucketed DDP / torch DDP   -- target <= 1.05 (our Python hooks vs DDP's C++ reducer)
* naive DDP / bucketed DDP   -- what bucketing (fewer, larger all-reduces) and overlap buy

The three implementations are timed in interleaved rounds on the same ranks, so background load on
a shared machine hits all of them alike. Numbers are printed, never asserted (timings are noisy).

    python benchmarks/bench_ddp.py [--world-size 4] [--hidden 512] [--layers 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rank, world_size, hidden, layers, batch, bucket_mb, steps, rounds):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from course_lib.data_parallel import BucketedDDP, NaiveDDP
    from course_lib.models import TinyMLP

    def make(kind):
        torch.manual_seed(0)
        m = TinyMLP(hidden, hidden, hidden, layers)
        if kind == "naive":
            return NaiveDDP(m)
        if kind == "bucketed":
            return BucketedDDP(m, bucket_cap_bytes=int(bucket_mb * 2**20))
        return nn.parallel.DistributedDataParallel(m, bucket_cap_mb=bucket_mb)

    kinds = ["torch", "bucketed", "naive"]
    models = {k: make(k) for k in kinds}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)

    def step(k):
        m, opt = models[k], opts[k]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(m(x), y).backward()
        if k == "naive":
            m.sync_gradients()
        opt.step()

    for k in kinds:  # warm-up (torch DDP rebuilds its buckets after the first iteration)
        for _ in range(3):
            step(k)
    times = {k: [] for k in kinds}
    for _ in range(rounds):
        for k in kinds:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            torch.distributed.barrier()  # the slowest rank defines the step time
            times[k].append((time.perf_counter() - t0) / steps)
    n_params = sum(p.numel() for p in models["torch"].parameters())
    return {k: statistics.median(v) for k, v in times.items()}, n_params, len(models["bucketed"].buckets)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)

    from course_lib.launch import run

    t0 = time.time()
    res = run(bench, a.world_size, a.hidden, a.layers, a.batch, a.bucket_mb, a.steps, a.rounds, timeout=600)
    med, n_params, n_buckets = res[0]
    print(f"model: TinyMLP({a.hidden}, {a.hidden}, {a.hidden}, {a.layers}) = {n_params / 1e6:.2f} M params "
          f"({n_params * 4 / 2**20:.1f} MiB of fp32 gradients); world_size={a.world_size}, "
          f"per-rank batch={a.batch}, bucket cap={a.bucket_mb} MiB ({n_buckets} buckets)")
    for k in ("torch", "bucketed", "naive"):
        print(f"  {k:>8} DDP step: {med[k] * 1e3:8.1f} ms (median of {a.rounds} rounds x {a.steps} steps, rank 0)")
    print(f"bucketed / torch DDP = {med['bucketed'] / med['torch']:.3f}   (target <= 1.05)")
    print(f"naive / bucketed DDP = {med['naive'] / med['bucketed']:.3f}   (what bucketing + overlap buy)")
    print(f"benchmark wall time: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
