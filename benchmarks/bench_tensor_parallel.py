"""Benchmark: our tensor-parallel MLP (course_lib.tensor_parallel) vs DTensor's ``parallelize_module``.

Same weights, same input, same ranks, same run: Megatron's MLP (``fc`` column parallel, GELU,
``fc_proj`` row parallel), forward + backward, with and without sequence parallelism. Prints our
median step time / DTensor's (ColwiseParallel + RowwiseParallel, or SequenceParallel input/output
layouts) -- target <= 1.1 -- for ours on the course ring and with ``builtin=True`` (torch.distributed
collectives, the fair comparison: DTensor uses them too). The attention block is not compared:
DTensor's ColwiseParallel on a fused QKV weight splits it by rows, not by heads.

Timed in interleaved rounds, so background load hits both alike. Printed, never asserted.

    python benchmarks/bench_tensor_parallel.py [--world-size 4] [--hidden 256] [--tokens 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rank, world_size, hidden, tokens, steps, rounds):
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, parallelize_module)

    from course_lib import tensor_parallel as T

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.fc_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return self.fc_proj(F.gelu(self.fc(x)))

    torch.manual_seed(0)
    ref = MLP()
    mesh = init_device_mesh("cpu", (world_size,))
    seq = tokens // 2
    x_full = torch.randn(2, seq, hidden)
    lo, hi = T.even_shard(seq, rank, world_size, "sequence")
    runners = {}
    for sp in (False, True):
        plan = ({"fc": ColwiseParallel(input_layouts=Shard(1)), "fc_proj": RowwiseParallel(output_layouts=Shard(1))}
                if sp else {"fc": ColwiseParallel(), "fc_proj": RowwiseParallel()})
        x = x_full[:, lo:hi].contiguous() if sp else x_full
        tag = "TP+SP" if sp else "TP"
        runners[(tag, "dtensor")] = (parallelize_module(copy.deepcopy(ref), mesh, plan), x)
        runners[(tag, "ours (ring)")] = (T.ParallelMLP.from_linears(ref.fc, ref.fc_proj, sequence_parallel=sp), x)
        runners[(tag, "ours (builtin)")] = (T.ParallelMLP.from_linears(ref.fc, ref.fc_proj, sequence_parallel=sp,
                                                                      builtin=True), x)

    def step(key):
        m, x = runners[key]
        m(x).pow(2).sum().backward()
        m.zero_grad(set_to_none=True)

    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k in runners:
            step(k)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            times[k].append((time.perf_counter() - t0) / steps)
    return {f"{a}|{b}": statistics.median(v) for (a, b), v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512, help="batch 2 x sequence tokens/2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import warnings
    warnings.filterwarnings("ignore")
    from course_lib.launch import run

    out = run(bench, args.world_size, args.hidden, args.tokens, args.steps, args.rounds, timeout=600)
    t = {k: max(o[k] for o in out) for k in out[0]}  # a step ends with its slowest rank
    print(f"Megatron MLP h={args.hidden} (4h={4 * args.hidden}), {args.tokens} tokens, {args.world_size} ranks (gloo), "
          "forward + backward")
    for tag in ("TP", "TP+SP"):
        d = t[f"{tag}|dtensor"]
        for ours in ("ours (ring)", "ours (builtin)"):
            o = t[f"{tag}|{ours}"]
            print(f"  {tag:5s} {ours:15s} / DTensor: {o / d:.2f}  ({o * 1e3:.2f} ms vs {d * 1e3:.2f} ms; target <= 1.1)")


if __name__ == "__main__":
    main()
