"""Benchmark: our expert-parallel MoE layer (course_lib.moe) vs a dense FFN with the same active FLOPs,
and our all-to-all vs ``dist.all_to_all_single``.

On ``--world-size`` ranks, each with its own tokens: the expert-parallel layer (``E`` experts, top-``k``,
capacity factor 1.25, so the buffers are the size a real run uses) forward + backward, against a dense FFN
of width ``k * 4h`` run locally on the same tokens (the same matmul FLOPs per token, no routing and no
communication): the ratio is what routing, dispatch and the two all-to-alls each way cost. Then the
all-to-all alone, the course's pairwise exchange against gloo's ``all_to_all_single`` on the same
buffer. Then the dropless layer (``DroplessMoE``: uneven all-to-all splits, the experts as one grouped
matmul where this torch has one) against the fixed-capacity layer, time and bytes sent, and the grouped
matmul against a loop of per-expert matmuls on the same rows (one process). Timed in interleaved rounds;
the slowest rank counts. Printed, never asserted.

    python benchmarks/bench_moe.py [--world-size 4] [--hidden 128] [--tokens 512] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rank, world_size, hidden, tokens, experts, top_k, steps, rounds):
    import torch
    import torch.distributed as dist

    from course_lib import collectives
    from course_lib import moe as X

    torch.manual_seed(0)
    full = X.MoELayer(hidden, 4 * hidden, experts, top_k, capacity_factor=1.25)
    runners = {"ours (course all-to-all)": X.ExpertParallelMoE.from_moe(full),
               "ours (dist.all_to_all_single)": X.ExpertParallelMoE.from_moe(full, builtin=True),
               "dropless (dist.all_to_all_single)": X.DroplessMoE.from_moe(full, builtin=True),
               "dropless, loop of matmuls": X.DroplessMoE.from_moe(full, builtin=True, use_grouped_mm=False),
               "dense FFN, same active FLOPs": X.Expert(hidden, top_k * 4 * hidden)}
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    ep = runners["ours (course all-to-all)"]
    ep(x)
    C = ep.last["capacity"]
    buf = torch.randn(experts * C, hidden)
    out = torch.empty_like(buf)
    comms = {"course all_to_all": lambda: collectives.all_to_all(list(out.chunk(world_size)), list(buf.chunk(world_size))),
             "dist.all_to_all_single": lambda: dist.all_to_all_single(out, buf)}

    def step(m):
        m(x).pow(2).sum().backward()
        m.zero_grad(set_to_none=True)

    times = {k: [] for k in list(runners) + list(comms)}
    for _ in range(rounds):
        for k, m in runners.items():
            step(m)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(m)
            times[k].append((time.perf_counter() - t0) / steps)
        for k, f in comms.items():
            f()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                f()
            times[k].append((time.perf_counter() - t0) / steps)
    res = {k: statistics.median(v) for k, v in times.items()}
    res["capacity"] = C
    from course_lib.mesh import CommMeter
    for k in ("ours (course all-to-all)", "dropless (dist.all_to_all_single)"):
        m = runners[k]
        m.builtin = False                       # the course's pairwise exchange: the bytes on the wire
        with CommMeter({}) as meter:
            step(m)
        res["bytes " + k] = meter.sent["world"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from course_lib.launch import run

    out = run(bench, args.world_size, args.hidden, args.tokens, args.experts, args.top_k, args.steps,
              args.rounds, timeout=600)
    t = {k: max(o[k] for o in out) for k in out[0] if k != "capacity" and not k.startswith("bytes")}
    C = out[0]["capacity"]
    print(f"MoE h={args.hidden}, {args.experts} experts top-{args.top_k}, capacity factor 1.25 ({C} slots per expert), "
          f"{args.tokens} tokens per rank, {args.world_size} ranks (gloo), forward + backward")
    dense = t["dense FFN, same active FLOPs"]
    for k in ("ours (course all-to-all)", "ours (dist.all_to_all_single)"):
        print(f"  {k:30s} / dense FFN: {t[k] / dense:5.2f}  ({t[k] * 1e3:.2f} ms vs {dense * 1e3:.2f} ms)")
    a, b = t["course all_to_all"], t["dist.all_to_all_single"]
    print(f"  all-to-all of {args.experts * C} x {args.hidden} floats per rank: course / dist.all_to_all_single = "
          f"{a / b:.2f}  ({a * 1e3:.2f} ms vs {b * 1e3:.2f} ms)")
    fixed, dl, loop = t["ours (dist.all_to_all_single)"], t["dropless (dist.all_to_all_single)"], t["dropless, loop of matmuls"]
    bf = sum(o["bytes ours (course all-to-all)"] for o in out) / len(out)
    bd = sum(o["bytes dropless (dist.all_to_all_single)"] for o in out) / len(out)
    print(f"  dropless / fixed capacity (both dist.all_to_all_single): time {dl / fixed:5.2f}  ({dl * 1e3:.2f} ms vs "
          f"{fixed * 1e3:.2f} ms); bytes sent per rank and step {bd / bf:.2f}  ({bd:,.0f} vs {bf:,.0f})")
    print(f"  dropless, grouped matmul / loop of matmuls: {dl / loop:5.2f}  (grouped matmul used: "
          f"{__import__('course_lib.moe', fromlist=['x']).grouped_mm_available()})")


if __name__ == "__main__":
    main()
