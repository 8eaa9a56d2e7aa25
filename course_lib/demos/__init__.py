"""Entry points for `torchrun` and `python -m` demos (see INSTRUCTORS.md, "GPUs: the same code with `torchrun`")."""

from __future__ import annotations

import sys


def finish(text: str | None, ok: bool) -> None:
    """End a torchrun demo: write ``text`` (if any) in one call, leave the process group, exit 1 unless ``ok``.

    One write of the whole text: the ranks share torchrun's stdout, and print() may write the text and
    the newline separately (unbuffered output), letting another rank's line slip between."""
    import torch.distributed as dist

    if text:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
