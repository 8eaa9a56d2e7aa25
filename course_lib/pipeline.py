"""Pipeline parallelism from scratch: stages on real processes, schedules as data, one runner.

A model that is a sequence of layers is cut into ``S`` consecutive **stages**; stage ``s`` lives on
rank ``s % p`` of a pipeline group of ``p`` ranks (``S = p``, or ``S = v p`` with ``v`` *virtual*
stages per rank for the interleaved schedule). A batch is split into ``m`` **micro-batches**. A stage's
forward of micro-batch ``i`` needs the previous stage's output for ``i`` (sent point to point); its
backward needs the next stage's input gradient for ``i``::

    rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3     GPipe, p = 2, m = 4
    rank 1 |    F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3                                    (a backward takes
                                                                                       two forwards' time)

A **schedule** is plain data: ``schedule[r]`` is the list of :class:`Action` rank ``r`` executes, in
order -- ``Action("F", stage, microbatch)`` (forward), ``Action("B", stage, microbatch)`` (backward;
the input-gradient half only when the schedule also has ``"W"`` actions, the weight-gradient half,
as in the zero-bubble schedules). The generators:

===============================  =====================================================  ===================
generator                        what                                                   source
===============================  =====================================================  ===================
:func:`naive_schedule`           one batch, one stage busy at a time                     "model parallelism"
:func:`gpipe_schedule`           all forwards, then all backwards                        Huang et al. 2019
:func:`one_f_one_b_schedule`     warm up, then alternate one forward / one backward      Narayanan et al. 2019
                                 (PipeDream-flush): at most ``p - r`` in flight
:func:`interleaved_1f1b_schedule`  1F1B over ``v`` virtual stages per rank               Narayanan et al. 2021
:func:`zb_h1_schedule`           1F1B with the backward split into B (input) and W       Qi et al. 2024
                                 (weights); the W's fill the cool-down bubble
===============================  =====================================================  ===================

:func:`validate_schedule` checks one (every action once, on the right rank, no deadlock, and messages
that two ranks can match in order, without tags); :func:`simulate` plays it with given action times (no
processes) and :func:`run_schedule` executes it on the ranks of a process group (eager tagged sends on
gloo, paired ``batch_isend_irecv`` exchanges under NCCL), recording one span per action in an active
:class:`course_lib.trace.Recorder`. :func:`bubble_fraction` measures the idle share of either
timeline (:func:`measured_times` reads a measured one's action and hop times back for :func:`simulate`), :func:`theoretical_bubble` is ``(p-1)/(v m + p-1)``, :func:`peak_in_flight` counts the
micro-batches whose activations a rank holds at once. :func:`partition` cuts an ``nn.Sequential`` into
balanced stages (by parameter count or by measured time). :func:`torch_pipeline_step` runs the same
stages with ``torch.distributed.pipelining``, the production API this module is checked against.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import collectives, trace
from course_lib._checks import _pos_int

__all__ = [
    "Action",
    "ScheduleError",
    "stage_rank",
    "naive_schedule",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_1f1b_schedule",
    "zb_h1_schedule",
    "SCHEDULES",
    "make_schedule",
    "format_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "measured_times",
    "theoretical_bubble",
    "peak_in_flight",
    "split_microbatches",
    "layer_costs",
    "balance",
    "partition",
    "build_stages",
    "run_schedule",
    "torch_schedule",
    "torch_pipeline_step",
]

_KINDS = ("F", "B", "W")
_EVENT_KIND = {"F": "forward", "B": "backward", "W": "weight"}


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` ``"F"`` (forward), ``"B"`` (backward) or ``"W"`` (weight
    gradient, only in split-backward schedules) of ``microbatch`` on ``stage``.

    ``str(a)`` is short: ``F3`` (forward of micro-batch 3), or ``F3@s5`` with the stage when a rank
    holds several stages (see :func:`format_schedule`).
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Action kind must be one of {_KINDS} (forward, backward, weight "
                             f"gradient), got {self.kind!r}")
        for name in ("stage", "microbatch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"Action {name} must be an int >= 0, got {v!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, an action on the wrong rank, or a
    deadlock (the message names the actions that wait for each other)."""


def stage_rank(stage: int, p: int) -> int:
    """The rank of a ``p``-rank pipeline group that holds ``stage``: ``stage % p`` (with ``v`` stages per
    rank, rank ``r`` holds stages ``r, r + p, r + 2p, ...``: the looped placement of Megatron-LM and of
    ``torch.distributed.pipelining``'s interleaved schedules)."""
    return int(stage) % int(p)


# --------------------------------------------------------------------------- schedules
def naive_schedule(p: int) -> list[list[Action]]:
    """Naive model parallelism: the whole batch as one micro-batch. Rank ``r`` runs ``F0`` then ``B0``;
    at any moment one rank works and ``p - 1`` wait (the bubble is ``(p-1)/p``)."""
    return gpipe_schedule(p, 1)


def gpipe_schedule(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every rank runs the forwards of all ``m`` micro-batches, then their
    backwards (in reverse, as autograd would). Rank ``r`` holds all ``m`` micro-batches' activations
    at the turn."""
    p, m = _pos_int("p (stages)", p), _pos_int("m (micro-batches)", m)
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in reversed(range(m))]
            for r in range(p)]


def one_f_one_b_schedule(p: int, m: int) -> list[list[Action]]:
    """1F1B, PipeDream-flush (Narayanan et al. 2019, 2021 §2.2.1): rank ``r`` warms up with
    ``min(p - r - 1, m)`` forwards, then alternates one forward and one backward, then cools down with
    the remaining backwards. Same bubble as GPipe, but rank ``r`` holds at most ``min(p - r, m)``
    micro-batches' activations instead of ``m``."""
    p, m = _pos_int("p (stages)", p), _pos_int("m (micro-batches)", m)
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def interleaved_1f1b_schedule(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2.2): every rank holds ``v`` stages (rank ``r`` holds
    stages ``r, r + p, ..., r + (v-1) p``, so a micro-batch loops ``v`` times through the ranks), each
    ``1/v`` of the work, which divides the bubble by ``v``: ``(p-1)/(v m + p - 1)``.

    Rank ``r``'s order is Megatron-LM's: micro-batches go through in groups of ``p``, each group through
    virtual stage 0, then 1, ...; ``2 (p - r - 1) + (v - 1) p`` forwards warm up, then one forward /
    one backward, then the backwards that are left. Needs ``m`` divisible by ``p``.
    """
    p, m, v = (_pos_int("p (stages)", p), _pos_int("m (micro-batches)", m),
               _pos_int("v (virtual stages per rank)", v))
    if m % p:
        raise ValueError(f"the interleaved schedule sends micro-batches through in groups of p = {p}: "
                         f"m = {m} must be a multiple of {p} (use m = {max(p, m // p * p)} or "
                         f"{(m // p + 1) * p})")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p if forward else v - 1 - within // p
        return chunk, group * p + within % p

    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        F = [Action("F", c * p + r, i) for c, i in (unit(k, True) for k in range(total))]
        B = [Action("B", c * p + r, i) for c, i in (unit(k, False) for k in range(total))]
        acts = F[:warm]
        for k in range(total - warm):
            acts += [F[warm + k], B[k]]
        acts += B[total - warm:]
        out.append(acts)
    return out


def zb_h1_schedule(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3): the backward is split into B (the
    input gradient, which the previous stage waits for) and W (the weight gradient, which nobody waits
    for). Forwards and B's keep 1F1B's order; each W is deferred while the rank has a B or F that
    can run, and done where 1F1B would sit idle, or before a forward that would hold more than ``p``
    micro-batches (1F1B's peak, on rank 0; a micro-batch's activations go with its W). With equal F,
    B and W times the idle time drops to a third of 1F1B's, ``(p-1)(T_F + T_B - T_W)`` (for
    ``m >= p``), and no rank holds more micro-batches than 1F1B's rank 0.

    Built greedily from a unit-time simulation (F = B = W = 1): the order is data and valid for any
    action times (a W depends only on its own B), optimal for equal times.
    """
    p, m = _pos_int("p (stages)", p), _pos_int("m (micro-batches)", m)
    base = one_f_one_b_schedule(p, m)
    done: dict[tuple, float] = {}
    free = [0.0] * p
    pos = [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    alive = [0] * p  # micro-batches whose forward ran and whose W has not
    out: list[list[Action]] = [[] for _ in range(p)]
    while any(pos[r] < len(base[r]) or pending[r] for r in range(p)):
        # the rank that can start something earliest goes next (ties: lower rank)
        best = None
        for r in range(p):
            if pos[r] < len(base[r]):
                a = base[r][pos[r]]
                deps = _deps(a, p, split=True)
                if all(d in done for d in deps):
                    t = max([free[r]] + [done[d] for d in deps])
                    # a W that fits before the next F/B can start is done first, and so is one that
                    # keeps the activations held within 1F1B's peak of p (a W frees its micro-batch)
                    full = a.kind == "F" and alive[r] >= p
                    if pending[r] and (free[r] + 1.0 <= t or full):
                        cand = (free[r], r, "W")
                    else:
                        cand = (t, r, "FB")
                elif pending[r]:
                    cand = (free[r], r, "W")
                else:
                    continue
            elif pending[r]:
                cand = (free[r], r, "W")
            else:
                continue
            if best is None or cand[:2] < best[:2]:
                best = cand
        t, r, what = best
        if what == "W":
            a = pending[r].pop(0)
            alive[r] -= 1
        else:
            a = base[r][pos[r]]
            pos[r] += 1
            alive[r] += a.kind == "F"
            if a.kind == "B":
                pending[r].append(Action("W", a.stage, a.microbatch))
        done[(a.kind, a.stage, a.microbatch)] = t + 1.0
        free[r] = t + 1.0
        out[r].append(a)
    return out


#: name -> generator(p, m, v), the names the widget and :func:`make_schedule` use
SCHEDULES = {
    "naive": lambda p, m, v=1: naive_schedule(p),
    "gpipe": lambda p, m, v=1: gpipe_schedule(p, m),
    "1f1b": lambda p, m, v=1: one_f_one_b_schedule(p, m),
    "interleaved": lambda p, m, v=2: interleaved_1f1b_schedule(p, m, v),
    "zb-h1": lambda p, m, v=1: zb_h1_schedule(p, m),
}


def make_schedule(name: str, p: int, m: int, v: int = 2) -> list[list[Action]]:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``p`` ranks and ``m`` micro-batches
    (``v`` virtual stages per rank for ``"interleaved"``; ``"naive"`` ignores ``m``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, v) if name == "interleaved" else SCHEDULES[name](p, m)


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One line per rank: ``rank 0 | F0 F1 B0 ...`` (``F0@s4`` with the stage when ranks hold several)."""
    many = any(a.stage >= len(schedule) for acts in schedule for a in acts)
    lines = []
    for r, acts in enumerate(schedule):
        text = " ".join(f"{a}@s{a.stage}" if many else str(a) for a in acts)
        lines.append(f"rank {r} | {text}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- checking and simulating
def _deps(a: Action, n_stages: int, split: bool) -> list[tuple]:
    """The actions ``a`` waits for, as ``(kind, stage, microbatch)``."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if a.kind == "B":
        return [("F", s, i)] + ([("B", s + 1, i)] if s < n_stages - 1 else [])
    return [("B", s, i)]


def _shape(schedule) -> tuple[int, int, int, bool]:
    """``(p, n_stages, m, split)`` of a schedule, checking its structure; raises ScheduleError."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ScheduleError(f"a schedule is a list with one list of Actions per rank, got {schedule!r}")
    p = len(schedule)
    for r, acts in enumerate(schedule):
        if not isinstance(acts, (list, tuple)):
            raise ScheduleError(f"schedule[{r}] must be the list of rank {r}'s Actions, got {acts!r}")
        for k, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"schedule[{r}][{k}] must be an Action('F'|'B'|'W', stage, "
                                    f"microbatch), got {a!r}")
    acts = [a for row in schedule for a in row]
    if not acts:
        raise ScheduleError("the schedule has no actions")
    n_stages = max(a.stage for a in acts) + 1
    m = max(a.microbatch for a in acts) + 1
    split = any(a.kind == "W" for a in acts)
    return p, n_stages, m, split


def validate_schedule(schedule: Sequence[Sequence[Action]], n_microbatches: int | None = None) -> dict:
    """Check that ``schedule`` can run, or raise :class:`ScheduleError` saying what is wrong.

    Checked: every action of stage ``s`` is in the list of rank ``s % p``; the stages are ``0 .. S-1``
    with ``S`` a multiple of ``p``; every (stage, micro-batch) has exactly one F and one B (and one W
    when the schedule splits the backward), for micro-batches ``0 .. m-1`` (``m = n_microbatches`` when
    given); and the ranks, each running its list in order, never wait for each other in a cycle.
    Then the messages :func:`run_schedule` would exchange (:func:`_check_messages`): between two
    ranks they are received in the order they are sent (no tags tell them apart: NCCL has none), and
    the runner's exchanges cannot wait for each other in a cycle, even when every send completes only
    once its receive is posted (NCCL's rule).

    Returns ``{"p", "n_stages", "m", "split"}``.
    """
    return _validated(schedule, n_microbatches)[0]


def _validated(schedule, n_microbatches: int | None = None) -> tuple[dict, list[list[tuple]]]:
    """:func:`validate_schedule`'s checks; returns its dict and the runner's :func:`_programs`."""
    p, n_stages, m, split = _shape(schedule)
    if n_microbatches is not None:
        n_microbatches = _pos_int("n_microbatches", n_microbatches)
        if m > n_microbatches:
            raise ScheduleError(f"the schedule uses micro-batch {m - 1} but there are only "
                                f"{n_microbatches} (0 .. {n_microbatches - 1})")
        m = n_microbatches
    if n_stages % p:
        raise ScheduleError(f"the schedule has {n_stages} stages on {p} ranks: the number of stages must "
                            f"be a multiple of the ranks (each rank holds the same number of stages)")
    seen: dict[tuple, int] = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if stage_rank(a.stage, p) != r:
                raise ScheduleError(f"rank {r} lists {a.kind}{a.microbatch} of stage {a.stage}, but stage "
                                    f"{a.stage} lives on rank {stage_rank(a.stage, p)} (stage s on rank s % p)")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"rank {r} runs {a.kind}{a.microbatch} of stage {a.stage} twice")
            seen[key] = r
    kinds = ("F", "B", "W") if split else ("F", "B")
    for s in range(n_stages):
        for i in range(m):
            for kind in kinds:
                if (kind, s, i) not in seen:
                    what = {"F": "forward", "B": "backward", "W": "weight gradient"}[kind]
                    raise ScheduleError(f"the {what} {kind}{i} of stage {s} is missing (rank "
                                        f"{stage_rank(s, p)} must run every micro-batch 0 .. {m - 1} of "
                                        f"every stage it holds)")
    played = _play(schedule, p, n_stages, split, lambda a: 1.0, 0.0)  # raises on a deadlock
    programs = _programs(schedule, p, n_stages, played)
    _check_messages(programs)
    return {"p": p, "n_stages": n_stages, "m": m, "split": split}, programs


def _play(schedule, p, n_stages, split, duration, t_comm) -> list[list[dict]]:
    """Run the schedule on a clock: each rank runs its actions in order, an action starts when its
    rank is free and what it waits for has finished (plus ``t_comm`` from another rank)."""
    done: dict[tuple, float] = {}
    free = [0.0] * p
    pos = [0] * p
    events: list[list[dict]] = [[] for _ in range(p)]
    while True:
        progress = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                deps = _deps(a, n_stages, split)
                if not all(d in done for d in deps):
                    break
                start = free[r]
                for d in deps:
                    start = max(start, done[d] + (t_comm if stage_rank(d[1], p) != r else 0.0))
                end = start + duration(a)
                done[(a.kind, a.stage, a.microbatch)] = end
                free[r] = end
                events[r].append(dict(rank=r, kind=_EVENT_KIND[a.kind], name=str(a), stage=a.stage,
                                      microbatch=a.microbatch, start=start, end=end,
                                      bytes_sent=0, bytes_recv=0, clock="simulated"))
                pos[r] += 1
                progress = True
        if all(pos[r] == len(schedule[r]) for r in range(p)):
            return events
        if not progress:
            waits = []
            for r in range(p):
                if pos[r] < len(schedule[r]):
                    a = schedule[r][pos[r]]
                    missing = [d for d in _deps(a, n_stages, split) if d not in done]
                    need = ", ".join(f"{k}{i} of stage {s} (rank {stage_rank(s, p)})" for k, s, i in missing)
                    waits.append(f"rank {r} waits at {a.kind}{a.microbatch} of stage {a.stage} for {need}")
            raise ScheduleError("deadlock: every rank waits for an action that another rank only runs "
                                "later in its list: " + "; ".join(waits))


# --------------------------------------------------------------------------- the runner's messages
def _messages(a: Action, p: int, last: int) -> tuple[tuple | None, tuple | None]:
    """``(receive, send)`` of action ``a``, each ``(direction, sending stage, microbatch, peer rank)`` or
    ``None``: a forward receives the previous stage's output and sends its own (direction 0), a
    backward receives its output's gradient and sends its input's (direction 1)."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return ((0, s - 1, i, stage_rank(s - 1, p)) if s > 0 else None,
                (0, s, i, stage_rank(s + 1, p)) if s < last else None)
    if a.kind == "B":
        return ((1, s + 1, i, stage_rank(s + 1, p)) if s < last else None,
                (1, s, i, stage_rank(s - 1, p)) if s > 0 else None)
    return None, None


def _header_microbatches(schedule, p: int, last: int) -> dict[tuple, int]:
    """``{(direction, sending stage): microbatch}``: every micro-batch of a stage has the same shape, so
    a header with dtype and shape travels once per stage and direction, with the first micro-batch
    the *receiver* takes (both sides know the whole schedule)."""
    first: dict[tuple, int] = {}
    for acts in schedule:
        for a in acts:
            recv, _ = _messages(a, p, last)
            if recv is not None:
                first.setdefault(recv[:2], recv[2])
    return first


def _programs(schedule, p: int, n_stages: int, played: list[list[dict]]) -> list[list[tuple]]:
    """What :func:`run_schedule` does on each rank, in order: ``("x", sends, receives)``, an exchange
    of messages ``(peer rank, (direction, stage, microbatch, part))`` (part 0 the header, 1 the tensor),
    and ``("a", action)``. One list per rank. ``played``: the schedule played with unit times (what
    :func:`_play` returns for ``duration = 1``).

    Every message travels in the *round* when its receiver starts the action that needs it, in the
    schedule played with unit times (:func:`simulate` with every action 1): both sides compute the
    same rounds from the schedule, and before its action of round ``t`` each rank posts one exchange
    with everything it sends or receives in round ``t`` (a header, which the receiver needs to size the
    tensor's buffer, in an exchange of its own just before). So the messages between two ranks go in
    round order on both sides, and round ``t`` can complete on every rank once all earlier rounds have
    (what a rank sends in round ``t`` was computed before it), even when every send waits for its
    receive. A rank waits only for the exchanges it takes part in, not for all ranks in every round.
    Messages to the same rank (``p = 1``) are handed over in memory and are not listed."""
    last = n_stages - 1
    header_mb = _header_microbatches(schedule, p, last)
    kinds = {v: k for k, v in _EVENT_KIND.items()}
    start = {(kinds[e["kind"]], e["stage"], e["microbatch"]): e["start"]
             for row in played for e in row}
    rounds: list[dict] = [{} for _ in range(p)]   # rank -> {round: [sends, receives, action]}
    for r, acts in enumerate(schedule):
        for a in acts:
            t = start[(a.kind, a.stage, a.microbatch)]
            rounds[r].setdefault(t, [[], [], None])[2] = a
            recv, _ = _messages(a, p, last)
            if recv is not None and recv[3] != r:
                d, s, i, src = recv
                rounds[r][t][1].append((src, (d, s, i)))
                rounds[src].setdefault(t, [[], [], None])[0].append((r, (d, s, i)))
    programs = []
    for r in range(p):
        prog = []
        for t in sorted(rounds[r]):
            sends, recvs, a = rounds[r][t]
            for part in (0, 1):
                xs = [(q, msg + (part,)) for q, msg in sends if part or header_mb[msg[:2]] == msg[2]]
                xr = [(q, msg + (part,)) for q, msg in recvs if part or header_mb[msg[:2]] == msg[2]]
                if xs or xr:
                    prog.append(("x", xs, xr))
            if a is not None:
                prog.append(("a", a))
        programs.append(prog)
    return programs


def _check_messages(programs: list[list[tuple]]) -> None:
    """Raise :class:`ScheduleError` unless the runner's messages (``programs``: :func:`_programs`) are
    received in the order they are sent between every two ranks, and its exchanges complete under
    the strictest rule: a rank posts its exchanges one after another, each completing once the peer
    of every message in it has posted the matching one (a send waits for its receive, as NCCL's
    do). The runner's rounds make both true for every valid schedule; this checks that they do."""
    p = len(programs)
    plan = [[(x[1], x[2]) for x in prog if x[0] == "x"] for prog in programs]
    sent: dict[tuple, list] = {}
    got: dict[tuple, list] = {}
    for r, exchanges in enumerate(plan):
        for sends, recvs in exchanges:
            for peer, msg in sends:
                sent.setdefault((r, peer), []).append(msg)
            for peer, msg in recvs:
                got.setdefault((peer, r), []).append(msg)
    for pair in sorted(set(sent) | set(got)):
        a, b = sent.get(pair, []), got.get(pair, [])
        if a != b:
            k = next(j for j in range(len(a) + 1) if j == len(a) or j == len(b) or a[j] != b[j])

            def what(seq):
                if k >= len(seq):
                    return "nothing"
                d, st, i, _ = seq[k]
                return f"the {('activation', 'gradient')[d]} of stage {st} for micro-batch {i}"
            raise ScheduleError(
                f"rank {pair[0]} sends {what(a)} as its message {k} to rank {pair[1]}, which expects "
                f"{what(b)} there: messages between two ranks arrive in the order they are sent (no "
                "tags: NCCL has none), so the receiving rank must take them in that order; reorder its "
                "actions")
    # Play the exchanges. The k-th send from r to q meets q's k-th receive from r; an exchange
    # completes once every peer has posted (in the exchange it is at, or an earlier one) the match.
    pos = [0] * p
    posted: list[dict] = [{} for _ in range(p)]   # rank -> {(kind, src, dst): messages posted}

    def post(r):
        if pos[r] < len(plan[r]):
            sends, recvs = plan[r][pos[r]]
            for key in [("send", r, q) for q, _ in sends] + [("recv", q, r) for q, _ in recvs]:
                posted[r][key] = posted[r].get(key, 0) + 1

    def complete(r) -> bool:
        sends, recvs = plan[r][pos[r]]
        need = [(q, ("recv", r, q), posted[r][("send", r, q)]) for q, _ in sends]
        need += [(q, ("send", q, r), posted[r][("recv", q, r)]) for q, _ in recvs]
        return all(posted[q].get(key, 0) >= n for q, key, n in need)

    for r in range(p):
        post(r)
    while not all(pos[r] == len(plan[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(plan[r]) and complete(r):
                pos[r] += 1
                post(r)
                moved = True
        if not moved:
            stuck = [f"rank {r} at its exchange {pos[r]} (sends to {[q for q, _ in plan[r][pos[r]][0]]}, "
                     f"receives from {[q for q, _ in plan[r][pos[r]][1]]})"
                     for r in range(p) if pos[r] < len(plan[r])]
            raise ScheduleError("the runner's paired sends and receives would wait for each other: "
                                + "; ".join(stuck) + ". Reorder the actions so that every rank receives "
                                "what its neighbours send next")


def simulate(schedule: Sequence[Sequence[Action]], t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float | None = None, t_comm: float = 0.0) -> list[list[dict]]:
    """Play ``schedule`` on a clock, without processes: each rank runs its actions in order, and an
    action starts once its rank is free and the actions it waits for are done (``t_comm`` later when
    they ran on another rank).

    Times are per *stage*: with ``v`` stages per rank give the stage's share (``t_forward / v``). A
    backward takes ``t_backward``; in a split schedule (with W actions) B takes ``t_backward - t_weight``
    and W ``t_weight`` (default: half each).

    Returns per-rank event lists in the format of :mod:`course_lib.trace` (``kind`` ``"forward"``,
    ``"backward"`` or ``"weight"``, plus ``stage`` and ``microbatch``; ``clock="simulated"``), for
    :func:`bubble_fraction` and :func:`course_lib.viz.plot_pipeline`. Raises :class:`ScheduleError`
    on an invalid schedule.
    """
    info = validate_schedule(schedule)
    for name, t in (("t_forward", t_forward), ("t_backward", t_backward), ("t_comm", t_comm)):
        if not isinstance(t, (int, float)) or t < 0 or (name != "t_comm" and t == 0):
            raise ValueError(f"{name} must be a number > 0 (>= 0 for t_comm), got {t!r}")
    if info["split"]:
        t_weight = t_backward / 2 if t_weight is None else float(t_weight)
        if not 0 < t_weight < t_backward:
            raise ValueError(f"t_weight must be between 0 and t_backward = {t_backward}, got {t_weight!r}")
        times = {"F": t_forward, "B": t_backward - t_weight, "W": t_weight}
    else:
        times = {"F": t_forward, "B": t_backward}
    return _play(schedule, info["p"], info["n_stages"], info["split"], lambda a: times[a.kind], t_comm)


_COMPUTE_KINDS = ("forward", "backward", "weight")


def bubble_fraction(events_per_rank: Sequence[Sequence[dict]]) -> float:
    """The idle share of a pipeline timeline: ``1 - busy / (p * makespan)``, where ``busy`` sums every
    rank's forward/backward/weight spans and the makespan runs from the first start to the last end over
    all ranks. Works for :func:`simulate`'s events and for measured ones (``Recorder.events`` of
    :func:`run_schedule`)."""
    evs = [[e for e in row if e.get("kind") in _COMPUTE_KINDS] for row in events_per_rank]
    flat = [e for row in evs for e in row]
    if not flat:
        raise ValueError("no forward/backward events: pass each rank's events from simulate() or from a "
                         "trace.Recorder around run_schedule()")
    t0, t1 = min(e["start"] for e in flat), max(e["end"] for e in flat)
    busy = sum(e["end"] - e["start"] for e in flat)
    return 1.0 - busy / (len(evs) * (t1 - t0))


def measured_times(events_per_rank: Sequence[Sequence[dict]]) -> dict:
    """What a measured timeline (each rank's ``Recorder.events`` around :func:`run_schedule`) says about
    its actions, as :func:`simulate`'s arguments: the mean span of a forward (``t_forward``), of a
    backward (``t_backward``, the B plus the W of a split schedule) and of a W (``t_weight``, ``None``
    without W), each plus the runner's mean time between two actions that did not wait for another
    rank; and ``t_comm``, the mean delay from the end of an action on another rank to the start of the
    action that waited for it (where that was the last thing it waited for). Simulating
    the schedule with these times explains a measured bubble: compute plus the hop on the critical path.
    """
    rows = [[e for e in row if e.get("kind") in _COMPUTE_KINDS] for row in events_per_rank]
    letter = {v: k for k, v in _EVENT_KIND.items()}
    by_key = {(letter[e["kind"]], e["stage"], e["microbatch"]): e for row in rows for e in row}
    if not by_key:
        raise ValueError("no forward/backward events with stage and microbatch: pass each rank's "
                         "Recorder.events from run_schedule()")
    p = len(rows)
    n_stages = max(k[1] for k in by_key) + 1
    split = any(k[0] == "W" for k in by_key)
    mean = {k: [e["end"] - e["start"] for row in rows for e in row if letter[e["kind"]] == k] for k in _KINDS}
    avg = {k: (sum(v) / len(v) if v else None) for k, v in mean.items()}
    waits, gaps = [], []
    for r, row in enumerate(rows):
        prev_end = None
        for e in sorted(row, key=lambda e: e["start"]):
            deps = _deps(Action(letter[e["kind"]], e["stage"], e["microbatch"]), n_stages, split)
            cross = [by_key[d]["end"] for d in deps if stage_rank(d[1], p) != r and d in by_key]
            if cross and (prev_end is None or max(cross) >= prev_end):
                waits.append(max(0.0, e["start"] - max(cross)))     # it waited for another rank
            elif prev_end is not None:
                gaps.append(max(0.0, e["start"] - prev_end))        # the runner's own time between actions
            prev_end = e["end"]
    gap = sum(gaps) / len(gaps) if gaps else 0.0
    t = {k: (v + gap if v is not None else None) for k, v in avg.items()}
    t_backward = t["B"] + (t["W"] or 0.0) if split else t["B"]
    return {"t_forward": t["F"], "t_backward": t_backward, "t_weight": t["W"] if split else None,
            "t_comm": sum(waits) / len(waits) if waits else 0.0}


def theoretical_bubble(p: int, m: int, v: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: the idle share of GPipe and 1F1B (``v = 1``; Huang et al. 2019) and of
    interleaved 1F1B with ``v`` virtual stages per rank (Narayanan et al. 2021, §2.2.2), when every stage
    takes the same time and communication is free."""
    p, m, v = _pos_int("p", p), _pos_int("m", m), _pos_int("v", v)
    return (p - 1) / (v * m + p - 1)


def peak_in_flight(schedule: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs whose forward has run and whose backward has not
    finished (the last of B and W) at any point of its list: the activations it holds at its peak."""
    p, n_stages, m, split = _shape(schedule)
    last = "W" if split else "B"
    out = []
    for acts in schedule:
        alive = peak = 0
        for a in acts:
            if a.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif a.kind == last:
                alive -= 1
        out.append(peak)
    return out


# --------------------------------------------------------------------------- partitioning
def split_microbatches(batch: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``batch`` cut into ``m`` equal micro-batches along dimension 0 (views, no copy)."""
    m = _pos_int("m (micro-batches)", m)
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        raise TypeError(f"batch must be a tensor with a batch dimension, got {batch!r}")
    n = batch.shape[0]
    if n % m:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"{m} micro-batches do not divide the batch of {n} samples; choose m among "
                         f"{divisors} or change the batch size to a multiple of {m}")
    return list(batch.chunk(m))


def layer_costs(model: nn.Sequential, by: str = "params", example: torch.Tensor | None = None,
                repeats: int = 5, loops: int = 10) -> list[float]:
    """The cost of each layer of ``model``: its parameter count (``by="params"``) or its measured
    forward + backward seconds on ``example`` (``by="time"``).

    Timing a sub-millisecond layer once measures the timer and the scheduler, not the layer, so
    ``by="time"`` first runs the whole model once untimed (allocations, kernel selection), then times
    each layer ``loops`` times in a row per measurement, and returns the median over ``repeats``
    measurements of the mean per pass. The Python and autograd overhead of a pass (tens of
    microseconds) is part of what is measured: for tiny layers it is most of it, as it is for a
    pipeline stage that runs them."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"partitioning needs an nn.Sequential (a model that is a list of layers), got "
                        f"{type(model).__name__}; wrap your layers in nn.Sequential(...)")
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if by != "time":
        raise ValueError(f"by must be 'params' or 'time', got {by!r}")
    if example is None:
        raise ValueError("by='time' measures each layer on an input: pass example=<a batch for the model>")
    repeats, loops = _pos_int("repeats", repeats), _pos_int("loops", loops)
    inputs, x = [], example
    for layer in model:                          # the warm-up pass, which also gives each layer its input
        x = x.detach().requires_grad_(x.is_floating_point())
        inputs.append(x)
        y = layer(x)
        y.float().sum().backward()
        x = y
    costs = [[] for _ in model]
    for _ in range(repeats):
        for k, layer in enumerate(model):
            x = inputs[k]
            t0 = time.perf_counter()
            for _ in range(loops):
                layer(x).float().sum().backward()
            costs[k].append((time.perf_counter() - t0) / loops)
    return [sorted(c)[len(c) // 2] for c in costs]


def balance(costs: Sequence[float], n_stages: int) -> list[range]:
    """Cut layers with ``costs`` into ``n_stages`` consecutive, non-empty stages so that the most
    expensive stage is as cheap as possible (the pipeline runs at the pace of its slowest stage).
    Returns one ``range`` of layer indices per stage. Exact (dynamic programming over cut points)."""
    costs = [float(c) for c in costs]
    L = len(costs)
    n_stages = _pos_int("n_stages", n_stages)
    if n_stages > L:
        raise ValueError(f"cannot cut {L} layers into {n_stages} stages: every stage needs at least one "
                         f"layer; use at most {L} stages (or a model with more layers)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = math.inf
    # best[k][j]: the smallest max-stage cost of the first j layers in k stages; cut[k][j]: last cut
    best = [[INF] * (L + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, L - (n_stages - k) + 1):
            for i in range(k - 1, j):
                c = max(best[k - 1][i], prefix[j] - prefix[i])
                if c < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = c, i
    bounds, j = [], L
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def partition(model: nn.Sequential, n_stages: int, by: str = "params",
              example: torch.Tensor | None = None) -> list[range]:
    """Balanced stages of ``model``: :func:`balance` of :func:`layer_costs` (``by="params"`` or
    ``"time"``, which needs ``example``). Returns one ``range`` of layer indices per stage."""
    return balance(layer_costs(model, by, example), n_stages)


def build_stages(model: nn.Sequential, bounds: Sequence[range], stages: Sequence[int]) -> dict[int, nn.Module]:
    """``{stage: nn.Sequential of its layers}`` for the ``stages`` this rank holds (the layers are
    shared with ``model``, not copied)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"build_stages needs an nn.Sequential, got {type(model).__name__}")
    out = {}
    for s in stages:
        if not 0 <= s < len(bounds):
            raise ValueError(f"stage {s} does not exist: the partition has {len(bounds)} stages")
        out[s] = nn.Sequential(*[model[k] for k in bounds[s]])
    return out


# --------------------------------------------------------------------------- the runner
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_HEADER = 9  # dtype code, ndim, up to 7 sizes


def _send(t: torch.Tensor, part: int) -> torch.Tensor:
    """What carries part ``part`` of the message with a stage's output (or input gradient) ``t``:
    part 0, the header, a small int64 tensor with ``t``'s dtype code, number of dimensions and sizes
    (sent with the first micro-batch of a stage and direction only); part 1, ``t`` itself. Both on
    ``t``'s device: NCCL sends device tensors only."""
    if part == 1:
        return t
    sizes = list(t.shape) + [0] * (_HEADER - 2 - t.dim())
    return torch.tensor([_DTYPES.index(t.dtype), t.dim()] + sizes, dtype=torch.int64, device=t.device)


def _recv(part: int, known: tuple | None, device: torch.device) -> torch.Tensor:
    """The buffer that receives part ``part`` of a message, on the receiving stage's ``device``: a
    header's (part 0), or the tensor's, whose ``(dtype, shape)`` an earlier header told (``known``)."""
    if part == 0:
        return torch.empty(_HEADER, dtype=torch.int64, device=device)
    return torch.empty(known[1], dtype=known[0], device=device)


def _read_header(h: torch.Tensor) -> tuple:
    """``(dtype, shape)`` from a header :func:`_send` made."""
    code, ndim, *sizes = h.tolist()
    return _DTYPES[code], tuple(sizes[:ndim])


def _device(stages: dict[int, nn.Module]) -> torch.device:
    """Where this rank's stages live (their first parameter's device; the CPU for stages without
    parameters): received activations and gradients are allocated there (NCCL needs GPU tensors)."""
    for mod in stages.values():
        for q in mod.parameters():
            return q.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- the split backward
def _grad_node(t: torch.Tensor):
    """The autograd node that ``t``'s gradient flows into: its ``grad_fn``, or for a leaf (a parameter,
    a received activation) its ``AccumulateGrad`` node, which autograd creates when first asked for
    it; a throw-away view reaches it."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _backward_input(y: torch.Tensor, g: torch.Tensor | None, x: torch.Tensor | None,
                    params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, list]:
    """B of a split backward: the gradient of the stage input ``x`` from the output gradient ``g``
    (``None`` when ``y`` is the loss), and what W (:func:`_backward_weight`) needs to compute the
    ``params``' gradients *without walking again what B walked*. Returns ``(gx, saved)``.

    The stage's autograd graph, walked from ``y``'s node, has an **input path**: every node from which
    ``x``'s node can be reached. ``torch.autograd.grad(y, x)`` runs exactly these nodes, and of each
    only the outputs that lead to ``x`` (of a linear layer's ``AddmmBackward``, ``g @ W``, not
    ``h.T @ g``). Everything else a full backward runs lies on **weight paths**, which lead to the
    parameters only: a node from which the input path can be reached is on it. So walking *up* (to the
    output) from a parameter's ``AccumulateGrad`` through nodes off the input path stops at the nodes
    where its weight paths leave the input path, its **exits** (torch's "intermediates"): a linear
    layer's ``AddmmBackward`` for its weight (via ``TBackward``) and its bias. B hooks a pre-hook on
    every exit, which keeps the gradients that flow into the node while B runs -- computed by B anyway.
    W restarts the engine at the exits with those gradients and runs only the weight side.

    Parameters whose exits overlap form one group (one engine call in W): a layer's weight and bias,
    a weight used in two layers. Not one call for all: started at every layer's exit at once, the
    engine would walk the input path again from the top layer's exit down to the lower layers' (it
    leads to their parameters). ``saved`` is the list of groups ``(params, {exit: gradients into
    it})``. When ``x`` is ``None`` or needs no gradient (the first stage: its input is the data),
    there is no input path: B computes nothing and ``saved`` has one group, every parameter the graph
    reaches, with ``y``'s node as its exit and ``g`` as its gradient (W is the whole backward).
    Parameters the forward did not use are in no group (their gradients stay ``None``).
    torch's version: ``stage_backward_input`` in ``torch/distributed/pipelining/_backward.py``.
    """
    params = [q for q in params if q.requires_grad]
    if y.grad_fn is None:                          # nothing in the stage needs a gradient
        return None, []
    root = y.grad_fn
    parents: dict = {root: []}                     # node -> the nodes with an edge to it (nearer y)
    todo = [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None:
                if child not in parents:
                    parents[child] = []
                    todo.append(child)
                parents[child].append(node)
    owners = {}                                    # AccumulateGrad node -> parameter, for those y reaches
    for q in params:
        node = _grad_node(q)
        if node in parents:
            owners[node] = q
    if x is None or not x.requires_grad:           # no input path: W does the whole backward
        if not owners:
            return None, []
        g = torch.ones_like(y) if g is None else g
        return None, [(list(owners.values()), {root: (None,) * y.output_nr + (g,)})]

    on_path = {_grad_node(x)}                      # the input path: up from x's node
    todo = [n for n in on_path if n in parents]
    while todo:
        for up in parents[todo.pop()]:
            if up not in on_path:
                on_path.add(up)
                todo.append(up)
    groups: list[tuple[list, set]] = []            # (params, their exits)
    for node, q in owners.items():
        exits, seen, todo = set(), {node}, [node]
        while todo:                                # up from the parameter, off the input path
            for up in parents[todo.pop()]:
                if up in on_path:
                    exits.add(up)
                elif up not in seen:
                    seen.add(up)
                    todo.append(up)
        joined = [grp for grp in groups if grp[1] & exits]   # groups sharing an exit merge with it
        groups = [grp for grp in groups if not grp[1] & exits]
        groups.append(([q] + [p for grp in joined for p in grp[0]],
                       exits.union(*(grp[1] for grp in joined))))

    captured: dict = {}                            # exit -> the gradients that flowed into it in B
    hooks = [n.register_prehook(lambda grads, n=n: captured.__setitem__(n, grads))
             for _, exits in groups for n in exits]
    try:
        gx, = torch.autograd.grad(y, x, g, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    return gx, [(qs, {n: captured[n] for n in exits if n in captured}) for qs, exits in groups]


def _backward_weight(saved: list) -> None:
    """W of a split backward: accumulate the parameters' gradients from what :func:`_backward_input`
    saved, one engine call per group of parameters (``backward``, not ``autograd.grad``: the gradients
    go into ``.grad`` through the parameters' ``AccumulateGrad`` nodes, whose hooks run, as in a full
    backward)::

        torch.autograd.backward([GradientEdge(exit, k), ...], [its gradient from B, ...], inputs=params)

    The engine starts at the exits with the gradients B captured there and runs only what leads to the
    group's parameters: of each exit the outputs on its weight paths (a linear layer's ``h.T @ g``),
    then the weight paths themselves; the input path above the exits is not walked again, so B + W
    cost one backward. One catch: when a group's exit lies *below* another on the input path (a weight
    used in layers 1 and 3), the engine also runs the input path between them (it leads to the lower
    exit's parameter) and would add that to the lower exit's gradient, which B's capture already holds
    in full. A pre-hook on each exit returns what B captured there instead (torch's clamp), so nothing
    counts twice; that stretch is computed in vain, as in torch's ``stage_backward_weight``.
    """
    for k, (params, captured) in enumerate(saved):
        edges, grads = [], []
        for node, gs in captured.items():
            for i, gi in enumerate(gs):
                if gi is not None:
                    edges.append(torch.autograd.graph.GradientEdge(node, i))
                    grads.append(gi)
        if not edges:
            continue
        clamps = []
        if len(captured) > 1:   # an exit may lie below another: it gets what B captured, once
            clamps = [node.register_prehook(lambda _, gs=gs: gs) for node, gs in captured.items()]
        try:   # keep the graph for the next groups: their exits may lie on this one's way
            torch.autograd.backward(edges, grads, retain_graph=k < len(saved) - 1, inputs=params)
        finally:
            for h in clamps:
                h.remove()


def run_schedule(schedule: Sequence[Sequence[Action]], stages: dict[int, nn.Module],
                 microbatches: Sequence[torch.Tensor] | None = None,
                 targets: Sequence[torch.Tensor] | None = None,
                 loss_fn: Callable | None = None, group=None,
                 after_action: Callable[[Action, int], None] | None = None, *, transport=None) -> dict:
    """Run one training step's forwards and backwards of ``schedule`` on this rank of ``group``.

    Args:
        schedule: one list of :class:`Action` per rank of ``group`` (the same on every rank); checked
            with :func:`validate_schedule` first, so a bad schedule raises instead of hanging.
        stages: ``{stage: module}`` for exactly the stages this rank holds (``s % p == rank``).
        microbatches: the ``m`` input micro-batches, needed on the rank that holds stage 0.
        targets: the ``m`` target micro-batches, needed on the rank that holds the last stage.
        loss_fn: ``loss_fn(output, target)`` -> the micro-batch's mean loss (last stage); each is scaled
            by ``1/m``, so the gradients equal those of the whole batch's mean loss.
        group: the pipeline's process group (``None``: the default group).
        after_action: called as ``after_action(action, send_buffer_bytes)`` once each action is done
            (e.g. to read the memory a rank holds between actions, as notebook 08 does);
            ``send_buffer_bytes`` is what this rank's gradients waiting to be sent, or being sent, still
            hold (a sent activation is the stage's output, kept for the backward anyway).
        transport: what carries the messages (``None``: ``torch.distributed``), as the collectives'
            ``transport=`` (e.g. :class:`course_lib.netem.PacedTransport`).

    Activations go forward and gradients backward as point-to-point messages, received on the device
    of this rank's stages, in one of two ways:

    * on gloo, eagerly: a stage's output is sent (``isend``, tagged by direction, stage and micro-batch)
      as soon as it is computed, and received (``recv``) when the action that needs it starts. Gloo
      buffers sends, so a rank never waits for a neighbour to be ready. A sent tensor is kept until
      its send completes: an activation's until the gradient for the same micro-batch comes back
      (the peer has received it by then), the gradients' until the end of the step.
    * under NCCL (or with ``transport=collectives.PairedP2P()`` on any backend): in rounds. Each
      message travels in the round when its receiver starts the action that needs it
      (:func:`_programs`); before each action a rank posts one exchange with everything it sends
      and receives in that round (one ``dist.batch_isend_irecv``, as ``torch.distributed.pipelining``
      batches its sends and receives) and waits for it. No tags (NCCL has none): between two ranks
      the messages are received in the order they are sent, which :func:`validate_schedule` checks,
      as it checks that the exchanges cannot wait for each other even if every send waited for its
      receive (NCCL's rule). The rounds make a rank wait for its neighbours more often than gloo's
      eager sends do.

    The first micro-batch a stage receives from a neighbour is preceded by a small header with its
    dtype and shape, the others reuse it (every micro-batch of a stage must have the same shape, as
    :func:`split_microbatches` makes them; a different one raises on the sending rank). Gradients
    accumulate in the stages' parameters (zero them between steps). A split backward's B runs
    :func:`_backward_input` (the input's gradient, keeping the gradients where the weight paths leave
    the input path) and its W :func:`_backward_weight` (the weights' gradients from those). In an active
    :class:`course_lib.trace.Recorder`, every action is one span of kind ``"forward"``, ``"backward"``
    or ``"weight"`` with ``stage`` and ``microbatch``.

    Returns ``{"losses": [m floats] on the last stage's rank, else None, "loss": their mean or None}``.
    """
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    info, programs = _validated(schedule)
    if info["p"] != p:
        raise ScheduleError(f"the schedule has lists for {info['p']} ranks but the group has {p}")
    n_stages, m, split = info["n_stages"], info["m"], info["split"]
    mine = sorted({a.stage for a in schedule[rank]})
    if sorted(stages) != mine:
        raise ValueError(f"rank {rank} holds stages {mine} in this schedule; pass stages={{s: module}} for "
                         f"exactly those, got {sorted(stages)}")
    last = n_stages - 1
    if 0 in mine and (microbatches is None or len(microbatches) != m):
        raise ValueError(f"rank {rank} holds stage 0: pass microbatches=<list of the {m} input micro-batches>")
    if last in mine and (targets is None or len(targets) != m or loss_fn is None):
        raise ValueError(f"rank {rank} holds the last stage ({last}): pass targets=<list of the {m} target "
                         f"micro-batches> and loss_fn")
    device = _device(stages)
    comm = collectives._Group(group, transport) if p > 1 else None
    paired = comm is not None and comm.paired   # NCCL (or PairedP2P): the rounds of _programs
    header_mb = _header_microbatches(schedule, p, last)
    outbox: dict[tuple, torch.Tensor] = {}   # paired: (direction, stage, mb) -> what is still to be sent
    pending: dict[tuple, list] = {}          # unpaired: (direction, stage, mb) -> [(send's work, tensor)]
    inbox: dict[tuple, torch.Tensor] = {}    # (direction, stage, mb) -> what it received, until used
    known: dict[tuple, tuple] = {}           # (direction, sending stage) -> (dtype, shape), from headers
    sent: dict[tuple, tuple] = {}            # (direction, sending stage) -> (dtype, shape), as sent

    def tag(key, part):  # unpaired only: a tag per message (NCCL has none)
        direction, stage, mb = key
        return ((direction * 4096 + stage) * m + mb) * 2 + part

    def put(t, direction, stage, mb, dst):
        """A stage's output or input gradient for rank ``dst``: handed over if it is us, queued for its
        round (paired), or sent at once (unpaired: gloo buffers it), its header first when the
        receiver needs one."""
        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
            raise TypeError(f"a stage's output must be a floating tensor ({_DTYPES}) with at most "
                            f"{_HEADER - 2} dimensions, got {t.dtype} with shape {tuple(t.shape)}")
        meta = (t.dtype, tuple(t.shape))
        if sent.setdefault((direction, stage), meta) != meta:
            what = "output" if direction == 0 else "input gradient"
            raise ValueError(f"stage {stage}'s {what} for micro-batch {mb} is {meta[0]} {meta[1]}, but was "
                             f"{sent[(direction, stage)][0]} {sent[(direction, stage)][1]} for an earlier one: "
                             f"every micro-batch must have the same shape (use split_microbatches)")
        key = (direction, stage, mb)
        if dst == rank:
            inbox[key] = t
        elif paired:
            outbox[key] = t
        else:
            parts = (0, 1) if header_mb[(direction, stage)] == mb else (1,)
            pending[key] = [(comm.isend(b, dst, tag=tag(key, part)), b) for part in parts
                            for b in [_send(t, part)]]

    def take(direction, stage, mb, src):
        """What the action needs from rank ``src``: received in its round (paired), or now."""
        key = (direction, stage, mb)
        if key in inbox:
            return inbox.pop(key)
        if (direction, stage) not in known:
            h = _recv(0, None, device)
            comm.irecv(h, src, tag=tag(key, 0)).wait()
            known[(direction, stage)] = _read_header(h)
        t = _recv(1, known[(direction, stage)], device)
        comm.irecv(t, src, tag=tag(key, 1)).wait()
        return t

    def exchange(sends, recvs):
        """Post one round's messages as one exchange and wait for it (see :func:`_programs`)."""
        out = [(_send(outbox[msg[:3]], msg[3]), q) for q, msg in sends]
        bufs = [(_recv(msg[3], known.get(msg[:2]), device), q) for q, msg in recvs]
        comm.exchange(out, bufs).wait()
        for (_, msg) in sends:
            if msg[3] == 1:
                del outbox[msg[:3]]                              # sent: the receiver has it
        for (buf, _), (_, msg) in zip(bufs, recvs):
            if msg[3] == 0:
                known[msg[:2]] = _read_header(buf)
            else:
                inbox[msg[:3]] = buf

    def gradients_held():
        if paired:
            return sum(t.untyped_storage().nbytes() for (d, _, _), t in outbox.items() if d == 1)
        return sum(t.untyped_storage().nbytes() for (d, _, _), ws in pending.items() if d == 1 for _, t in ws)

    saved: dict[tuple, list] = {}  # (stage, mb) -> [input, output or loss, W's groups (split only)]
    losses = [None] * m
    for item in programs[rank]:
        if item[0] == "x":
            if paired:
                exchange(item[1], item[2])
            continue
        a = item[1]
        s, i = a.stage, a.microbatch
        for key in [k for k, ws in pending.items() if all(w.is_completed() for w, _ in ws)]:
            del pending[key]                                     # sent (NCCL reports it; gloo does not)
        span = trace.span(_EVENT_KIND[a.kind], str(a), stage=s, microbatch=i)
        if a.kind == "F":
            x = microbatches[i] if s == 0 else take(0, s - 1, i, stage_rank(s - 1, p))
            if s > 0:
                x.requires_grad_(True)
            with span:
                y = stages[s](x)
                if s == last:
                    loss = loss_fn(y, targets[i])
                    losses[i] = float(loss.detach())
                    y = loss / m
            if s != last:
                put(y, 0, s, i, stage_rank(s + 1, p))
            saved[(s, i)] = [x, y, None]
        elif a.kind == "B":
            x, y, _ = saved[(s, i)]
            g = None if s == last else take(1, s + 1, i, stage_rank(s + 1, p))
            # unpaired: stage s+1 sent this gradient after its forward of i, which received our
            # activation of i: that send has completed, so waiting for it returns at once
            for w, _ in pending.pop((0, s, i), []):
                w.wait()
            with span:
                if not split:
                    torch.autograd.backward(y, g)
                    gx = x.grad if s > 0 else None
                else:   # B alone: x's gradient, and the gradients W starts from (_backward_input)
                    params = [q for q in stages[s].parameters() if q.requires_grad]
                    gx, saved[(s, i)][2] = _backward_input(y, g, x if s > 0 else None, params)
            if s > 0:
                put(gx, 1, s, i, stage_rank(s - 1, p))
            if not split:
                del saved[(s, i)]
        else:  # W: the weight gradients of a split backward, from the gradients B captured where
            # the weight paths leave the input path (_backward_weight): B + W cost one backward
            x, y, weight_grads = saved.pop((s, i))
            with span:
                _backward_weight(weight_grads)
        # drop this action's references: what is alive is what is kept
        x = y = g = gx = loss = weight_grads = None
        if after_action is not None:
            after_action(a, gradients_held())
    for ws in pending.values():  # unpaired: gloo reports a send complete only when waited for
        for w, _ in ws:
            w.wait()
    if last not in mine:
        return {"losses": None, "loss": None}
    return {"losses": losses, "loss": sum(losses) / m}


# --------------------------------------------------------------------------- the production API
def torch_schedule(schedule: str, stages: dict[int, nn.Module], n_stages: int, n_microbatches: int,
                   loss_fn: Callable | None = None, group=None):
    """The ``torch.distributed.pipelining`` schedule object for this rank's ``stages`` (``{stage:
    module}``, stage ``s`` on rank ``s % p``): ``schedule`` is ``"gpipe"`` (``ScheduleGPipe``),
    ``"1f1b"`` (``Schedule1F1B``) or ``"interleaved"`` (``ScheduleInterleaved1F1B``). Build it once and
    call :func:`torch_pipeline_step` with it for every step (its first step also infers the shapes)."""
    from torch.distributed import pipelining as P

    classes = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved": P.ScheduleInterleaved1F1B}
    if schedule not in classes:
        raise ValueError(f"schedule must be one of {sorted(classes)}, got {schedule!r}")
    device = _device(stages)
    pstages = [P.PipelineStage(mod, s, n_stages, device, group=group) for s, mod in sorted(stages.items())]
    if schedule == "interleaved":
        sched = classes[schedule](pstages, n_microbatches, loss_fn=loss_fn)
    else:
        if len(pstages) != 1:
            raise ValueError(f"{schedule} holds one stage per rank; got {len(pstages)} (use 'interleaved')")
        sched = classes[schedule](pstages[0], n_microbatches, loss_fn=loss_fn)
    sched._course_stages = (0 in stages, (n_stages - 1) in stages)
    return sched


def torch_pipeline_step(schedule, stages: dict[int, nn.Module] | None = None, n_stages: int | None = None,
                        n_microbatches: int | None = None, batch: torch.Tensor | None = None,
                        target: torch.Tensor | None = None, loss_fn: Callable | None = None,
                        group=None) -> float | None:
    """One step with ``torch.distributed.pipelining`` (the production API). ``schedule`` is a name
    (``"gpipe"``, ``"1f1b"``, ``"interleaved"``: the schedule is built with :func:`torch_schedule` from
    ``stages``, ``n_stages``, ``n_microbatches``, ``loss_fn``, ``group``) or an object
    :func:`torch_schedule` returned (reused; the other arguments but ``batch``/``target`` are ignored).
    ``batch`` on stage 0's rank, ``target`` on the last stage's; torch splits them into micro-batches.
    Returns the mean micro-batch loss on the last stage's rank, else ``None``. Gradients are scaled by
    ``1/n_microbatches`` (torch's ``scale_grads=True``), as :func:`run_schedule`'s are."""
    if isinstance(schedule, str):
        if stages is None or n_stages is None or n_microbatches is None:
            raise ValueError("with a schedule name, pass stages, n_stages and n_microbatches")
        schedule = torch_schedule(schedule, stages, n_stages, n_microbatches, loss_fn, group)
    holds_first, holds_last = schedule._course_stages
    losses: list = []
    args = (batch,) if holds_first else ()
    kwargs = {}
    if holds_last:
        kwargs.update(target=target, losses=losses)
    schedule.step(*args, **kwargs)
    if not holds_last:
        return None
    return float(sum(float(x.detach()) for x in losses) / len(losses))
