"""Fault-tolerant training from scratch: how often clusters fail, restarts that resume exactly, and how
often to save.

A job on thousands of GPUs fails every few hours (:func:`cluster_failures_per_day`), and one dead rank
stops all of them. What keeps the work is a *checkpoint*: everything the training loop's future depends
on, saved periodically, so that a restarted job continues as if nothing had happened. Saving and
loading checkpoints is :mod:`course_lib.checkpoint` (the training state, atomic verified files, sharded
checkpoints); this module is the rest of notebook 12:

* **How often clusters fail** (:func:`cluster_failures_per_day`, :func:`cluster_mtbf_hours`,
  :data:`LLAMA3_INTERRUPTIONS`): one job on ``n`` GPUs fails ``n`` times as often as one GPU.
* **Fault injection and recovery** (:class:`FaultPlan`, :func:`run_with_restarts`): a rank kills itself
  with SIGKILL at a chosen step; the virtual cluster reports the dead rank (:class:`~course_lib.launch.RankError`),
  fresh workers start and resume from the last intact checkpoint, as ``torchrun --max-restarts`` does.
* **How often to save** (:func:`young_daly_interval`, :func:`expected_goodput`, :func:`simulate_goodput`):
  saving costs ``delta`` seconds each time, a failure loses the work since the last save; the interval
  that maximises goodput is about ``sqrt(2 delta M)`` for a mean time between failures ``M`` (Young 1974;
  Daly 2006 adds higher-order terms).
* **What a save costs** (:func:`time_checkpoints`): the course's sharded checkpoint against
  ``torch.distributed.checkpoint``, timed on every rank.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

__all__ = [
    "FaultPlan", "kill_self", "run_with_restarts", "Recovery",
    "Failure", "cluster_failures_per_day", "cluster_mtbf_hours", "young_daly_interval", "daly_interval",
    "expected_goodput", "simulate_goodput", "time_checkpoints", "LLAMA3_INTERRUPTIONS",
]


# ============================================================================ how often clusters fail

LLAMA3_INTERRUPTIONS = {
    "gpus": 16384, "days": 54, "interruptions": 466, "unexpected": 419, "planned": 47,
    "gpu_related_share": 0.587,
    "source": "Llama Team, Meta (2024), 'The Llama 3 Herd of Models', arXiv:2407.21783, §3.3.4 and "
              "Table 5: 466 job interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs, "
              "419 unexpected; GPU issues (faulty GPUs, HBM3 memory) 58.7 % of the unexpected ones.",
}


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def cluster_failures_per_day(n_gpus: float, gpu_mtbf_hours: float) -> float:
    """Expected failures per day of a job on ``n_gpus`` GPUs when each fails independently at rate
    ``1 / gpu_mtbf_hours``: ``24 n / MTBF``. Any one failure stops a synchronous job."""
    return 24.0 * _positive("n_gpus", n_gpus) / _positive("gpu_mtbf_hours", gpu_mtbf_hours)


def cluster_mtbf_hours(n_gpus: float, gpu_mtbf_hours: float) -> float:
    """Mean time between failures of the whole job: ``MTBF_gpu / n`` (exponential lifetimes: the minimum
    of ``n`` independent exponentials is exponential with ``n`` times the rate)."""
    return _positive("gpu_mtbf_hours", gpu_mtbf_hours) / _positive("n_gpus", n_gpus)



# ============================================================================ failures and restarts

def kill_self(sig: int = signal.SIGKILL) -> None:
    """Kill this process at once (SIGKILL: no cleanup, no exception, as when a GPU or node dies)."""
    os.kill(os.getpid(), sig)


@dataclass
class FaultPlan:
    """When ranks die: ``failures[a] = (rank, step)`` kills ``rank`` just before it runs ``step`` in
    attempt ``a`` (attempt 0 is the first run, attempt 1 the first restart, ...). Steps must grow, so
    every planned failure is reached after resuming from a checkpoint taken before the previous one.

    With ``relative=True`` the second number counts steps *run in that attempt* instead: ``(rank, n)``
    kills ``rank`` before its ``n+1``-th step since the (re)start. That is a failure clock measured in
    work done, as for failures that arrive at random times (:meth:`exponential`).
    """

    failures: list[tuple[int, int]] = field(default_factory=list)
    relative: bool = False

    def __post_init__(self):
        self.failures = [(int(r), int(s)) for r, s in self.failures]
        steps = [s for _, s in self.failures]
        if self.relative:
            if any(s < 0 for s in steps):
                raise ValueError(f"FaultPlan: relative failure steps must be >= 0, got {steps}")
        elif any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"FaultPlan: failure steps must increase from one attempt to the next, "
                             f"got {steps}")
        self._ran = 0        # steps this process has run (each attempt is a fresh process)

    @classmethod
    def random(cls, n_failures: int, total_steps: int, world_size: int, seed: int = 0,
               first: int = 1) -> "FaultPlan":
        """``n_failures`` failures at distinct random steps in ``[first, total_steps)`` on random ranks."""
        if n_failures > total_steps - first:
            raise ValueError(f"cannot place {n_failures} failures in steps [{first}, {total_steps})")
        rng = random.Random(seed)
        steps = sorted(rng.sample(range(first, total_steps), n_failures))
        return cls([(rng.randrange(world_size), s) for s in steps])

    @classmethod
    def exponential(cls, mtbf_steps: float, n_failures: int, world_size: int, seed: int = 0) -> "FaultPlan":
        """Failures as a Poisson process in steps of work: attempt ``a`` dies after an exponential number
        of steps with mean ``mtbf_steps`` (rounded down), on a random rank. ``n_failures`` bounds the
        number of attempts that fail; give enough for the run's length."""
        m = _positive("mtbf_steps", mtbf_steps)
        rng = np.random.default_rng(seed)
        return cls([(int(rng.integers(world_size)), int(rng.exponential(m))) for _ in range(n_failures)],
                   relative=True)

    def maybe_fail(self, attempt: int, rank: int, step: int) -> None:
        """Call at the top of every step: kills this process if the plan says so."""
        ran, self._ran = self._ran, self._ran + 1
        if attempt < len(self.failures):
            r, s = self.failures[attempt]
            if r == rank and s == (ran if self.relative else step):
                kill_self()


@dataclass
class Failure:
    attempt: int
    ranks: list[int]          # ranks that died (exit by signal or code); the others were stopped
    reason: str               # first line of the launcher's report
    seconds: float            # wall time of the failed attempt


@dataclass
class Recovery:
    results: list             # the per-rank return values of the attempt that finished
    failures: list[Failure]
    attempts: int
    seconds: float            # wall time of all attempts
    starts: int = 0           # worker (re)starts of the cluster during the run


def run_with_restarts(cluster, fn: Callable[..., Any], *args, max_restarts: int = 3,
                      timeout: float | None = None, on_failure: Callable[[Failure], None] | None = None,
                      **kwargs) -> Recovery:
    """Run ``fn(rank, world_size, attempt, *args, **kwargs)`` on ``cluster``; when a rank dies or the
    call times out, start fresh workers and call again with ``attempt + 1`` (``fn`` resumes from its
    latest checkpoint), at most ``max_restarts`` times: ``torchrun --max-restarts`` for the virtual cluster.

    Returns a :class:`Recovery`; raises the last error when the restarts are used up.
    """
    from course_lib.launch import RankError

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    failures: list[Failure] = []
    t_start, starts0 = time.perf_counter(), cluster.starts
    for attempt in range(max_restarts + 1):
        t0 = time.perf_counter()
        try:
            results = cluster.run(fn, attempt, *args, timeout=timeout, **kwargs)
        except (RankError, TimeoutError) as exc:
            if isinstance(exc, RankError):
                dead = [r for r, text in exc.failures.items()
                        if text.startswith("the process died") or text.startswith("the process exited")]
                ranks = dead or exc.ranks
            else:
                ranks = []
            failure = Failure(attempt, ranks, str(exc).splitlines()[0], time.perf_counter() - t0)
            failures.append(failure)
            if on_failure is not None:
                on_failure(failure)
            if attempt == max_restarts:
                raise
            continue
        return Recovery(results, failures, attempt + 1, time.perf_counter() - t_start,
                        cluster.starts - starts0)
    raise AssertionError("unreachable")


# ============================================================================ how often to checkpoint

def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's (1974) first-order optimum checkpoint interval ``sqrt(2 delta M)`` (compute time between
    saves), for save cost ``delta`` and mean time between failures ``M``."""
    return math.sqrt(2.0 * _positive("save_seconds", save_seconds) * _positive("mtbf_seconds", mtbf_seconds))


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's (2006) higher-order optimum: ``sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + delta / 18M] - delta``
    for ``delta < 2M``, else ``M`` (Daly, 'A higher order estimate of the optimum checkpoint interval
    for restart dumps', FGCS 22(3), 2006, eq. 37)."""
    d, m = _positive("save_seconds", save_seconds), _positive("mtbf_seconds", mtbf_seconds)
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def expected_goodput(interval: float, save_seconds: float, mtbf_seconds: float,
                     restart_seconds: float = 0.0) -> float:
    """Useful fraction of wall time, exact for exponential failures (rate ``1/M``): a segment of
    ``tau`` seconds of work plus a ``delta`` save completes only without a failure; each failure costs
    the time spent plus a restart ``R``. Expected wall time per segment:
    ``(M + R) (exp((tau + delta) / M) - 1)``, so goodput ``= tau / ((M + R) (exp((tau + delta)/M) - 1))``
    (Daly 2006, eq. 13, with failures also possible during the save; no failures during the restart).
    To first order, 1 - goodput ~ delta/tau + tau/(2M) + R/M, minimised at ``sqrt(2 delta M)``."""
    tau = _positive("interval", interval)
    d = float(save_seconds)
    if d < 0:
        raise ValueError(f"save_seconds must be >= 0, got {save_seconds!r}")
    m = _positive("mtbf_seconds", mtbf_seconds)
    r = float(restart_seconds)
    if r < 0:
        raise ValueError(f"restart_seconds must be >= 0, got {restart_seconds!r}")
    return tau / ((m + r) * math.expm1((tau + d) / m))


def simulate_goodput(work_seconds: float, interval: float, save_seconds: float, mtbf_seconds: float,
                     restart_seconds: float = 0.0, runs: int = 200, seed: int = 0) -> tuple[float, float]:
    """Monte-Carlo check of :func:`expected_goodput`: ``runs`` jobs of ``work_seconds`` of work, saving
    every ``interval`` seconds of work, failing at exponential times (mean ``mtbf_seconds``), each failure
    rolling back to the last save and costing ``restart_seconds``. Returns (mean goodput, standard error)."""
    work, tau = _positive("work_seconds", work_seconds), _positive("interval", interval)
    m = _positive("mtbf_seconds", mtbf_seconds)
    rng = np.random.default_rng(seed)
    goodputs = []
    for _ in range(runs):
        done, wall = 0.0, 0.0
        next_fail = rng.exponential(m)
        while done < work - 1e-12:
            seg = min(tau, work - done)
            cost = seg + save_seconds           # every segment ends with a save, as in the formula
            if next_fail >= cost:
                wall += cost
                next_fail -= cost
                done += seg
            else:
                wall += next_fail + restart_seconds
                next_fail = rng.exponential(m)
        goodputs.append(work / wall)
    g = np.asarray(goodputs)
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(len(g)))


# ============================================================================ measuring checkpoint cost

def time_checkpoints(rank: int, world_size: int, directory: str, hidden: int = 256, layers: int = 4,
                     repeats: int = 1) -> dict:
    """Save and load the same model states two ways on every rank of the default group, and time them
    (seconds from one barrier to the next, best of ``repeats``): ours, ZeRO-3 shards with
    :func:`course_lib.checkpoint.save_sharded` / :func:`~course_lib.checkpoint.load_sharded`; and
    ``torch.distributed.checkpoint`` with FSDP2 (``fully_shard``) shards: ``dcp.save``, ``dcp.async_save``
    (time until it returns, and until its future is done) and ``dcp.load``. The model is ``TinyMLP(64, hidden, 1, layers)`` with Adam (fp32
    values and two moments per parameter: 12 bytes), on the device the default group's backend sends
    (:func:`course_lib.collectives.comm_device`: the rank's GPU under NCCL). A worker function for the
    virtual cluster or torchrun.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from course_lib.checkpoint import CheckpointManager, load_sharded, save_sharded
    from course_lib.collectives import comm_device
    from course_lib.models import TinyMLP
    from course_lib.zero import ZeRO

    device = comm_device()

    def model():
        torch.manual_seed(0)
        return TinyMLP(64, hidden, 1, layers).to(device)

    def timed(fn):
        best, out = float("inf"), None
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        return best, out

    x = torch.randn(8, 64, device=device)
    z = ZeRO(model(), 3, lr=1e-3)
    z(x).sum().backward()
    z.step()
    mgr = CheckpointManager(os.path.join(directory, f"ours-{hidden}"), keep_last=1)
    t_save, info = timed(lambda: save_sharded(mgr, 1, z.sharded_state_dict()))

    def load_ours():
        ck = load_sharded(mgr)
        z.load_sharded_state_dict(ck.fetch, ck.replicated)
    t_load, _ = timed(load_ours)
    z.close()

    m = model()
    for layer in m.layers:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(x).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    d_sync = os.path.join(directory, f"dcp-{hidden}")
    d_async = os.path.join(directory, f"dcp-async-{hidden}")
    fresh = iter(range(1 << 30))      # a new directory per save: DCP warns when it overwrites one
    t_dcp_save, _ = timed(lambda: dcp.save(state, checkpoint_id=f"{d_sync}-{next(fresh)}"))
    # async_save finishes on a background thread with collectives of its own: give it its own process
    # group, or they interleave with the main thread's (the barrier below) and both wait forever.
    ckpt_group = dist.new_group(backend="gloo")
    t_async_return = t_async_total = float("inf")
    for _ in range(repeats):     # one save in flight at a time: two would share the group's collectives
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=f"{d_async}-{next(fresh)}", process_group=ckpt_group)
        dist.barrier()
        t1 = time.perf_counter()
        fut.result()
        dist.barrier()
        t_async_return, t_async_total = min(t_async_return, t1 - t0), min(t_async_total, time.perf_counter() - t0)
    d_sync += "-0"
    t_dcp_load, _ = timed(lambda: dcp.load(state, checkpoint_id=d_sync))
    dcp_bytes = sum(os.path.getsize(os.path.join(d_sync, f)) for f in os.listdir(d_sync))
    return {"params": sum(p.numel() for p in model().parameters()), "ours_bytes": info["total_bytes"],
            "dcp_bytes": dcp_bytes, "ours_save": t_save, "ours_load": t_load, "dcp_save": t_dcp_save,
            "dcp_async_return": t_async_return, "dcp_async_total": t_async_total,
            "dcp_load": t_dcp_load}

