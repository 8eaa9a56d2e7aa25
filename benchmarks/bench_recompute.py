"""Our activation checkpointing vs torch.utils.checkpoint (use_reentrant=False), printed not asserted.

* time of a forward+backward step of a deep narrow MLP stack checkpointed in sqrt(L) segments, ours
  / torch (target <= 1.05) and the overhead vs no checkpointing;
* bytes saved for the backward (saved-tensor hooks), ours vs torch (target: equal);
* peak live bytes over the step vs the number of segments (course_lib.memory), the U-curve whose
  minimum sits near sqrt(L) (Chen et al. 2016, §4.1);
* FLOPs of the step (FlopCounterMode): full checkpointing adds one forward.

Run: ``python benchmarks/bench_recompute.py``. Timings on a loaded 2-core machine are noisy.
"""

import math
import time

import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

from course_lib import estimate as E
from course_lib import recompute as R
from course_lib.memory import track_memory


def stack(L, d):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.1)) for _ in range(L)])


def step_time(fn, repeats=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main():
    torch.manual_seed(0)
    L, d, batch = 32, 128, 512
    model = stack(L, d)
    x = torch.randn(batch, d, requires_grad=True)
    k = round(math.sqrt(L))
    runs = {
        "plain": lambda: model(x).sum().backward(),
        "ours": lambda: R.checkpoint_sequential(model, k, x).sum().backward(),
        "torch": lambda: tc.checkpoint_sequential(model, k, x, use_reentrant=False).sum().backward(),
    }
    t = {name: step_time(f) for name, f in runs.items()}
    params = list(model.parameters())
    b_ours = E.saved_activation_bytes(lambda: R.checkpoint_sequential(model, k, x), exclude=params)[1]
    b_torch = E.saved_activation_bytes(
        lambda: tc.checkpoint_sequential(model, k, x, use_reentrant=False), exclude=params)[1]
    b_plain = E.saved_activation_bytes(model, x, exclude=params)[1]
    print(f"L={L} layers, d={d}, batch={batch}, {k} segments (sqrt(L)); median of 20 steps")
    print(f"  step time  plain {t['plain'] * 1e3:7.2f} ms  ours {t['ours'] * 1e3:7.2f} ms  "
          f"torch {t['torch'] * 1e3:7.2f} ms")
    print(f"  ours / torch time  = {t['ours'] / t['torch']:.3f}   (target <= 1.05)")
    print(f"  checkpointed / plain time = {t['ours'] / t['plain']:.3f}")
    print(f"  saved for backward: ours {b_ours:,} B, torch {b_torch:,} B (equal: {b_ours == b_torch}), "
          f"plain {b_plain:,} B")

    _, fwd, _ = E.count_flops(model, x)
    _, plain, _ = E.count_flops(runs["plain"])
    _, full, _ = E.count_flops(lambda: R.checkpoint(model, x).sum().backward())
    _, seq, _ = E.count_flops(runs["ours"])
    print(f"  FLOPs: forward {fwd:,}; plain step {plain:,} (= {plain / fwd:.2f} forwards); "
          f"full checkpoint +{full / plain - 1:.1%}; {k} segments +{seq / plain - 1:.1%}")

    for L in (16, 64):
        model = stack(L, 64)
        x = torch.randn(1024, 64, requires_grad=True)
        row = []
        for s in sorted({1, 2, 4, 8, 16, 32, L} & set(range(1, L + 1))):
            model.zero_grad(set_to_none=True)
            with track_memory() as mem:
                R.checkpoint_sequential(model, s, x).sum().backward()
            row.append((s, mem.peak_bytes))
        best = min(row, key=lambda r: r[1])
        print(f"  L={L}: peak live bytes by segments " +
              ", ".join(f"{s}: {b / 2**20:.2f} MiB" for s, b in row) +
              f"  -> minimum at {best[0]} (sqrt(L) = {math.sqrt(L):.1f})")


if __name__ == "__main__":
    main()
