"""Benchmark: the decomposed (overlapped) layers of course_lib.overlap against the plain ones.

On ``--world-size`` ranks, in interleaved rounds, the slowest rank counting, median of the rounds:

1. **Loopback, real compute** (what the decomposition costs where there is nothing to hide: 4 ranks on
   few cores, gloo over loopback): ``all_gather_matmul`` / ``all_gather_single`` (torch's) + one matmul,
   and ``matmul_reduce_scatter`` / one matmul + ``reduce_scatter_single`` (torch's), ``n x h`` tokens x
   features, ``f`` columns per rank.
2. **Emulated link and compute** (``netem.AsyncPacedTransport``, ``overlap.PacedMatmul``: what overlap
   buys when a link is the bottleneck): the collective matmul / the plain layer (the course's ring
   all-gather through the same link, then one matmul) for hops of 0.5, 1 and 2 times a chunk's compute,
   next to the formula's ratio ``(C + (t-1) m) / (C/t + (t-1) max(C/t, m))``; and the toy expert-parallel
   layer, two micro-batches overlapped / sequential.
3. **The hybrid GPT's gradient all-reduce** (``HybridGPT(overlap_dp=True)``, notebook 16 section 5):
   4 blocks of width 64, dp = 4, one micro-batch of 4 sequences per rank, the GPU emulated by a
   ``SleepLayer`` after every block (3 ms per sequence forward, 6 ms backward); the network emulated
   by ``netem.NamespaceNetwork`` at 25 MB/s where the machine allows (root, ``ip``, ``tc``), loopback
   otherwise (said in the output): blocking / overlapped step.

Printed, never asserted (CONTRIBUTING.md, "Benchmarks").

    python benchmarks/bench_overlap.py [--world-size 4] [--tokens 2048] [--hidden 512] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time


def interleaved_rounds(fns: dict, rounds: int) -> dict:
    """Seconds of each ``fns`` entry per round, all ranks starting each call together (a barrier), in
    ``rounds + 1`` interleaved rounds of which the first (warm-up) is dropped."""
    import torch.distributed as dist
    times = {k: [] for k in fns}
    for _ in range(rounds + 1):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: v[1:] for k, v in times.items()}


def loopback(rank, world_size, tokens, hidden, rounds):
    import torch
    from course_lib import overlap as O

    torch.manual_seed(0)
    rows, f = tokens // world_size, hidden // world_size
    x, w = torch.randn(rows, hidden), torch.randn(hidden, f)              # all-gather + matmul
    x2, w2 = torch.randn(tokens, f), torch.randn(f, hidden)               # matmul + reduce-scatter
    fns = {"all_gather_matmul": lambda: O.all_gather_matmul(x, w),
           "all_gather_single + matmul": lambda: O.all_gather_then_matmul(x, w),
           "matmul_reduce_scatter": lambda: O.matmul_reduce_scatter(x2, w2),
           "matmul + reduce_scatter_single": lambda: O.matmul_then_reduce_scatter(x2, w2)}
    return interleaved_rounds(fns, rounds)


def emulated(rank, world_size, hop_ratio, chunk_s, rounds):
    import torch
    from course_lib import overlap as O
    from course_lib.netem import AsyncPacedTransport, Link

    rows, h, f = 64, 256, 64
    x, w = torch.randn(rows, h), torch.randn(h, f)
    mm = O.PacedMatmul(chunk_s / rows, per_row=True)
    link = Link(bandwidth=rows * h * 4 / (hop_ratio * chunk_s))
    xs = [torch.randn(64, 256) for _ in range(2)]
    w_pre, w_exp = torch.randn(256, 256), torch.randn(256, 256)
    a2a = Link(bandwidth=(world_size - 1) * (64 // world_size) * 256 * 4 / chunk_s)   # one all-to-all ~ chunk_s
    fns = {"collective matmul": lambda: O.all_gather_matmul(x, w, transport=AsyncPacedTransport(link), mm=mm),
           "plain layer": lambda: O.all_gather_then_matmul(x, w, transport=AsyncPacedTransport(link), mm=mm),
           "MoE overlapped": lambda: O.expert_parallel_microbatches(
               xs, w_pre, w_exp, overlap=True, transport=AsyncPacedTransport(a2a), mm=O.PacedMatmul(chunk_s)),
           "MoE sequential": lambda: O.expert_parallel_microbatches(
               xs, w_pre, w_exp, overlap=False, transport=AsyncPacedTransport(a2a), mm=O.PacedMatmul(chunk_s))}
    if hop_ratio != 1.0:                           # the MoE layer does not depend on the hop: time it once
        del fns["MoE overlapped"], fns["MoE sequential"]
    return interleaved_rounds(fns, rounds)


def hybrid_steps(rank, world_size, rounds, t_seq=0.003):
    import torch.nn as nn
    from course_lib import hybrid_gpt
    from course_lib.mesh import init_process_mesh
    from course_lib.models import SleepLayer

    b = 16 // world_size

    class EmulatedGPU(hybrid_gpt.HybridGPT):          # emulation outside HybridGPT: a sleep per block
        def _shard_block(self, block, tp_group):
            return nn.Sequential(super()._shard_block(block, tp_group), SleepLayer(t_seq * b))

    mesh = init_process_mesh((world_size, 1, 1))
    models = {k: EmulatedGPU(hybrid_gpt.make_model(heads=4, layers=4, hidden=64), mesh, builtin=True,
                             overlap_dp=k == "overlapped") for k in ("blocking", "overlapped")}
    (x, y), = hybrid_gpt.make_batches(1, 16)
    return interleaved_rounds({k: (lambda h=h: (h.zero_grad(), h.forward_backward(x, y, 1)))
                               for k, h in models.items()}, rounds)


def slowest_median(per_rank: list[dict], key: str) -> float:
    return statistics.median(max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key])))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    from course_lib.launch import Cluster

    t = args.world_size
    with Cluster(t) as cluster:
        res = cluster.run(loopback, args.tokens, args.hidden, args.rounds)
        print(f"1. loopback, real compute, {t} ranks, n = {args.tokens}, h = {args.hidden} "
              f"(median of {args.rounds} rounds, slowest rank):")
        for ours, plain in (("all_gather_matmul", "all_gather_single + matmul"),
                            ("matmul_reduce_scatter", "matmul + reduce_scatter_single")):
            a, b = slowest_median(res, ours), slowest_median(res, plain)
            print(f"   {ours} / {plain}: {a * 1e3:.1f} / {b * 1e3:.1f} ms = {a / b:.2f}")
        chunk = 0.020
        print(f"2. emulated link and compute ({chunk * 1e3:.0f} ms per chunk of n/t rows):")
        for ratio in (0.5, 1.0, 2.0):
            res = cluster.run(emulated, ratio, chunk, max(3, args.rounds // 2))
            if ratio == 1.0:
                moe = res
            a, b = slowest_median(res, "collective matmul"), slowest_median(res, "plain layer")
            C, m = t * chunk, ratio * chunk
            bound = (C + (t - 1) * m) / (C / t + (t - 1) * max(C / t, m))
            print(f"   hop = {ratio:.1f} x chunk: plain / collective matmul = {b * 1e3:.0f} / {a * 1e3:.0f} ms "
                  f"= {b / a:.2f} (formula {bound:.2f})")
        a, b = slowest_median(moe, "MoE overlapped"), slowest_median(moe, "MoE sequential")
        print(f"   MoE, 2 micro-batches: sequential / overlapped = {b * 1e3:.0f} / {a * 1e3:.0f} ms = {b / a:.2f}")
    from course_lib import netem
    why_not = netem.namespaces_unavailable_reason()
    with Cluster(t, network=None if why_not else netem.Link(25e6), timeout=300) as cluster:
        res = cluster.run(hybrid_steps, args.rounds)
        a, b = slowest_median(res, "overlapped"), slowest_median(res, "blocking")
        net = "25 MB/s links (network namespaces)" if why_not is None else f"loopback ({why_not})"
        print(f"3. hybrid GPT, dp = {t}, gradient all-reduce over {net}:")
        print(f"   blocking / overlapped step = {b * 1e3:.0f} / {a * 1e3:.0f} ms = {b / a:.2f}")


if __name__ == "__main__":
    main()
