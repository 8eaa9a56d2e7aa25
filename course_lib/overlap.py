"""Hiding communication behind computation (notebook 16).

A step whose communication waits for its computation, and the reverse, costs ``compute + comm``; a
step that runs them at once costs ``max(compute, comm)`` plus whatever cannot overlap. Overlap needs
*independent* work to run while bytes move, and where a layer has none, decomposition makes some:

* :func:`all_gather_matmul`: tensor parallelism's ``all_gather(x) @ w`` as ``t`` ring steps, each
  multiplying the chunk of rows it holds while that chunk travels on to the next rank (the
  *collective matmul*: Wang et al. 2023, "Overlap communication with dependent computation via
  decomposition in large deep learning models", ASPLOS '23, §3; PyTorch's async TP;
  the JAX scaling book's "collective matmul"). :func:`all_gather_then_matmul` is the plain layer.
* :func:`matmul_reduce_scatter`: the row-parallel twin, ``reduce_scatter(x @ w)``, whose partial
  sums travel the ring while the next chunk's partial product is computed;
  :func:`matmul_then_reduce_scatter` is the plain layer.
* :func:`expert_parallel_microbatches`: a toy expert-parallel layer over several micro-batches whose
  all-to-alls are in flight while another micro-batch computes (DualPipe's idea, DeepSeek-V3,
  arXiv:2412.19437, §3.2.1).
* :func:`overlap_stats`: compute, communication, hidden and exposed time of a rank's
  :mod:`course_lib.trace` events; :func:`split_comm` cuts its communication into the two, to draw.
* :func:`overlapped_step_time`: notebook 09's planner breakdown with overlap: step = the max of the
  parts that overlap + the exposed rest.
* :func:`gpu_overlap_slowdown`: on a CUDA GPU, how much slower a matmul runs while a copy or an
  all-reduce runs beside it (overlap is not free: both use the SMs and the memory bandwidth).

Every function takes its process group (``group=``) and an optional point-to-point ``transport``
(e.g. :class:`course_lib.netem.AsyncPacedTransport`, an emulated link) and ``mm`` (the function that
multiplies, default ``torch.matmul``; :class:`PacedMatmul` emulates a GPU's compute time), so the
emulation stays outside the technique. Buffers are allocated on the device of the inputs; messages go
through :class:`course_lib.collectives`' one posting place, paired send-before-receive as NCCL would
need them. Run on gloo/CPU only so far: no GPU or NCCL run of these layers yet.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from course_lib import collectives, trace
from course_lib._checks import _pos_int

__all__ = ["all_gather_matmul", "all_gather_then_matmul", "matmul_reduce_scatter",
           "matmul_then_reduce_scatter", "expert_parallel_microbatches", "PacedMatmul", "overlap_stats",
           "split_comm",
           "overlapped_step_time", "gpu_overlap_slowdown"]


# --------------------------------------------------------------------------- emulated compute
class PacedMatmul:
    """``torch.matmul(a, b)`` that takes at least ``seconds`` (it sleeps the rest): *emulated* compute.

    On a few shared CPU cores, real matmuls of several ranks compete with each other and with the
    communication threads; a sleeping rank uses no core, like a GPU busy with its kernel (notebooks 04,
    06 and 08 emulate compute the same way). ``seconds`` is per call, or per row of ``a`` with
    ``per_row=True`` (a chunk of ``n/t`` rows then takes ``1/t`` of the whole). The product is real."""

    def __init__(self, seconds: float, per_row: bool = False) -> None:
        if not (isinstance(seconds, (int, float)) and seconds >= 0):
            raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
        self.seconds, self.per_row = float(seconds), bool(per_row)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = torch.matmul(a, b)
        want = self.seconds * (a.shape[0] if self.per_row else 1)
        left = start + want - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    def __repr__(self) -> str:
        return f"PacedMatmul({self.seconds:g} s{' per row' if self.per_row else ''})"


# --------------------------------------------------------------------------- helpers
def _check_2d(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (rows, features), got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")


class _Comm:
    """One posted exchange, recorded in the active :class:`course_lib.trace.Recorder` (if any) as a
    ``comm`` event from its posting until ``wait()`` has returned."""

    def __init__(self, g, name: str, sends, recvs, tag: int) -> None:
        self._rec = trace.current()
        self._start = self._rec.now() if self._rec is not None else 0.0
        self._name = name
        self._sent = sum(collectives._nbytes(t) for t, _ in sends)
        self._recv = sum(collectives._nbytes(t) for t, _ in recvs)
        self._posted = g.exchange(sends=sends, recvs=recvs, tag=tag)

    def wait(self) -> None:
        self._posted.wait()
        if self._rec is not None:
            self._rec.comm(self._name, self._sent, self._recv, self._start, self._rec.now())


# --------------------------------------------------------------------------- tensor parallelism
def all_gather_then_matmul(x: torch.Tensor, w: torch.Tensor, group=None, *, transport=None,
                           mm: Callable | None = None) -> torch.Tensor:
    """The plain column-parallel layer after sequence parallelism: gather every rank's rows, then one
    matmul. ``x``: ``(n/t, h)`` this rank's rows; ``w``: ``(h, f)`` this rank's columns of the weight.
    Returns ``(n, f)``: ``all_gather(x) @ w`` (rows in rank order). The gather is torch's own
    (``all_gather_single``) or, with a ``transport``, the course's ring through it."""
    _check_2d("x", x), _check_2d("w", w)
    mm = torch.matmul if mm is None else mm
    t = torch.distributed.get_world_size(group)
    full = torch.empty((t * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)    # (n, h)
    with trace.span("comm", "all-gather: x"):
        collectives.all_gather_single(full, x.contiguous(), group, builtin=transport is None,
                                      transport=transport)
    with trace.span("compute", "matmul: all rows"):
        return mm(full, w)                                                                # (n, f)


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group=None, *, transport=None,
                      mm: Callable | None = None) -> torch.Tensor:
    """``all_gather(x) @ w`` decomposed: the collective matmul (Wang et al. 2023, §3; async TP).

    ``x``: ``(n/t, h)`` this rank's rows (the sequence shard); ``w``: ``(h, f)`` this rank's columns.
    Returns ``(n, f)``, equal to :func:`all_gather_then_matmul`. In ``t`` steps, rank ``r`` holds the rows
    of rank ``(r - k) mod t`` at step ``k`` and multiplies them while passing them to rank ``r + 1`` and
    receiving the next ones from ``r - 1`` (``t - 1`` sends of ``n/t x h`` values), so each hop hides
    behind a partial product::

        step 0: [x_r] @ w      | send x_r   ->  recv x_{r-1}
        step 1: [x_{r-1}] @ w  | send x_{r-1} -> recv x_{r-2}
        ...     (t products of n/t rows; t - 1 hops)
    """
    _check_2d("x", x), _check_2d("w", w)
    mm = torch.matmul if mm is None else mm
    g = collectives._Group(group, transport)
    t, r, rows = g.size, g.rank, x.shape[0]
    out = torch.empty((t * rows, w.shape[1]), dtype=torch.result_type(x, w), device=x.device)    # (n, f)
    held = x.contiguous()                                                                  # (n/t, h)
    for k in range(t):
        src = (r - k) % t                                   # whose rows this rank holds now
        hop = None
        if k < t - 1:
            nxt = torch.empty_like(held)
            hop = _Comm(g, f"all_gather_matmul/step {k}", [(held, g.right())], [(nxt, g.left())], k)
        with trace.span("compute", f"matmul: rows of rank {src}"):
            out[src * rows:(src + 1) * rows] = mm(held, w)
        if hop is not None:
            hop.wait()
            held = nxt
    return out


def matmul_then_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group=None, *, transport=None,
                               mm: Callable | None = None) -> torch.Tensor:
    """The plain row-parallel layer before sequence parallelism: one matmul, then reduce-scatter the
    partial sums by rows. ``x``: ``(n, f)`` this rank's features of every row; ``w``: ``(f, h)`` this
    rank's rows of the weight. Returns ``(n/t, h)``: rows ``r n/t ...`` of ``sum_ranks x @ w``."""
    _check_2d("x", x), _check_2d("w", w)
    mm = torch.matmul if mm is None else mm
    t = torch.distributed.get_world_size(group)
    if x.shape[0] % t:
        raise ValueError(f"x has {x.shape[0]} rows, which do not split into t={t} equal chunks; "
                         f"pad the rows to a multiple of {t}")
    with trace.span("compute", "matmul: all rows"):
        partial = mm(x, w).contiguous()                                                   # (n, h)
    out = torch.empty((x.shape[0] // t, w.shape[1]), dtype=partial.dtype, device=partial.device)
    with trace.span("comm", "reduce-scatter: partial sums"):
        collectives.reduce_scatter_single(out, partial, "sum", group, builtin=transport is None,
                                          transport=transport)
    return out


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group=None, *, transport=None,
                          mm: Callable | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ w)`` decomposed (Wang et al. 2023, §3; async TP's matmul + reduce-scatter).

    ``x``: ``(n, f)``, ``w``: ``(f, h)``; returns ``(n/t, h)``, equal to
    :func:`matmul_then_reduce_scatter` up to the order of the additions. The partial sum of row chunk
    ``c`` starts on rank ``c + 1`` and travels right, each rank adding its own product, until it ends
    on rank ``c`` after ``t - 1`` hops; while one partial sum is in flight the rank computes the
    product it will add to the next one::

        rank r, step k:  send acc (chunk r-k) -> r+1   |  p = x[chunk r-1-k] @ w  |  acc = recv + p
    """
    _check_2d("x", x), _check_2d("w", w)
    mm = torch.matmul if mm is None else mm
    g = collectives._Group(group, transport)
    t, r = g.size, g.rank
    if x.shape[0] % t:
        raise ValueError(f"x has {x.shape[0]} rows, which do not split into t={t} equal chunks; "
                         f"pad the rows to a multiple of {t}")
    chunks = x.split(x.shape[0] // t)                     # t chunks of (n/t, f)
    c = (r - 1) % t
    with trace.span("compute", f"matmul: chunk {c}"):
        acc = mm(chunks[c], w).contiguous()               # (n/t, h), the partial sum of chunk r-1
    for k in range(1, t):
        c = (r - 1 - k) % t                               # the chunk whose partial sum arrives now
        recv = torch.empty_like(acc)
        hop = _Comm(g, f"matmul_reduce_scatter/step {k}", [(acc, g.right())], [(recv, g.left())], k)
        with trace.span("compute", f"matmul: chunk {c}"):
            mine = mm(chunks[c], w)                       # overlaps the hop
        hop.wait()
        acc = recv + mine
    return acc


# --------------------------------------------------------------------------- expert parallelism
def _post_all_to_all(g, inp: torch.Tensor, name: str, tag: int) -> tuple[torch.Tensor, _Comm]:
    """Post an all-to-all of ``inp``'s ``t`` equal row blocks (block j to rank j) and return the output
    buffer (block i from rank i) and the handle; nothing waits here."""
    out = torch.empty_like(inp)
    src, dst = inp.chunk(g.size), out.chunk(g.size)
    dst[g.rank].copy_(src[g.rank])
    others = [j for j in range(g.size) if j != g.rank]
    return out, _Comm(g, name, [(src[j], j) for j in others], [(dst[j], j) for j in others], tag)


def expert_parallel_microbatches(xs: Sequence[torch.Tensor], w_pre: torch.Tensor, w_expert: torch.Tensor,
                                 group=None, *, overlap: bool = True, transport=None,
                                 mm: Callable | None = None) -> list[torch.Tensor]:
    """A toy expert-parallel layer over micro-batches, with its all-to-alls hidden or not.

    Per micro-batch ``x`` ``(n, h)`` (``n`` divisible by ``t``): ``a = x @ w_pre`` (stands in for the
    attention before the MoE FFN), **dispatch** (all-to-all: row block j goes to rank j, whose expert is
    ``w_expert``, ``(h, h)``), ``e = recv @ w_expert``, **combine** (all-to-all back). Returns each
    micro-batch's ``(n, h)`` output: block j is ``(x @ w_pre)[block j] @ w_expert of rank j``.

    ``overlap=False``: one micro-batch after the other, each all-to-all waited for at once.
    ``overlap=True``: micro-batch i + 1's compute runs while i's all-to-all is in flight (DualPipe's
    pairing of one micro-batch's communication with another's computation, DeepSeek-V3 §3.2.1, here
    forward only and at toy size)::

        pre 0 | pre 1      | expert 0   | expert 1
              | dispatch 0 | dispatch 1 | combine 0 | combine 1
    """
    if not xs:
        raise ValueError("xs is empty; pass a list of micro-batches, each (n, h)")
    _check_2d("w_pre", w_pre), _check_2d("w_expert", w_expert)
    mm = torch.matmul if mm is None else mm
    g = collectives._Group(group, transport)
    for i, x in enumerate(xs):
        _check_2d(f"xs[{i}]", x)
        if x.shape[0] % g.size:
            raise ValueError(f"xs[{i}] has {x.shape[0]} rows, which do not split into {g.size} equal "
                             f"blocks (one per expert rank); pad the rows to a multiple of {g.size}")
    n = len(xs)

    def pre(i):
        with trace.span("compute", f"pre {i}"):
            return mm(xs[i], w_pre).contiguous()

    def expert(i, tokens):
        with trace.span("compute", f"expert {i}"):
            return mm(tokens, w_expert).contiguous()

    if not overlap:
        outs = []
        for i in range(n):
            recv, hop = _post_all_to_all(g, pre(i), f"all-to-all: dispatch {i}", 2 * i)
            hop.wait()
            back, hop = _post_all_to_all(g, expert(i, recv), f"all-to-all: combine {i}", 2 * i + 1)
            hop.wait()
            outs.append(back)
        return outs
    dispatched = []
    for i in range(n):                        # pre(i + 1) runs while dispatch(i) is in flight
        dispatched.append(_post_all_to_all(g, pre(i), f"all-to-all: dispatch {i}", 2 * i))
    combined = []
    for i, (recv, hop) in enumerate(dispatched):    # expert(i + 1) runs while combine(i) is in flight
        hop.wait()
        combined.append(_post_all_to_all(g, expert(i, recv), f"all-to-all: combine {i}", 2 * i + 1))
    outs = []
    for back, hop in combined:
        hop.wait()
        outs.append(back)
    return outs


# --------------------------------------------------------------------------- reading a timeline
def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(u, v) -> float:
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_stats(events: Sequence[dict]) -> dict:
    """Seconds of one rank's :mod:`course_lib.trace` events: ``compute`` (the union of its ``compute``
    spans), ``comm`` (of its ``comm`` spans: from posting to the end of the wait), ``hidden`` (comm
    while computing), ``exposed`` (comm while not computing: what overlap did not hide), ``span`` (first
    start to last end) and ``hidden_fraction`` (hidden / comm; 0 without communication)."""
    comp = _union((e["start"], e["end"]) for e in events if e["kind"] == "compute")
    comm = _union((e["start"], e["end"]) for e in events if e["kind"] == "comm")
    if not comp and not comm:
        raise ValueError("no compute or comm events; record them with trace.Recorder")
    both = comp + comm
    hidden = _intersection(comp, comm)
    c = _length(comm)
    return {"compute": _length(comp), "comm": c, "hidden": hidden, "exposed": c - hidden,
            "span": max(b for _, b in both) - min(a for a, _ in both),
            "hidden_fraction": hidden / c if c else 0.0}


def split_comm(events: Sequence[dict]) -> list[dict]:
    """One rank's communication as pieces to draw: the union of its ``comm`` events cut into
    ``kind="hidden comm"`` (while a ``compute`` event runs) and ``kind="exposed comm"`` (while none does).
    Returns new event dicts (``rank``, ``kind``, ``name``, ``start``, ``end``), in time order."""
    comp = _union((e["start"], e["end"]) for e in events if e["kind"] == "compute")
    rank = next((e.get("rank", 0) for e in events), 0)
    out = []
    for a, b in _union((e["start"], e["end"]) for e in events if e["kind"] == "comm"):
        t = a
        for c, d in comp:
            if d <= t or c >= b:
                continue
            if c > t:
                out.append(dict(rank=rank, kind="exposed comm", name="exposed", start=t, end=c))
            out.append(dict(rank=rank, kind="hidden comm", name="hidden", start=max(t, c), end=min(b, d)))
            t = min(b, d)
        if t < b:
            out.append(dict(rank=rank, kind="exposed comm", name="exposed", start=t, end=b))
    return out


# --------------------------------------------------------------------------- the planner with overlap
def overlapped_step_time(breakdown: dict, layout, hide: Sequence[str] = ("tp", "dp"),
                         backward_share: float = 2 / 3, buckets: int | None = None,
                         bucket_latency: float = 0.0) -> dict:
    """Notebook 09's step time (:func:`course_lib.planner.layout_step_time`'s ``breakdown`` of ``layout``)
    when communication overlaps: step = the max of the parts that run at once + the exposed rest.

    * ``"tp"`` in ``hide`` (collective matmul / async TP): a micro-batch's slot is
      ``max(compute, tp)`` instead of their sum, in the ``m`` slots and in the ``pp - 1`` of the bubble;
    * ``"dp"`` in ``hide`` (DDP's buckets, ZeRO's reduce-scatters launched during the backward): the
      gradient all-reduce runs during the last micro-batch's backward, ``backward_share`` of its compute
      (2/3: the backward does twice the forward's FLOPs), and only the rest is exposed. With
      ``buckets=None`` the gradients stream out as the backward makes them (exposed: ``dp`` minus that
      backward, or nothing); with ``buckets=k`` (one all-reduce per block, as
      :class:`~course_lib.hybrid_gpt.HybridGPT` with ``overlap_dp=True`` sends them) bucket ``j`` is
      ready after ``j/k`` of that backward, the buckets travel one after another, each taking
      ``(dp - bucket_latency) / k + bucket_latency`` (``bucket_latency``: what every all-reduce costs
      whatever its size, ``2 (N-1) alpha`` for a ring, counted once in ``dp``), and the last bucket,
      ready only when the backward ends, is always exposed;
    * the pipeline's hops stay exposed (the fill and drain are on the critical path; overlapping the
      steady state's is a further refinement), and so does context parallelism's ring (``cp``, when the
      breakdown has it: each bubble slot keeps its cp time as the planner's does).

    Returns the breakdown's keys with ``tp`` and ``dp`` replaced by their exposed seconds, plus
    ``hidden`` (seconds saved) and ``step``. Assumes overlap is free: on GPUs it is not (the notebook)."""
    unknown = set(hide) - {"tp", "dp"}
    if unknown:
        raise ValueError(f"hide may name 'tp' and 'dp', got {sorted(unknown)}")
    missing = {"compute", "tp", "pp", "bubble", "dp", "step"} - set(breakdown)
    if missing:
        raise ValueError(f"breakdown lacks {sorted(missing)}; pass planner.layout_step_time(...)'s dict")
    if not 0 <= backward_share <= 1:
        raise ValueError(f"backward_share is a fraction in [0, 1], got {backward_share!r}")
    if buckets is not None:
        buckets = _pos_int("buckets", buckets)
    if not bucket_latency >= 0:
        raise ValueError(f"bucket_latency is seconds >= 0, got {bucket_latency!r}")
    m, pp = _pos_int("layout.m", layout.m), _pos_int("layout.pp", layout.pp)
    t_mb, tp_mb = breakdown["compute"] / m, breakdown["tp"] / m
    slot = max(t_mb, tp_mb) if "tp" in hide else t_mb + tp_mb
    dp, backward = breakdown["dp"], backward_share * t_mb      # the last micro-batch's backward
    if "dp" in hide and dp > 0:
        if buckets is None:
            dp = max(0.0, dp - backward)
        else:
            each, done = max(dp - bucket_latency, 0.0) / buckets + bucket_latency, 0.0
            for j in range(1, buckets + 1):                     # bucket j ready at j/k of the backward
                done = max(done, j / buckets * backward) + each
            dp = done - backward
    cp = breakdown.get("cp", 0.0)                             # the ring's exposed time (notebook 15)
    out = {"compute": breakdown["compute"], "tp": m * slot - breakdown["compute"], "pp": breakdown["pp"],
           "bubble": (pp - 1) * (slot + cp / m), "dp": dp}
    if "cp" in breakdown:
        out["cp"] = cp
    out["step"] = sum(out.values())
    out["hidden"] = breakdown["step"] - out["step"]
    return out


# --------------------------------------------------------------------------- what overlap costs on a GPU
def gpu_overlap_slowdown(n: int = 8192, copy_bytes: int = 1 << 30, group=None, repeats: int = 20,
                         device=None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """How much slower ``repeats`` matmuls of ``n x n`` run on a CUDA GPU while other work runs beside
    them on a second stream. Needs a CUDA GPU (raises ``RuntimeError`` elsewhere).

    Returns seconds per matmul ``alone``, and the slowdown (time / alone) ``with_d2d_copy`` (a
    device-to-device copy of ``copy_bytes``: memory bandwidth), ``with_h2d_copy`` (pinned host to device:
    the copy engines, little SM work) and, when ``group`` is an NCCL group of several ranks (every rank
    calls this together), ``with_all_reduce`` (an all-reduce of ``copy_bytes``: NCCL's kernels take SMs
    and bandwidth). The side work is queued repeatedly so that it outlasts the matmuls (1.5 times their
    time alone); CUDA events time the matmuls on their own stream. DeepSeek-V3 (arXiv:2412.19437, §3.2.2
    and §3.5.1) gives 20 of an H800's 132 SMs to communication for this reason. Written for a GPU and
    never run on one by the course's tests (they check only its refusal on a machine without CUDA)."""
    import torch.distributed as dist

    n, repeats = _pos_int("n", n), _pos_int("repeats", repeats)
    copy_bytes = _pos_int("copy_bytes", copy_bytes)
    if not torch.cuda.is_available():
        raise RuntimeError("gpu_overlap_slowdown measures a CUDA GPU, and torch.cuda.is_available() is False "
                           "here (no GPU, or a CPU-only torch); run it on a machine with an NVIDIA GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = src.cpu().pin_memory()                     # page-locked host memory: the copy engines' source
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)

    def matmuls() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for _ in range(repeats):
            torch.matmul(a, b)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats

    def once(work) -> float:                         # seconds one piece of side work takes alone
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            work()
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def beside(work) -> float:
        # queue enough side work to outlast the matmuls (1.5 times their time alone), then time them
        times = max(1, math.ceil(1.5 * repeats * alone / max(once(work), 1e-6)))
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            for _ in range(times):
                work()
        out = matmuls()
        torch.cuda.synchronize(device)
        return out

    matmuls()                                          # warm-up: cuBLAS heuristics, clocks
    alone = min(matmuls() for _ in range(3))
    out = {"alone": alone,
           "with_d2d_copy": beside(lambda: dst.copy_(src, non_blocking=True)) / alone,
           "with_h2d_copy": beside(lambda: dst.copy_(host, non_blocking=True)) / alone}
    if group is not None and dist.get_backend(group) == "nccl" and dist.get_world_size(group) > 1:
        buf = torch.ones(copy_bytes // 2, dtype=torch.bfloat16, device=device)
        # every rank queues the same number of all-reduces: agree on it (the largest any rank wants)
        one = once(lambda: dist.all_reduce(buf, group=group))
        count = torch.tensor([math.ceil(1.5 * repeats * alone / max(one, 1e-6))], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(int(count.item()))]
        out["with_all_reduce"] = matmuls() / alone
        for w in works:
            w.wait()
        torch.cuda.synchronize(device)
    return out
