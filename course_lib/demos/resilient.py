"""Training that survives SIGKILL: checkpoint, die, restart, resume bitwise identically. Two ways to run it.

On the virtual cluster (notebook 12), the restarts done by :func:`course_lib.fault.run_with_restarts`::

    from course_lib.launch import Cluster
    from course_lib.fault import FaultPlan, run_with_restarts
    from course_lib.demos.resilient import train
    with Cluster(2) as cluster:
        rec = run_with_restarts(cluster, train, "/tmp/ckpt", steps=40, every=5,
                                plan=FaultPlan([(1, 12), (0, 23)]), max_restarts=3)

Under torchrun, whose elastic agent restarts all workers when one dies (``--max-restarts``)::

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m course_lib.demos.resilient \\
        --dir /tmp/ckpt --steps 40 --every 5 --fail-at 1:12,0:23

``--fail-at R:S,...`` makes rank R kill itself (SIGKILL) before step S, one entry per attempt (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is the attempt). Every rank prints one line when it finishes: the step it
resumed from and the SHA-256 of its final parameters, equal to those of a run without failures.

The backend is chosen as :func:`course_lib.launch.init_from_env` does (NCCL with a GPU per local rank,
else gloo; ``--backend gloo`` forces CPU processes) and the model, its data and its gradient scaler
live on the rank's device (:func:`course_lib.launch.device`); the checkpoints hold the CUDA generators'
states too (:func:`course_lib.checkpoint.rng_state`). Run on CPU processes with gloo; written for NCCL, not
yet run on GPUs.

Two traps of restarting gloo workers under torchrun, handled by :func:`course_lib.launch.init_from_env`:
the rendezvous store keeps the dead attempt's addresses under the same keys (a restarted worker that
reads one fails with "Gloo connectFullMesh failed ... Connection refused"), so every attempt gets its
own key prefix; and the default 30-minute process-group timeout turns any failed rendezvous into a long
wait, so the demo sets ``--pg-timeout`` (30 s).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from course_lib.checkpoint import (CheckpointManager, ResumableSampler, agreed_latest, restore_training_state,
                                   rng_state, save_collective, training_state)
from course_lib.fault import FaultPlan
from course_lib.launch import device as launch_device
from course_lib.models import TinyMLP, make_regression

PARTS = ("optimizer", "scheduler", "scaler", "sampler", "rng")


def build(rank: int, world_size: int, seed: int = 0, hidden: int = 32, n: int = 256, batch: int = 32,
          device: torch.device | str = "cpu"):
    """The training set-up every attempt starts from: the same initial model on every rank (drawn on
    the CPU, then moved to ``device``), then a per-rank RNG (each rank's dropout differs). Returns a dict
    of the live objects."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = TinyMLP(16, hidden, 1, 3, dropout=0.1).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=4)
    X, y = make_regression(n, 16, 1, seed=seed, device=device)
    sampler = ResumableSampler(n, batch, seed=seed, rank=rank, num_replicas=world_size)
    torch.manual_seed(seed * 1000 + rank + 1)
    np.random.seed(seed * 1000 + rank + 1)
    random.seed(seed * 1000 + rank + 1)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "sampler": sampler,
            "X": X, "y": y}


def _step(s: dict, world_size: int) -> float:
    idx = s["sampler"].next_batch()
    xb = s["X"][idx] * random.uniform(0.9, 1.1)                                 # Python's RNG
    noise = torch.from_numpy(np.random.standard_normal(tuple(xb.shape))).float()   # numpy's RNG, on the CPU
    xb = xb + 0.01 * noise.to(xb.device)
    loss = torch.nn.functional.mse_loss(s["model"](xb), s["y"][idx])           # dropout: torch's RNG
    s["optimizer"].zero_grad(set_to_none=True)
    s["scaler"].scale(loss).backward()
    if world_size > 1:
        for p in s["model"].parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    s["scaler"].step(s["optimizer"])
    s["scaler"].update()
    s["scheduler"].step()
    return loss.item()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def params_sha256(model: torch.nn.Module) -> str:
    return hashlib.sha256(flat_params(model).cpu().numpy().tobytes()).hexdigest()


def train(rank: int, world_size: int, attempt: int, directory: str, *, steps: int = 40, every: int = 5,
          plan: FaultPlan | None = None, seed: int = 0, hidden: int = 32, keep_last: int = 3,
          omit: tuple = (), step_seconds: float = 0.0, progress_file: str | None = None,
          device: torch.device | str | None = None) -> dict:
    """Data-parallel training of a tiny MLP with dropout, AdamW, a cosine schedule, a gradient scaler
    and a shuffled sampler, checkpointed every ``every`` steps into ``directory`` and resumed from the
    newest intact checkpoint there (so a restarted attempt continues where the last one saved).

    ``plan`` kills ranks (:class:`~course_lib.fault.FaultPlan`); ``omit`` names parts of the state *not*
    restored (any of ``PARTS``), to see what each one is for; ``step_seconds`` pads each step with a
    sleep (emulated compute, for timing experiments); ``progress_file``: rank 0 appends a line
    ``attempt steps_done unix_time`` after every step (it outlives a killed attempt, for timelines).
    ``device``: where the model and data live (``None``: :func:`course_lib.launch.device`, the rank's
    GPU under NCCL, else the CPU). Returns this rank's ``params`` (flat), ``sha256``,
    ``resumed_from``, ``losses`` and ``log`` of ``(attempt, steps done, time.time())``.
    """
    unknown = set(omit) - set(PARTS)
    if unknown:
        raise ValueError(f"omit: unknown parts {sorted(unknown)}; choose from {PARTS}")
    if not (isinstance(every, int) and every >= 1 and isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps and every must be positive ints, got steps={steps!r}, every={every!r}")
    group = None if world_size == 1 or not dist.is_initialized() else dist.group.WORLD
    s = build(rank, world_size, seed, hidden, device=launch_device() if device is None else device)
    manager = CheckpointManager(directory, keep_last=keep_last)
    latest = agreed_latest(manager) if group is not None else manager.latest()
    start = 0
    if latest is not None:
        state = manager.load(latest, "state.pt")
        if rank != 0:
            state["rng"] = manager.load(latest, f"rank_{rank}.pt")["rng"]
        fresh = training_state(s["model"], s["optimizer"], step=0, scheduler=s["scheduler"],
                               scaler=s["scaler"], sampler=s["sampler"])
        for part in omit:           # "not restored" = keep what a fresh start has
            state[part] = fresh[part]
        start = restore_training_state(state, s["model"], s["optimizer"], scheduler=s["scheduler"],
                                       scaler=s["scaler"], sampler=s["sampler"])
    log, losses, save_seconds = [], [], []
    note = open(progress_file, "a", buffering=1) if progress_file and rank == 0 else None

    def record(done):
        log.append((attempt, done, time.time()))
        if note is not None:
            note.write(f"{attempt} {done} {log[-1][2]:.6f}\n")
    record(start)
    for i in range(start, steps):
        if plan is not None:
            plan.maybe_fail(attempt, rank, i)
        losses.append(_step(s, world_size))
        if step_seconds:
            time.sleep(step_seconds)
        done = i + 1
        if done % every == 0 or done == steps:
            t0 = time.perf_counter()
            if rank == 0:
                files = {"state.pt": training_state(s["model"], s["optimizer"], step=done,
                                                    scheduler=s["scheduler"], scaler=s["scaler"],
                                                    sampler=s["sampler"])}
            else:
                files = {f"rank_{rank}.pt": {"rng": rng_state()}}
            if group is not None:
                save_collective(manager, done, files)
            else:
                manager.save(done, files["state.pt"])
            save_seconds.append(time.perf_counter() - t0)
        record(done)
    if note is not None:
        note.close()
    return {"params": flat_params(s["model"]), "sha256": params_sha256(s["model"]), "resumed_from": start,
            "losses": losses, "log": log, "save_seconds": save_seconds}


def parse_fail_at(text: str) -> FaultPlan:
    """``"1:12,0:23"`` -> ``FaultPlan([(1, 12), (0, 23)])`` (rank:step per attempt)."""
    failures = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            r, st = item.split(":")
            failures.append((int(r), int(st)))
        except ValueError:
            raise SystemExit(f"--fail-at: {item!r} is not RANK:STEP (e.g. --fail-at 1:12,0:23)") from None
    return FaultPlan(failures)


def main(argv: list[str] | None = None) -> None:
    from datetime import timedelta

    from course_lib.demos import finish
    from course_lib.launch import init_from_env

    p = argparse.ArgumentParser(prog="torchrun ... -m course_lib.demos.resilient", description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (shared by all ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    p.add_argument("--fail-at", default="", metavar="R:S,...", help="rank R dies before step S, per attempt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=30.0, help="process-group timeout in s (default 30)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="force a backend (default: NCCL with one GPU per local rank, else gloo)")
    args = p.parse_args(argv)
    plan = parse_fail_at(args.fail_at)
    if args.steps < 1 or args.every < 1:
        raise SystemExit(f"--steps and --every must be positive, got {args.steps} and {args.every}")
    rank, world_size = init_from_env(backend=args.backend, timeout=timedelta(seconds=args.pg_timeout))
    bad = [r for r, _ in plan.failures if not 0 <= r < world_size]
    if bad:
        raise SystemExit(f"--fail-at names rank(s) {bad}, not ranks of this job (0..{world_size - 1})")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = train(rank, world_size, attempt, args.dir, steps=args.steps, every=args.every, plan=plan,
                seed=args.seed, device=launch_device())
    finish(f"[rank {rank}/{world_size}] attempt {attempt}: resumed from step {out['resumed_from']}, "
           f"trained to step {args.steps}, params sha256 {out['sha256'][:16]}", True)


if __name__ == "__main__":
    main()
