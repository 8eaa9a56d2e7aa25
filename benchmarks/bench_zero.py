"""Benchmark: our ZeRO-3 (course_lib.zero) vs FSDP2 ``fully_shard``, same model, same ranks, same run.

Prints, per rank count:

* our stage-3 step / FSDP2 step (reshard_after_forward=True), median step time -- target <= 1.2;
  ours with the course ring and with ``builtin=True`` (the torch.distributed collectives);
* per-rank model-state bytes measured from the tensors / ``estimate.zero_model_state_bytes``,
  for stages 0-3 -- target within 5%.

Both are timed in interleaved rounds on the same ranks, so background load hits both alike.
Numbers are printed, never asserted (timings are noisy).

    python benchmarks/bench_zero.py [--world-size 4] [--hidden 256] [--layers 6] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rank, world_size, hidden, layers, batch, steps, rounds):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_lib.estimate import zero_model_state_bytes
    from course_lib.models import TinyMLP
    from course_lib.zero import ZeRO, default_units

    def model():
        torch.manual_seed(0)
        return TinyMLP(hidden, hidden, hidden, layers)

    psi = sum(p.numel() for p in model().parameters())
    x = torch.randn(batch, hidden)
    y = torch.randn(batch, hidden)

    ratios = {}
    for stage in range(4):
        z = ZeRO(model(), stage, builtin=True)
        for _ in range(2):  # Adam allocates its states at the first step: measure in the second
            F.mse_loss(z(x), y).backward()
            z.reduce_gradients()
            held = z.state_bytes()
            z.step()
            z.zero_grad()
        z.close()
        want = zero_model_state_bytes(psi, stage, world_size, precision="fp32")
        ratios[stage] = sum(held.values()) / sum(want.values())

    fsdp = model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in default_units(fsdp):
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    runners = {"ours (ring)": ZeRO(model(), 3), "ours (builtin)": ZeRO(model(), 3, builtin=True),
               "fsdp2": fsdp}
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)

    def step(name):
        m = runners[name]
        F.mse_loss(m(x), y).backward()
        if name == "fsdp2":
            opt.step()
            opt.zero_grad()
        else:
            m.step()
            m.zero_grad()

    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k in runners:
            step(k)  # warm-up of this round
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            times[k].append((time.perf_counter() - t0) / steps)
    for k in ("ours (ring)", "ours (builtin)"):
        runners[k].close()
    return {"psi": psi, "memory_ratio": ratios,
            "step_s": {k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from course_lib.launch import run

    out = run(bench, args.world_size, args.hidden, args.layers, args.batch, args.steps,
              args.rounds, timeout=600)
    r0 = out[0]
    print(f"TinyMLP({args.hidden}, {args.hidden}, {args.hidden}, {args.layers}): "
          f"Psi = {r0['psi']:,} parameters, {args.world_size} ranks (gloo)")
    print("per-rank model-state bytes measured / formula (fp32 Adam), target within 5%:")
    for stage in range(4):
        worst = max(abs(o["memory_ratio"][stage] - 1) for o in out)
        print(f"  stage {stage}: rank 0 {r0['memory_ratio'][stage]:.4f}, worst |ratio-1| {worst:.4f}")
    t = {k: max(o["step_s"][k] for o in out) for k in r0["step_s"]}  # a step ends with its slowest rank
    for k in ("ours (ring)", "ours (builtin)"):
        print(f"step time {k} / FSDP2 fully_shard: {t[k] / t['fsdp2']:.2f}  "
              f"({t[k] * 1e3:.1f} ms vs {t['fsdp2'] * 1e3:.1f} ms; target <= 1.2)")


if __name__ == "__main__":
    main()
