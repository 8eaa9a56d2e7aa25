"""Benchmark: long-context attention (course_lib.context_parallel) vs one process and torch, one run.

Prints:

* one process, forward + backward of one ``(b, a, s, d)`` attention: our ``blockwise_attention`` /
  ``F.scaled_dot_product_attention`` (median time ratio), and the bytes autograd saves for the
  backward with the explicit softmax (``naive_attention``), ours and SDPA, at ``s`` and ``2s``;
* on ``N`` gloo ranks, forward + backward of each rank's share (a step ends with its slowest rank):
  ring attention (contiguous and zig-zag layouts) and DeepSpeed-Ulysses, each / one process's SDPA on
  the full sequence (timed on rank 0 while the others wait), non-causal and causal, and non-causal
  also / ``torch.distributed.tensor.experimental.context_parallel`` (SDPA held to its math backend:
  the only way it runs forward and backward on gloo/CPU, see the module docstring);
* causal load balance: per rank, the (query, key) pairs the ring computed (its trace spans) and its
  compute seconds, slowest / fastest rank, contiguous vs zig-zag;
* bytes each rank sent (the module's trace records) / the formulas.

Timed in interleaved rounds on the same ranks, so background load hits every variant alike. The ranks
share 2 CPU cores here, so the ratios say where the overheads are, not what a GPU cluster would see.
Printed, never asserted.

    python benchmarks/bench_context_parallel.py [--world-size 4] [--seq 1024] [--heads 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _median_max(samples):
    """Median over rounds of the slowest rank's time."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def bench(rank, world_size, b, a, s, d, rounds):
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_lib import context_parallel as C
    from course_lib import trace

    warnings.filterwarnings("ignore")
    # DTensor's "CPU process group does not support alltoall yet" note (it all-gathers instead)
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    N = world_size
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, a, s, d, generator=gen) for _ in range(3)]
    grad = torch.randn(b, a, s, d, generator=gen)
    mesh = init_device_mesh("cpu", (N,))
    out = {}

    def share(layout):
        return ([C.shard_sequence(t, N, rank, layout=layout).requires_grad_(True) for t in full],
                C.shard_sequence(grad, N, rank, layout=layout))

    def step_of(fn, layout):
        qkv, g = share(layout)

        def step():
            fn(*qkv).backward(g)
        return step

    def torch_cp_step():
        qs, ks, vs = (t.clone() for t in full)
        with sdpa_kernel(SDPBackend.MATH), context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2] * 3,
                                                            no_restore_buffers={qs, ks, vs}):
            for t in (qs, ks, vs):
                t.requires_grad_(True)
            o = F.scaled_dot_product_attention(qs, ks, vs)
            # the local output is the sequence share, a heads share or a partial sum, by DTensor's
            # cost model (module docstring): a gradient of its shape times the same backward
            o.backward(torch.ones_like(o))

    def one_process(causal):
        """SDPA on the full sequence, on rank 0 alone (the others wait at the barrier)."""
        q, k, v = (t.clone().requires_grad_(True) for t in full)

        def step():
            if rank == 0:
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
        return step

    for causal in (False, True):
        steps = {
            "ring, contiguous": step_of(lambda q, k, v: C.ring_attention(q, k, v, causal=causal), "contiguous"),
            "ring, zig-zag": step_of(lambda q, k, v: C.ring_attention(q, k, v, causal=causal, layout="zigzag"),
                                     "zigzag"),
            "Ulysses": step_of(lambda q, k, v: C.ulysses_attention(q, k, v, causal=causal), "contiguous"),
            "one-process SDPA": one_process(causal),
        }
        if not causal:
            steps["torch context_parallel"] = torch_cp_step
        times = {k: [] for k in steps}
        for _ in range(rounds + 1):                          # the first round warms up
            for name, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
        out[causal] = {k: _median_max(v[1:]) for k, v in times.items()}

    balance = {}
    for layout in ("contiguous", "zigzag"):
        qkv, g = share(layout)
        with trace.Recorder() as rec:
            C.ring_attention(*qkv, causal=True, layout=layout).backward(g)
        fwd = [e for e in rec.events if e["kind"] == "compute" and "backward" not in e["name"]]
        balance[layout] = (sum(e["pairs"] for e in fwd),
                           sum(e["end"] - e["start"] for e in rec.events if e["kind"] == "compute"),
                           rec.totals()["bytes_sent"])
    with trace.Recorder() as rec:
        qkv, g = share("contiguous")
        C.ulysses_attention(*qkv).backward(g)
    balance["ulysses_bytes"] = rec.totals()["bytes_sent"]
    return out, balance


def one_process(b, a, s, d, rounds):
    import torch
    import torch.nn.functional as F

    from course_lib import context_parallel as C

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, a, s, d, generator=gen).requires_grad_(True) for _ in range(3))
    g = torch.randn(b, a, s, d, generator=gen)
    fns = {"blockwise": lambda: C.blockwise_attention(q, k, v, causal=True).backward(g),
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)}
    times = {k: [] for k in fns}
    for _ in range(rounds + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    saved = {}
    for length in (s, 2 * s):
        q2, k2, v2 = (torch.randn(1, a, length, d).requires_grad_(True) for _ in range(3))
        saved[length] = [C.attention_saved_bytes(fn, q2, k2, v2) for fn in
                         (C.naive_attention, C.blockwise_attention, F.scaled_dot_product_attention)]
    return med, saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    b, a, s, d, N = args.batch, args.heads, args.seq, args.head_dim, args.world_size

    from course_lib import context_parallel as C
    from course_lib.launch import run

    med, saved = one_process(b, a, s, d, args.rounds)
    print(f"one process, causal, b={b} a={a} s={s} d={d}, forward + backward:")
    print(f"  blockwise_attention / SDPA: {med['blockwise'] / med['sdpa']:.2f}  "
          f"({med['blockwise'] * 1e3:.1f} ms vs {med['sdpa'] * 1e3:.1f} ms)")
    for length, (naive, ours, sdpa) in saved.items():
        print(f"  saved for the backward, one sequence of s={length}: naive {naive / 2**20:.1f} MiB, "
              f"blockwise {ours / 2**20:.2f} MiB, SDPA {sdpa / 2**20:.2f} MiB")

    res = run(bench, N, b, a, s, d, args.rounds, timeout=1200)
    out, _ = res[0]
    print(f"\n{N} ranks (gloo), s/N={s // N} tokens per rank, forward + backward, slowest rank, "
          f"/ one-process SDPA on all s={s}:")
    for causal in (False, True):
        t = out[causal]
        ref = t["one-process SDPA"]
        print(f"  {'causal' if causal else 'non-causal'} (one process: {ref * 1e3:.1f} ms)")
        for name, v in t.items():
            if name != "one-process SDPA":
                print(f"    {name:24s} {v / ref:6.2f}  ({v * 1e3:.1f} ms)")
        if not causal:
            cp = t["torch context_parallel"]
            print(f"    ring zig-zag / torch context_parallel: {t['ring, zig-zag'] / cp:.2f}")

    print("\ncausal load balance (ring): pairs and compute seconds per rank, slowest / fastest")
    for layout in ("contiguous", "zigzag"):
        pairs = [r[1][layout][0] for r in res]
        secs = [r[1][layout][1] for r in res]
        print(f"  {layout:10s} pairs {pairs} (max/min {max(pairs) / min(pairs):.2f}; formula "
              f"{C.ring_work(s, N, causal=True, layout=layout)}), compute s max/min {max(secs) / min(secs):.2f}")
    ring = C.ring_attention_bytes(b, a, s, d, N)
    uly = C.ulysses_bytes(b, a, s, d, N)
    sent_ring = [r[1]["contiguous"][2] for r in res]
    sent_uly = [r[1]["ulysses_bytes"] for r in res]
    print(f"\nbytes sent per rank, forward + backward: ring {sent_ring[0] / 2**20:.2f} MiB "
          f"(measured / formula: {', '.join(f'{x / sum(ring.values()):.3f}' for x in sent_ring)}), "
          f"Ulysses {sent_uly[0] / 2**20:.2f} MiB "
          f"(measured / formula: {', '.join(f'{x / sum(uly.values()):.3f}' for x in sent_uly)})")


if __name__ == "__main__":
    main()
