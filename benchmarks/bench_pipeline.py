"""Benchmark: our 1F1B pipeline step (course_lib.pipeline.run_schedule) vs torch.distributed.pipelining.

1. Step time: the same stages (an ``nn.Sequential`` of Linear + Tanh layers cut into one stage per
   rank), the same micro-batches, forward + backward of one 1F1B step, ours / ``Schedule1F1B`` (and
   interleaved 1F1B with 2 stages per rank / ``ScheduleInterleaved1F1B``) -- target <= 1.1 -- for a
   small model (hidden 256: per-message overhead dominates; ours sends a shape header before every
   tensor, torch infers the shapes once) and a larger one (hidden 1024: compute dominates). Timed in
   interleaved rounds, so background load hits both alike; the median of the rounds.
2. Bubble: 1F1B on ``SleepLayer`` stages (emulated compute: each sleeps ``--sleep-ms`` per micro-batch
   forward and twice that backward, so the 2 cores do not distort the schedule), measured bubble from
   the recorded spans minus ``(p-1)/(m+p-1)`` -- target within +-0.03.

Printed, never asserted.

    python benchmarks/bench_pipeline.py [--world-size 4] [--sizes 256x256,1024x512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench_step(rank, world_size, hidden, batch, m, layers, steps, rounds):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from course_lib import pipeline as P

    torch.manual_seed(0)
    runners = {}
    for v, ours, theirs in ((1, "1f1b", "1f1b"), (2, "interleaved", "interleaved")):
        S = world_size * v
        model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)])
        mine = [s for s in range(S) if P.stage_rank(s, world_size) == rank]
        stages = P.build_stages(model, P.partition(model, S), mine)
        x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)
        sched = P.make_schedule(ours, world_size, m, v)
        mbs, tgts = P.split_microbatches(x, m), P.split_microbatches(y, m)
        tsched = P.torch_schedule(theirs, stages, S, m, nn.functional.mse_loss)

        def run_ours(sched=sched, stages=stages, mbs=mbs, tgts=tgts):
            P.run_schedule(sched, stages, mbs, tgts, nn.functional.mse_loss)

        def run_torch(tsched=tsched, mine=mine, x=x, y=y, S=S):
            P.torch_pipeline_step(tsched, batch=x if 0 in mine else None, target=y if S - 1 in mine else None)

        runners[(ours, "ours")] = (run_ours, model)
        runners[(ours, "torch")] = (run_torch, model)

    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k, (fn, model) in runners.items():
            fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
                model.zero_grad(set_to_none=True)
            dist.barrier()
            times[k].append((time.perf_counter() - t0) / steps)
    return {f"{a}|{b}": statistics.median(v) for (a, b), v in times.items()}


def bench_bubble(rank, world_size, m, sleep_s):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from course_lib import pipeline as P, trace
    from course_lib.models import SleepLayer

    model = nn.Sequential(*[SleepLayer(sleep_s) for _ in range(world_size)])
    stages = P.build_stages(model, P.partition(model, world_size), [rank])
    x, y = torch.randn(4 * m, 2), torch.randn(4 * m, 2)
    sched = P.one_f_one_b_schedule(world_size, m)
    args = (sched, stages, P.split_microbatches(x, m), P.split_microbatches(y, m), nn.functional.mse_loss)
    P.run_schedule(*args)
    dist.barrier()
    with trace.Recorder() as rec:
        P.run_schedule(*args)
    return rec.events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--sizes", default="256x256,1024x512", help="hidden x batch, comma-separated")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    args = ap.parse_args()

    import warnings
    warnings.filterwarnings("ignore")
    from course_lib import pipeline as P
    from course_lib.launch import Cluster

    p = args.world_size
    with Cluster(p, timeout=600) as cluster:
        for size in args.sizes.split(","):
            hidden, batch = (int(v) for v in size.split("x"))
            out = cluster.run(bench_step, hidden, batch, args.microbatches, args.layers, args.steps,
                              args.rounds)
            t = {k: max(o[k] for o in out) for k in out[0]}  # a step ends with its slowest rank
            print(f"{args.layers} x (Linear({hidden}, {hidden}) + Tanh), batch {batch}, "
                  f"m = {args.microbatches} micro-batches, {p} ranks (gloo), one training step")
            for name, label in (("1f1b", "1F1B / Schedule1F1B"),
                                ("interleaved", "interleaved v=2 / ScheduleInterleaved1F1B")):
                o, d = t[f"{name}|ours"], t[f"{name}|torch"]
                print(f"  {label:44s}: {o / d:.2f}  ({o * 1e3:.1f} ms vs {d * 1e3:.1f} ms; target <= 1.1)")
        print(f"1F1B on SleepLayer stages ({args.sleep_ms:g} ms forward, {2 * args.sleep_ms:g} ms backward, "
              f"emulated compute), {p} ranks: measured bubble - (p-1)/(m+p-1)")
        for m in (4, 8, 16):
            events = cluster.run(bench_bubble, m, args.sleep_ms / 1e3)
            b, th = P.bubble_fraction(events), P.theoretical_bubble(p, m)
            print(f"  m = {m:2d}: measured {b:.3f}, theory {th:.3f}, difference {b - th:+.3f} (target within +-0.03)")


if __name__ == "__main__":
    main()
