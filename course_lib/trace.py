"""Communication and timing accounting for one rank.

A :class:`Recorder` is used *inside* a worker (one OS process = one rank). While it is active,
:func:`current` returns it, and the from-scratch collectives in :mod:`course_lib.collectives`
report every point-to-point transfer to it (bytes sent, bytes received, start, end). Code can also
time its own phases with :meth:`Recorder.span`. The events are plain dicts, so a worker can return
``rec.events`` to the caller, which plots them with :func:`course_lib.viz.plot_timeline`::

    def work(rank, world_size):
        with trace.Recorder() as rec:
            with rec.span("compute", "forward"):
                ...
            ring_all_reduce(grad)          # adds "comm" events with their bytes
        return rec.events, rec.totals()

Clocks. ``time.perf_counter`` is precise but each process has its own origin, so values from two
ranks cannot be compared. Every ``start``/``end`` stored here is therefore **wall-clock seconds
since the epoch** (the ``time.time()`` scale) measured with perf_counter precision:
``start = perf_counter() + offset`` where ``offset = time.time() - perf_counter()`` is taken once
when the recorder is entered. All ranks of the virtual cluster share one machine clock, so their
events line up on one axis. Use :meth:`Recorder.now` to read that clock.

Event dict keys: ``rank, kind, name, start, end, bytes_sent, bytes_recv`` (plus any extra keyword
given to :meth:`Recorder.comm`, e.g. ``peer``).

Kinds. ``kind`` says what the time was spent on, ``name`` which operation it was:

* ``"compute"``: a phase of computation, e.g. ``span("compute", "route")``;
* ``"comm"``: communication, at two levels. A collective of a layer or optimizer (tensor parallelism,
  ZeRO, expert parallelism) is one span named ``"<operation>: <what>"``, e.g.
  ``span("comm", "all-reduce: g forward")`` or ``"all-to-all: dispatch"``; inside it, the course's own
  collectives record every transfer with :meth:`Recorder.comm`, named ``"<algorithm>/<step>"``
  (``"ring_all_reduce/reduce-scatter step 0"``) and carrying its bytes. Keep one level or the other
  by the name (``": "`` for the collective, ``"/"`` for the transfers);
* ``"forward"``, ``"backward"``, ``"weight"``: compute of one pipeline action (:mod:`course_lib.pipeline`),
  kinds of their own because :func:`course_lib.viz.plot_pipeline` and
  :func:`course_lib.pipeline.bubble_fraction` tell them apart.

Other text is allowed (a notebook may relabel events to draw them); :func:`course_lib.viz.plot_timeline`
gives each kind of this vocabulary a fixed colour and any other kind the next free one.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

__all__ = ["Recorder", "current", "span"]

# Innermost active recorder last. A list (not a single global) so recorders can nest; only the
# innermost one receives reports, so a nested measurement does not double-count in the outer one.
_ACTIVE: list["Recorder"] = []

# perf_counter() on Linux/macOS counts from boot (or process start on Windows), far below the
# epoch-based time.time() (~1.7e9 s). A value under this threshold can only be a perf_counter
# reading, so rec.comm() accepts either clock (both appear in callers' code) and converts.
_EPOCH_THRESHOLD = 1.0e9


def current() -> "Recorder | None":
    """The innermost active :class:`Recorder` of this process, or ``None`` when none is active."""
    return _ACTIVE[-1] if _ACTIVE else None


def span(kind: str, name: str, **extra):
    """:meth:`Recorder.span` of the active recorder, or a no-op context when none is active: library code
    times its phases with ``with trace.span("compute", "forward"): ...`` whether or not anyone records."""
    rec = current()
    return rec.span(kind, name, **extra) if rec is not None else contextlib.nullcontext()


class Recorder:
    """Record per-rank events (compute spans and communication transfers) while active.

    Args:
        rank: the rank stamped on every event. ``None`` (default) reads ``dist.get_rank()`` when a
            default process group is initialised, else 0 (single-process use).

    Attributes:
        events: list of event dicts (see the module docstring), in the order they were recorded.
    """

    def __init__(self, rank: int | None = None) -> None:
        self._rank_arg = rank
        self.rank: int = 0 if rank is None else int(rank)
        self.events: list[dict] = []
        self._n_comm = 0
        self._offset = time.time() - time.perf_counter()

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if self._rank_arg is None:
            self.rank = _default_rank()
        # Re-sync the clock offset on entry: a recorder created long before use stays accurate.
        self._offset = time.time() - time.perf_counter()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        # Remove this recorder even if an inner one was left active by an exception.
        if self in _ACTIVE:
            idx = len(_ACTIVE) - 1 - _ACTIVE[::-1].index(self)
            del _ACTIVE[idx:]

    # -- clock -----------------------------------------------------------------------------
    def now(self) -> float:
        """Current time on this recorder's clock: wall-clock seconds with perf_counter precision."""
        return time.perf_counter() + self._offset

    def _to_wall(self, t: float) -> float:
        return t + self._offset if t < _EPOCH_THRESHOLD else t

    # -- recording -------------------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, kind: str, name: str, **extra) -> Iterator[None]:
        """Time the ``with`` block and record it as one event of ``kind`` (e.g. ``"compute"``).

        ``**extra`` keys are stored in the event too (e.g. ``microbatch=3, stage=1`` for a pipeline
        action, which :func:`course_lib.viz.plot_pipeline` colours by micro-batch)."""
        start = self.now()
        try:
            yield
        finally:
            ev = dict(rank=self.rank, kind=str(kind), name=str(name), start=start, end=self.now(),
                      bytes_sent=0, bytes_recv=0)
            ev.update(extra)
            self.events.append(ev)

    def comm(self, name: str, bytes_sent: int, bytes_recv: int, start: float, end: float,
             **extra) -> None:
        """Record one communication event.

        Args:
            name: what was communicated, e.g. ``"ring_all_reduce/reduce_scatter step 1"``.
            bytes_sent, bytes_recv: payload bytes this rank sent / received (``numel * element_size``).
            start, end: times from :meth:`now` or ``time.time()``; ``time.perf_counter()``
                readings are accepted too and converted to the wall-clock scale.
            **extra: optional extra keys stored in the event (e.g. ``peer=3``).
        """
        if bytes_sent < 0 or bytes_recv < 0:
            raise ValueError(f"byte counts must be >= 0, got bytes_sent={bytes_sent}, "
                             f"bytes_recv={bytes_recv}")
        start, end = self._to_wall(float(start)), self._to_wall(float(end))
        if end < start:
            raise ValueError(f"event {name!r} ends ({end}) before it starts ({start}); pass times "
                             "from the same clock (rec.now(), time.time() or time.perf_counter())")
        ev = dict(rank=self.rank, kind="comm", name=str(name), start=start, end=end,
                  bytes_sent=int(bytes_sent), bytes_recv=int(bytes_recv))
        ev.update(extra)
        self.events.append(ev)
        self._n_comm += 1

    def totals(self) -> dict:
        """``{"bytes_sent", "bytes_recv", "n_comm"}`` summed over the events recorded with :meth:`comm`."""
        return {
            "bytes_sent": sum(e["bytes_sent"] for e in self.events),
            "bytes_recv": sum(e["bytes_recv"] for e in self.events),
            "n_comm": self._n_comm,
        }

    def clear(self) -> None:
        """Forget all events (e.g. after a warm-up iteration)."""
        self.events.clear()
        self._n_comm = 0

    def __repr__(self) -> str:
        t = self.totals()
        return (f"Recorder(rank={self.rank}, events={len(self.events)}, "
                f"bytes_sent={t['bytes_sent']}, bytes_recv={t['bytes_recv']})")


def _default_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency, but trace itself does not need it
        return 0
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
