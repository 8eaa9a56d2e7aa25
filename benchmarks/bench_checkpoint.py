"""Benchmark: our sharded checkpoint (course_lib.checkpoint) vs ``torch.distributed.checkpoint`` on the same states.

On ``--world-size`` ranks, the states of ``TinyMLP(64, hidden, 1, 4)`` with Adam (fp32 values and two
moments per parameter) are saved and loaded: ours as ZeRO-3 shards (``save_sharded`` / ``load_sharded``,
one file per rank, a manifest with SHA-256 checksums, fsync, atomic renames), DCP as FSDP2 shards
(``dcp.save``, ``dcp.async_save``, ``dcp.load``). Each time is from one barrier to the next, best of
``--repeats``. Printed, never asserted.

    python benchmarks/bench_checkpoint.py [--world-size 4] [--hidden 1448] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1448)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from course_lib.fault import time_checkpoints
    from course_lib.launch import run

    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as d:
        t = run(time_checkpoints, args.world_size, d, args.hidden, repeats=args.repeats, timeout=600)[0]
    print(f"checkpoint of {t['params']:,} parameters with Adam ({t['ours_bytes'] / 1e6:.1f} MB ours, "
          f"{t['dcp_bytes'] / 1e6:.1f} MB DCP) on {args.world_size} ranks, best of {args.repeats}")
    print(f"  save: ours / dcp.save = {t['ours_save'] / t['dcp_save']:.2f}  "
          f"({t['ours_save'] * 1e3:.0f} ms vs {t['dcp_save'] * 1e3:.0f} ms)")
    print(f"  save: ours / dcp.async_save until written = {t['ours_save'] / t['dcp_async_total']:.2f}  "
          f"(async_save blocks for {t['dcp_async_return'] * 1e3:.0f} ms, done after {t['dcp_async_total'] * 1e3:.0f} ms)")
    print(f"  load: ours / dcp.load = {t['ours_load'] / t['dcp_load']:.2f}  "
          f"({t['ours_load'] * 1e3:.0f} ms vs {t['dcp_load'] * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
