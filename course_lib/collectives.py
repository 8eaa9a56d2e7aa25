"""Collective operations from scratch, on ``torch.distributed`` point-to-point (``isend``/``irecv``).

What is here, and what it reproduces:

================================  =====================================  ============================
function                          algorithm                              production counterpart
================================  =====================================  ============================
``naive_all_reduce``              everyone -> root, root sums, root ->   ``dist.all_reduce``
                                  everyone
``ring_reduce_scatter``           N-1 ring steps, add while passing      ``dist.reduce_scatter``,
                                                                         ``dist.reduce_scatter_tensor``
``ring_all_gather``               N-1 ring steps, copy while passing     ``dist.all_gather``,
                                                                         ``dist.all_gather_into_tensor``
``ring_all_reduce``               ring reduce-scatter, then ring         ``dist.all_reduce``
                                  all-gather
``plain_ring_all_reduce``         the same ring, one whole chunk per     ``dist.all_reduce``
                                  step (the shortest version to read)
``all_to_all``                    N-1 pairwise exchange steps            ``dist.all_to_all``
================================  =====================================  ============================

One place chooses between the course's collective and torch's own (``builtin=True``), for every module
that offers the choice (ZeRO, tensor parallelism, mixture of experts, the hybrid mesh):
:func:`all_reduce`, :func:`all_gather_single`, :func:`reduce_scatter_single` and
:func:`all_to_all_single`, with the semantics of the ``torch.distributed`` function of the same name
(torch >= 2.13 names; :mod:`course_lib.compat` calls the older ones where needed).

Conventions (as in ``torch.distributed``): every rank of ``group`` calls the function with tensors
of the same shape and dtype; results are written **in place** into the tensors passed (the
functions also return them, for convenience); ``group=None`` means the default (world) group and
ranks inside a group are group ranks, mapped to global ranks for point-to-point with
``dist.get_global_rank``. ``op`` is ``"sum"`` or ``"avg"`` (or ``dist.ReduceOp.SUM``/``AVG``).

Uneven lengths. A flat tensor of ``n`` elements is cut into ``N = world_size`` contiguous chunks with
the boundaries of ``torch.tensor_split(x, N)``: the first ``n % N`` chunks hold ``n // N + 1``
elements, the others ``n // N`` (some may be empty when ``n < N``; empty chunks are never sent).

Cost (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009, Sec. 3; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 2005, Sec. 4). For ``n`` bytes on ``N`` ranks, every rank of the ring
all-reduce sends and receives ``2 (N-1)/N * n`` bytes in ``2 (N-1)`` steps; the naive root sends
and receives ``(N-1) * n`` bytes. Under the alpha-beta model (a message of ``m`` bytes costs
``alpha + m * beta``)::

    t_ring  = 2 (N-1) alpha + 2 (N-1)/N * n * beta
    t_naive = 2 (N-1) alpha + 2 (N-1)   * n * beta      (the root handles N-1 messages each way)

Accounting. When a :class:`course_lib.trace.Recorder` is active in the calling rank, every
transfer (one ring step, one message to or from the root, ...) is recorded with its bytes and times.

Deadlock avoidance. In every step a rank posts its ``irecv`` and ``isend`` together and only then
waits on both: if every rank first did a blocking ``send``, all ranks could block waiting for a
receiver (a cycle), which is legal MPI-style behaviour for large messages. "Together" means one
``dist.batch_isend_irecv`` (:meth:`_Group.exchange`, which the pipeline runner posts through too):
NCCL runs a rank's point-to-point operations one after another on one stream, so a receive and a
send posted separately could each wait for the other; in one batch they progress at once (as in
``torch.distributed.pipelining`` and Megatron-LM).

Matching. No tags: NCCL ignores them. Between two ranks, messages are matched in the order they were
posted, and every function here posts them in the same order on the sending and the receiving side.

Devices. Every buffer is allocated on the device of the tensors it serves (CUDA tensors under NCCL,
CPU tensors under gloo); one exchange refuses tensors on two devices, and CPU tensors under NCCL.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from course_lib import compat, trace

__all__ = [
    "chunk_bounds",
    "naive_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "plain_ring_all_reduce",
    "all_to_all",
    "ring_all_reduce_bytes",
    "naive_all_reduce_bytes",
    "free_scratch",
    "comm_device",
    "PairedP2P",
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
]

# A hook called after each ring step: hook(phase, step, flat_buffer). The notebook uses it to
# snapshot the chunks of a real run for the step-through figure.
StepHook = Callable[[str, int, torch.Tensor], None]

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                     torch.int32, torch.int64)


# ------------------------------------------------------------------------------------------
# small helpers: chunking, argument checks, group ranks, accounting
# ------------------------------------------------------------------------------------------
def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the ``world_size`` chunks of a length-``numel`` vector.

    Same boundaries as ``torch.tensor_split(torch.arange(numel), world_size)``: the first
    ``numel % world_size`` chunks get one extra element.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(int(numel), world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: ``2 (N-1)/N * nbytes``.

    Source: Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", section 3. A float (the planner's byte counts are fractions of a byte per value);
    round it to count whole bytes, as :mod:`course_lib.data_parallel` does to account the traffic of
    ``dist.all_reduce``, whose internal algorithm the backend chooses (so the bandwidth-optimal
    estimate, not a wire capture)."""
    return 2 * (world_size - 1) / world_size * nbytes


def naive_all_reduce_bytes(nbytes: int, world_size: int) -> dict:
    """Bytes sent per rank by the naive all-reduce: ``{"root": (N-1) n, "other": n}`` (each way)."""
    return {"root": (world_size - 1) * nbytes, "other": nbytes if world_size > 1 else 0}


def _parse_op(op) -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("avg", "mean", dist.ReduceOp.AVG):
        return "avg"
    raise ValueError(f"unknown reduction op {op!r}; use 'sum' or 'avg' "
                     "(or dist.ReduceOp.SUM / dist.ReduceOp.AVG)")


def _check_tensor(t, what: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         "the collective writes its result in place into the tensor's memory, so "
                         "pass a contiguous tensor (e.g. x = x.contiguous()) and use that one")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {t.dtype}; supported: "
                        + ", ".join(str(d) for d in _SUPPORTED_DTYPES))


def _check_list(ts, n: int, what: str, dtype=None, device=None) -> None:
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{what} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != n:
        raise ValueError(f"{what} has {len(ts)} tensors but the group has world_size={n}; "
                         f"pass exactly one tensor per rank of the group")
    for i, t in enumerate(ts):
        _check_tensor(t, f"{what}[{i}]")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{what}[{i}] has dtype {t.dtype} but the other tensors have {dtype}; "
                            "use one dtype for all tensors of a collective")
        _check_device(t, device, f"{what}[{i}]")


def _check_device(t: torch.Tensor, device, what: str) -> None:
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device} but the other tensors of the collective are on "
                         f"{device}; put every tensor of a collective on one device (the rank's GPU "
                         "under NCCL, the CPU under gloo)")


def comm_device(group=None) -> torch.device:
    """The device whose tensors ``group``'s backend sends: the current CUDA device under NCCL (which
    sends GPU tensors only), the CPU otherwise. For the few tensors that follow no other tensor (a loss
    to average, a timing to compare); every other buffer takes the device of the tensors it serves."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Group:
    """This rank's view of a process group: its rank, the size, group rank -> global rank, and the one
    place that posts point-to-point messages (:meth:`exchange`)."""

    def __init__(self, group, transport=None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call "
                               "dist.init_process_group (course_lib.launch does it for you)")
        self.group = group
        # Point-to-point goes through ``transport`` (anything with torch.distributed's isend/irecv
        # signature, e.g. course_lib.netem.PacedTransport); torch.distributed itself by default.
        self.transport = dist if transport is None else transport
        for name in ("isend", "irecv"):
            if not callable(getattr(self.transport, name, None)):
                raise TypeError(f"transport must have isend(tensor, dst, group=, tag=) and irecv(tensor, "
                                f"src, group=, tag=) like torch.distributed; {transport!r} has no {name}")
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group; only "
                             "members may call a collective on it")
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        # NCCL needs paired exchanges (module docstring); a transport may ask for them on any backend
        # (:class:`PairedP2P`: NCCL's discipline on gloo, so that tests on CPUs run NCCL's code path)
        self.paired = self.backend == "nccl" or bool(getattr(self.transport, "paired", False))
        if group is None or group is dist.GroupMember.WORLD:
            self.global_ranks = list(range(self.size))
        else:
            self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]

    def right(self) -> int:  # the ring neighbour we send to
        return (self.rank + 1) % self.size

    def left(self) -> int:   # the ring neighbour we receive from
        return (self.rank - 1) % self.size

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0):
        """One send to group rank ``dst`` (unpaired: gloo; see :attr:`paired`)."""
        return self.transport.isend(t, self.global_ranks[dst], group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0):
        """One receive from group rank ``src`` (unpaired: gloo; see :attr:`paired`)."""
        return self.transport.irecv(t, self.global_ranks[src], group=self.group, tag=tag)

    def exchange(self, sends=(), recvs=(), tag: int = 0) -> "_Posted":
        """Post ``sends`` and ``recvs`` (each ``[(tensor, group rank)]``) together and return their
        handle: ``.wait()`` returns once all of them have completed. Empty tensors are skipped.

        Paired (:attr:`paired`: NCCL, or a transport that asks for it): one ``batch_isend_irecv`` of
        ``P2POp`` s when the transport has it (``torch.distributed`` has), the form NCCL needs (see the
        module docstring), with no tag (NCCL has none: between two ranks messages match in the order
        they are posted). Otherwise each is posted on its own, the receives first, with ``tag``.
        """
        ops = [(t, peer, False) for t, peer in recvs if t.numel() > 0]
        ops += [(t, peer, True) for t, peer in sends if t.numel() > 0]
        if not ops:
            return _Posted([], [])
        devices = sorted({str(t.device) for t, _, _ in ops})
        if len(devices) > 1:
            raise ValueError(f"one exchange holds tensors on {devices}: allocate every buffer on the device "
                             "of the tensors it serves, so that a collective's messages share one device")
        if self.backend == "nccl" and ops[0][0].device.type != "cuda":
            raise ValueError(f"NCCL sends CUDA tensors only, got a tensor on {devices[0]}; create the "
                             "collective's tensors on this rank's GPU (course_lib.launch.device())")
        batch = getattr(self.transport, "batch_isend_irecv", None) if self.paired else None
        if batch is not None:
            # P2POp accepts only torch's own isend/irecv objects (not wrappers such as CommMeter's),
            # which distributed_c10d always holds
            works = batch([dist.P2POp(_c10d.isend if is_send else _c10d.irecv, t, self.global_ranks[peer],
                                      self.group) for t, peer, is_send in ops])
        else:
            works = [(self.isend if is_send else self.irecv)(t, peer, 0 if self.paired else tag)
                     for t, peer, is_send in ops]
        return _Posted(works, [t for t, _, _ in ops])


class PairedP2P:
    """``torch.distributed``'s point-to-point, posted with NCCL's discipline on any backend: the
    course's collectives and the pipeline runner then take the code path they take under NCCL
    (paired exchanges in one ``batch_isend_irecv``, no tags, no receive posted ahead). Pass it as
    ``transport=`` on gloo to test that path on CPUs; under NCCL it is what happens anyway."""

    paired = True

    def isend(self, tensor, dst, group=None, tag=0):
        return dist.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src, group=None, tag=0):
        return dist.irecv(tensor, src, group=group, tag=tag)

    def batch_isend_irecv(self, ops):
        return dist.batch_isend_irecv(ops)

    def __repr__(self) -> str:
        return "PairedP2P()"


class _Posted:
    """The handle of one :meth:`_Group.exchange`. It keeps the tensors alive until :meth:`wait` (a
    backend may still read or write them), and waits for all of its operations together (NCCL
    reports one batch as one work)."""

    def __init__(self, works, tensors) -> None:
        self._works, self._tensors = works, tensors

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._tensors = [], []


# Receive buffers are reused between calls: a fresh multi-megabyte tensor costs a page fault per
# 4 KiB page on first touch, which measured ~20 ms per 32 MB here, a sizeable fraction of an
# all-reduce. Thread-local, so collectives called from two threads (e.g. a gradient hook) never
# share a buffer.
_SCRATCH = threading.local()


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 1-D buffer of at least ``numel`` elements of ``dtype`` on ``device`` (the device of the
    tensors it receives for: the rank's GPU under NCCL); contents undefined."""
    cache = getattr(_SCRATCH, "buffers", None)
    if cache is None:
        cache = _SCRATCH.buffers = {}
    key = (dtype, torch.device(device))
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def free_scratch() -> None:
    """Release this thread's cached receive buffers (they are kept to make repeated calls fast)."""
    _SCRATCH.buffers = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _exchange(g: _Group, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              name: str, rec, **extra) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``; either may be None/empty.

    Both operations are posted as one exchange before waiting on either (see the module docstring).
    """
    start = time.perf_counter() if rec is not None else 0.0
    g.exchange([(send, dst)] if send is not None else [], [(recv, src)] if recv is not None else []).wait()
    if rec is not None:
        sent = _nbytes(send) if send is not None else 0
        got = _nbytes(recv) if recv is not None else 0
        if sent or got:
            rec.comm(name, sent, got, start, time.perf_counter(), **extra)


def _check_avg(t: torch.Tensor, op: str) -> None:
    # Checked before any message is posted, so a bad call fails on every rank without leaving
    # half a collective in flight.
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"op='avg' needs a floating-point tensor, got {t.dtype}; use op='sum' and "
                        "divide yourself")


def _finish_avg(t: torch.Tensor, world_size: int) -> None:
    t.div_(world_size)


# ------------------------------------------------------------------------------------------
# naive all-reduce: the O(N) root bottleneck
# ------------------------------------------------------------------------------------------
def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, root: int = 0, *,
                     transport=None) -> torch.Tensor:
    """All-reduce through one root rank: gather to ``root``, sum there, send the result back.

    Args:
        tensor: this rank's contribution, any shape; overwritten with the result (in place).
        op: ``"sum"`` or ``"avg"``.
        group: process group (``None`` = default group); ``root`` is a rank *in that group*.
        transport: what carries the point-to-point messages (``None``: ``torch.distributed``);
            see :class:`course_lib.netem.PacedTransport`.

    Returns:
        ``tensor``. The root sends and receives ``(N-1) * nbytes``, every other rank ``nbytes``:
        the root's traffic grows linearly with N, which is the bottleneck the ring removes.
    """
    op = _parse_op(op)
    _check_tensor(tensor)
    _check_avg(tensor, op)
    g = _Group(group, transport)
    if not 0 <= root < g.size:
        raise ValueError(f"root={root} is not a rank of the group (world_size={g.size})")
    rec = trace.current()
    flat = tensor.view(-1)
    if g.size > 1 and flat.numel() > 0:
        if g.rank == root:
            # Post all receives at once (the root's link is the bottleneck, not the posting).
            scratch = _scratch((g.size - 1) * flat.numel(), flat.dtype, flat.device)
            others = [r for r in range(g.size) if r != root]
            bufs = {r: scratch[i * flat.numel():(i + 1) * flat.numel()] for i, r in enumerate(others)}
            start = time.perf_counter()
            works = [(r, g.exchange(recvs=[(bufs[r], r)])) for r in bufs]
            for r, w in works:
                w.wait()
                flat.add_(bufs[r])  # accumulate in the tensor's dtype, like the gloo reduction
                if rec is not None:
                    rec.comm(f"naive_all_reduce/gather from {r}", 0, _nbytes(flat), start,
                             time.perf_counter(), peer=g.global_ranks[r])
                    start = time.perf_counter()
            if op == "avg":
                _finish_avg(tensor, g.size)
            for r in range(g.size):
                if r != root:
                    _exchange(g, flat, r, None, r, f"naive_all_reduce/broadcast to {r}", rec,
                              peer=g.global_ranks[r])
        else:
            _exchange(g, flat, root, None, root, "naive_all_reduce/send to root", rec,
                      peer=g.global_ranks[root])
            _exchange(g, None, root, flat, root, "naive_all_reduce/recv from root", rec,
                      peer=g.global_ranks[root])
    elif op == "avg":
        _finish_avg(tensor, g.size)
    return tensor


# ------------------------------------------------------------------------------------------
# the plain ring: one whole chunk per step, the algorithm and nothing else
# ------------------------------------------------------------------------------------------
def plain_ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, *, transport=None) -> torch.Tensor:
    """Ring all-reduce in place, in its plainest form: 2(N-1) steps, one whole chunk per step.

    The flat tensor is cut into N chunks (``chunk_bounds``). In step t rank r sends chunk
    (r - t - 1) mod N to rank r+1 and receives chunk (r - t - 2) mod N from rank r-1: in the N-1
    reduce-scatter steps it *adds* what it receives (after them rank r holds the full sum of chunk
    r), in the N-1 all-gather steps it *copies* it. Patarasuk & Yuan, JPDC 2009, Sec. 3.
    Same result and arguments as :func:`ring_all_reduce` (which adds pipelining, tracing hooks and
    the step hook); ``op`` is ``"sum"`` or ``"avg"``.
    """
    op = _parse_op(op)
    _check_tensor(tensor)
    _check_avg(tensor, op)
    g = _Group(group, transport)
    N, r, flat, rec = g.size, g.rank, tensor.view(-1), trace.current()
    bounds = chunk_bounds(flat.numel(), N)
    buf = _scratch(max(hi - lo for lo, hi in bounds), flat.dtype, flat.device)
    for t in range(2 * (N - 1)):
        s_lo, s_hi = bounds[(r - t - 1) % N]  # the chunk we pass on ...
        r_lo, r_hi = bounds[(r - t - 2) % N]  # ... and the one we get from the left
        reduce = t < N - 1  # reduce-scatter: add what arrives; all-gather: receive in place
        got = buf[:r_hi - r_lo] if reduce else flat[r_lo:r_hi]
        _exchange(g, flat[s_lo:s_hi], g.right(), got, g.left(), f"plain_ring/step {t}", rec)
        if reduce:
            flat[r_lo:r_hi].add_(got)
    if op == "avg":
        _finish_avg(tensor, N)
    return tensor


# ------------------------------------------------------------------------------------------
# the ring: reduce-scatter and all-gather on chunks of one flat buffer
# ------------------------------------------------------------------------------------------
_MAX_PIECES = 1024


def _pieces(lo: int, hi: int, itemsize: int, pipeline_bytes: int) -> list[tuple[int, int]]:
    """Cut the chunk [lo, hi) into pieces of about ``pipeline_bytes`` (none when it is empty).

    The count depends only on the chunk, so the sender and the receiver of a chunk agree on it.
    """
    n = hi - lo
    if n == 0:
        return []
    k = 1 if pipeline_bytes <= 0 else max(1, min(_MAX_PIECES, n * itemsize // pipeline_bytes))
    return [(lo + a, lo + b) for a, b in chunk_bounds(n, k)]


def _ring(g: _Group, flat: torch.Tensor, bounds, *, n_steps: int, n_reduce: int, offset: int,
          name: str, rec, hook: StepHook | None, pipeline_bytes: int,
          finish: Callable[[torch.Tensor], None] | None = None) -> None:
    """Run ``n_steps`` ring steps on the chunks ``bounds`` of the flat vector ``flat``, in place.

    Step t: send chunk ``(rank - t - offset) mod N`` to the right neighbour, receive chunk
    ``(rank - t - offset - 1) mod N`` from the left one. In the first ``n_reduce`` steps the
    received values are *added* to ours (reduce-scatter), in the later ones they *replace* ours
    (all-gather). What a rank receives in step t is exactly what it sends in step t+1, so

    * reduce-scatter = ``offset=1``, N-1 steps, all reducing: the partial sum of chunk c starts at
      rank c+1 and travels N-1 hops, gaining one term per hop, to end complete at rank c;
    * all-gather = ``offset=0``, N-1 steps, none reducing: rank r's chunk r travels N-1 hops;
    * all-reduce = ``offset=1``, 2(N-1) steps, the first N-1 reducing: the two, back to back.

    Pipelining: a chunk travels as pieces of about ``pipeline_bytes`` (one piece when 0). As soon
    as piece k of step t has arrived (and been added), it is sent on as piece k of step t+1, while
    later pieces of step t are still in flight. This overlaps the additions with the transfers and
    keeps both links of every rank busy, as production rings do.

    Posting: on gloo the receives of step t+1 are posted before step t is consumed (tagged by step
    and piece), so a neighbour never waits for us; under NCCL (:attr:`_Group.paired`) each (step,
    piece) is one paired exchange instead, in the same order on every rank (see the code's comments).

    ``finish(piece)`` is applied to each piece of the chunk completed by the last reducing step
    before it is sent on (the division of ``op="avg"``). ``hook(phase, step, flat)`` is called
    after each step.
    """
    N, r = g.size, g.rank
    if N == 1 or n_steps == 0:
        return
    item = flat.element_size()

    def send_chunk(t):
        return (r - t - offset) % N

    def recv_chunk(t):
        return (r - t - offset - 1) % N

    def pieces(c):
        return _pieces(bounds[c][0], bounds[c][1], item, pipeline_bytes)

    # Two receive buffers: step t+1 receives into one while step t is consumed from the other.
    max_chunk = max(hi - lo for lo, hi in bounds)
    scratch = _scratch(2 * max_chunk, flat.dtype, flat.device)
    bufs = [scratch[:max_chunk], scratch[max_chunk:]]

    def in_place(t):
        # A copying step may receive straight into ``flat`` (saving a copy of every byte) when
        # nothing else touches that chunk meanwhile: with N = 2 the chunk received in step t is the
        # one sent in step t-1, whose later pieces may still be in flight; and a step hook must not
        # see the next step's data arrive early.
        return t >= n_reduce and N > 2 and hook is None

    def consume(t, a, b, buf):
        """Piece [a, b) of step t has arrived in ``buf``: add it (reducing steps) or keep it."""
        if t < n_reduce:
            flat[a:b].add_(buf)  # accumulate in the tensor's dtype, as gloo does
            if t == n_reduce - 1 and finish is not None:
                finish(flat[a:b])
        elif not in_place(t):
            flat[a:b].copy_(buf)

    def step_done(t, start):
        phase, step = ("reduce-scatter", t) if t < n_reduce else ("all-gather", t - n_reduce)
        if rec is not None:
            s_lo, s_hi = bounds[send_chunk(t)]
            r_lo, r_hi = bounds[recv_chunk(t)]
            rec.comm(f"{name}/{phase} step {step}", (s_hi - s_lo) * item, (r_hi - r_lo) * item,
                     start, time.perf_counter(), peer=g.global_ranks[g.right()], step=t)
        if hook is not None:
            hook(phase, step, flat)

    def recv_buffer(t, a, b):
        lo = bounds[recv_chunk(t)][0]
        return flat[a:b] if in_place(t) else bufs[t % 2][a - lo:b - lo]

    if not g.paired:
        # Receives posted one step ahead: the receives of step t+1 are posted before step t is
        # consumed, so a neighbour never waits for us to be ready; the piece's send is posted the
        # moment it is complete. A distinct tag per (step, piece) makes matching independent of how
        # far ahead a fast neighbour runs (messages with equal tags, from different calls, match in
        # order). Gloo allows all this; NCCL does not (the paired branch below).
        def post_recvs(t):
            return [(a, b, buf, g.irecv(buf, g.left(), tag=t * _MAX_PIECES + k))
                    for k, (a, b) in enumerate(pieces(recv_chunk(t))) for buf in [recv_buffer(t, a, b)]]

        def post_send(t, k, a, b):
            return g.isend(flat[a:b], g.right(), tag=t * _MAX_PIECES + k)

        recvs = post_recvs(0)
        sends = [post_send(0, k, a, b) for k, (a, b) in enumerate(pieces(send_chunk(0)))]
        for t in range(n_steps):
            start = time.perf_counter() if rec is not None else 0.0
            next_recvs = post_recvs(t + 1) if t + 1 < n_steps else []
            next_sends = []
            for k, (a, b, buf, work) in enumerate(recvs):
                work.wait()
                consume(t, a, b, buf)
                if t + 1 < n_steps:  # forward this piece at once: it is what step t+1 sends
                    next_sends.append(post_send(t + 1, k, a, b))
            for work in sends:
                work.wait()
            step_done(t, start)
            recvs, sends = next_recvs, next_sends
        return

    # Paired (NCCL): each (step, piece) is one exchange, the piece's send to the right and its
    # receive from the left posted together (:meth:`_Group.exchange`), in the same order on every
    # rank, so messages between neighbours match in order without tags, and the exchange (t, k) of
    # all ranks can always complete once every earlier one has. A receive cannot be posted ahead of
    # its step: under NCCL it would hold the stream until the neighbour's send of that step.
    def n_pieces(t):
        return max(len(pieces(recv_chunk(t))), len(pieces(send_chunk(t))))

    def post(t, k):
        """Piece k of step t as one exchange: returns ``(a, b, buffer)`` of its receive (``None`` when
        there is none) and the handle."""
        got, out = pieces(recv_chunk(t)), pieces(send_chunk(t))
        recv = (got[k][0], got[k][1], recv_buffer(t, *got[k])) if k < len(got) else None
        sends = [(flat[out[k][0]:out[k][1]], g.right())] if k < len(out) else []
        return recv, g.exchange(sends, [(recv[2], g.left())] if recv is not None else [])

    recvs = [post(0, k) for k in range(n_pieces(0))]  # step 0 sends the caller's data: post it all
    for t in range(n_steps):
        start = time.perf_counter() if rec is not None else 0.0
        more = t + 1 < n_steps
        next_recvs = []
        for k, (recv, work) in enumerate(recvs):
            work.wait()
            if recv is not None:
                consume(t, *recv)
            if more and k < n_pieces(t + 1):  # forward this piece at once: it is what step t+1 sends
                next_recvs.append(post(t + 1, k))
        if more:  # pieces of step t+1 beyond step t's: receives only
            next_recvs += [post(t + 1, k) for k in range(len(recvs), n_pieces(t + 1))]
        step_done(t, start)
        recvs = next_recvs


# Pieces of about this many bytes are pipelined through the ring (0: one message per chunk).
# Chosen by measurement (`python benchmarks/bench_collectives.py --profile`, 2-4 ranks, 1-64 MB, gloo
# over loopback on 2 cores, 2026-12-04): a ring step costs 0.27 ms with 2 ranks, 0.37 ms with 3 and
# 1.2 ms with 4 (a waiting rank must be scheduled again on oversubscribed cores) before any byte
# moves; at 64 MB the additions take 8-12 % of the time and the one copy of 2 ranks 9 %, and moving
# the bytes through TCP the rest (82-85 %). Everything here is CPU work on the same 2 cores, so
# there is nothing idle for pipelining to overlap with: pieces of 256 KiB made the ring 1.1-2.4x
# slower, pieces of 1 and 4 MiB differed from whole chunks by less than the benchmark's own noise
# (identical code paths timed 0.8-1.2x apart). So the default sends each chunk whole. On a real
# network with a separate NIC, pieces pay off (NCCL pipelines slices through its rings): pass
# pipeline_bytes explicitly.
DEFAULT_PIPELINE_BYTES = 0


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, *,
                    step_hook: StepHook | None = None,
                    pipeline_bytes: int = DEFAULT_PIPELINE_BYTES, transport=None) -> torch.Tensor:
    """Ring all-reduce in place: a ring reduce-scatter followed by a ring all-gather.

    Args:
        tensor: contiguous, any shape; every rank passes the same shape and dtype. Overwritten
            with the sum (or average) over the group's ranks.
        op: ``"sum"`` or ``"avg"`` (sum, then one division by N).
        group: process group (``None`` = default group).
        step_hook: optional ``hook(phase, step, flat)`` called after each of the 2(N-1) steps with
            the flat view of ``tensor`` (for teaching: snapshot it with ``flat.clone()``).
        pipeline_bytes: split each step's chunk into pieces of about this size so that adding
            one piece overlaps receiving the next; 0 sends each chunk as one message.
        transport: what carries the point-to-point messages (``None``: ``torch.distributed``).

    Returns:
        ``tensor``. Each rank sends and receives 2 (N-1)/N of the tensor's bytes in 2 (N-1) steps
        (Patarasuk & Yuan 2009, Sec. 3). Sums are accumulated in the tensor's dtype, like gloo;
        for bfloat16 the order of additions differs from ``dist.all_reduce`` so results can differ
        in the last bits.
    """
    op = _parse_op(op)
    _check_tensor(tensor)
    _check_avg(tensor, op)
    g = _Group(group, transport)
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), g.size)
    rec = trace.current()
    # Averaging divides only the chunk this rank completes, before the all-gather spreads it:
    # every element is divided exactly once, and each rank does 1/N of the divisions.
    finish = (lambda piece: _finish_avg(piece, g.size)) if op == "avg" else None
    _ring(g, flat, bounds, n_steps=2 * (g.size - 1), n_reduce=g.size - 1, offset=1,
          name="ring_all_reduce", rec=rec, hook=step_hook, pipeline_bytes=pipeline_bytes,
          finish=finish)
    return tensor


def ring_reduce_scatter(output: torch.Tensor, input, op="sum", group=None, *,
                        pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
                        transport=None) -> torch.Tensor:
    """Ring reduce-scatter: rank r ends with the reduction over ranks of input chunk r.

    Args:
        output: this rank's result tensor, written in place.
        input: either a list of ``world_size`` tensors (``dist.reduce_scatter`` semantics:
            ``output = sum over ranks of input[rank]``, so ``output`` must have ``input[rank]``'s
            number of elements), or one tensor whose flat view is cut into ``world_size`` chunks
            with ``torch.tensor_split`` boundaries (``dist.reduce_scatter_tensor`` semantics when
            the length divides; uneven lengths are allowed, and then ``output`` must have this
            rank's chunk length). ``input`` is not modified.
        op: ``"sum"`` or ``"avg"``.
        group: process group (``None`` = default group).
        pipeline_bytes, transport: as in :func:`ring_all_reduce`.

    Returns:
        ``output``. Each rank sends and receives (N-1)/N of the input's bytes.
    """
    op = _parse_op(op)
    _check_tensor(output, "output")
    _check_avg(output, op)
    g = _Group(group, transport)
    if isinstance(input, torch.Tensor):
        _check_tensor(input, "input")
        _check_device(input, output.device, "input")
        flat = input.reshape(-1).clone()  # work on a copy: torch leaves the input untouched too
        bounds = chunk_bounds(flat.numel(), g.size)
    else:
        _check_list(input, g.size, "input", dtype=output.dtype, device=output.device)
        sizes = [t.numel() for t in input]
        flat = torch.cat([t.reshape(-1) for t in input])
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        bounds = list(zip(offsets[:-1], offsets[1:]))
    if flat.dtype != output.dtype:
        raise TypeError(f"output has dtype {output.dtype} but input has {flat.dtype}; use one dtype")
    lo, hi = bounds[g.rank]
    if output.numel() != hi - lo:
        raise ValueError(f"output has {output.numel()} elements but rank {g.rank}'s chunk of the "
                         f"input has {hi - lo} (chunk boundaries {bounds}); allocate output with "
                         f"{hi - lo} elements")
    _ring(g, flat, bounds, n_steps=g.size - 1, n_reduce=g.size - 1, offset=1,
          name="ring_reduce_scatter", rec=trace.current(), hook=None,
          pipeline_bytes=pipeline_bytes)
    mine = flat[lo:hi]
    if op == "avg":
        _finish_avg(mine, g.size)
    output.view(-1).copy_(mine)
    return output


def ring_all_gather(output, input: torch.Tensor, group=None, *,
                    pipeline_bytes: int = DEFAULT_PIPELINE_BYTES, transport=None):
    """Ring all-gather: every rank ends with every rank's ``input``.

    Args:
        output: either a list of ``world_size`` tensors (``dist.all_gather`` semantics: output[i]
            receives rank i's input, so ``output[rank]`` must have ``input``'s number of
            elements; unlike gloo, the ranks' sizes may differ), or one tensor whose flat view is
            cut into ``world_size`` chunks with ``torch.tensor_split`` boundaries
            (``dist.all_gather_into_tensor`` semantics when the length divides).
        input: this rank's contribution (not modified).
        group: process group (``None`` = default group).
        pipeline_bytes, transport: as in :func:`ring_all_reduce`.

    Returns:
        ``output``. Each rank sends and receives (N-1)/N of the output's bytes.
    """
    _check_tensor(input, "input")
    g = _Group(group, transport)
    if isinstance(output, torch.Tensor):
        _check_tensor(output, "output")
        _check_device(output, input.device, "output")
        flat = output.view(-1)
        bounds = chunk_bounds(flat.numel(), g.size)
        tensors = None
    else:
        _check_list(output, g.size, "output", dtype=input.dtype, device=input.device)
        tensors = list(output)
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + t.numel())
        bounds = list(zip(offsets[:-1], offsets[1:]))
        flat = torch.empty(offsets[-1], dtype=input.dtype, device=input.device)
    if flat.dtype != input.dtype:
        raise TypeError(f"output has dtype {flat.dtype} but input has {input.dtype}; use one dtype")
    lo, hi = bounds[g.rank]
    if input.numel() != hi - lo:
        raise ValueError(f"input has {input.numel()} elements but rank {g.rank}'s slot in the "
                         f"output has {hi - lo} (slot boundaries {bounds}); make them match")
    flat[lo:hi].copy_(input.reshape(-1))
    _ring(g, flat, bounds, n_steps=g.size - 1, n_reduce=0, offset=0, name="ring_all_gather",
          rec=trace.current(), hook=None, pipeline_bytes=pipeline_bytes)
    if tensors is not None:
        for t, (a, b) in zip(tensors, bounds):
            t.view(-1).copy_(flat[a:b])
    return output


def all_to_all(output_list: Sequence[torch.Tensor], input_list: Sequence[torch.Tensor],
               group=None, *, transport=None) -> Sequence[torch.Tensor]:
    """All-to-all: rank r sends ``input_list[j]`` to rank j, which stores it in ``output_list[r]``.

    Pairwise exchange (Thakur et al. 2005, Sec. 4.5): in step s (1 <= s < N) rank r sends to
    (r + s) mod N while receiving from (r - s) mod N, so every step is a permutation of the ranks
    and no rank is a hot spot. Sizes may differ per pair (``output_list[j]`` on rank r must have
    the number of elements of ``input_list[r]`` on rank j), as in ``dist.all_to_all``.

    Returns:
        ``output_list``, filled in place. Each rank sends everything except its own block.
    """
    g = _Group(group, transport)
    _check_list(output_list, g.size, "output_list")
    dtype, device = output_list[0].dtype, output_list[0].device
    for i, t in enumerate(output_list):
        _check_device(t, device, f"output_list[{i}]")
    _check_list(input_list, g.size, "input_list", dtype=dtype, device=device)
    r, N = g.rank, g.size
    if output_list[r].numel() != input_list[r].numel():
        raise ValueError(f"output_list[{r}] has {output_list[r].numel()} elements but "
                         f"input_list[{r}] has {input_list[r].numel()}; a rank's block to itself "
                         "must fit")
    output_list[r].view(-1).copy_(input_list[r].reshape(-1))
    rec = trace.current()
    for s in range(1, N):
        dst, src = (r + s) % N, (r - s) % N
        _exchange(g, input_list[dst].reshape(-1), dst, output_list[src].view(-1), src,
                  f"all_to_all/step {s - 1}", rec, peer=g.global_ranks[dst], step=s - 1)
    return output_list


# ------------------------------------------------------------------------------------------
# the course's collective or torch's own: the one place that chooses
# ------------------------------------------------------------------------------------------
def _no_transport_with_builtin(builtin: bool, transport) -> None:
    if builtin and transport is not None:
        raise ValueError("transport= applies to the course's ring collectives; torch's built-in ones "
                         "(builtin=True) talk through their backend: pass one or the other")


def all_reduce(tensor: torch.Tensor, op="sum", group=None, *, builtin: bool = False,
               transport=None) -> torch.Tensor:
    """``dist.all_reduce(tensor, op, group)`` in place: the course's :func:`ring_all_reduce`, or with
    ``builtin=True`` torch's own (gloo's or NCCL's algorithm: faster; its transfers are not recorded
    by :mod:`course_lib.trace`). ``op`` is ``"sum"`` or ``"avg"``; the built-in average is a sum and one
    division, as the ring's (gloo has no ``ReduceOp.AVG``). ``transport``: the ring's point-to-point
    layer (e.g. :class:`course_lib.netem.PacedTransport`, an emulated link). Returns ``tensor``."""
    op = _parse_op(op)
    _no_transport_with_builtin(builtin, transport)
    if not builtin:
        return ring_all_reduce(tensor, op, group=group, transport=transport)
    dist.all_reduce(tensor, group=group)
    if op == "avg":
        tensor.div_(dist.get_world_size(group))
    return tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, *,
                      builtin: bool = False, transport=None) -> torch.Tensor:
    """``dist.all_gather_single(output, input, group)``: every rank's ``input`` laid end to end in
    ``output`` (rank order; ``world_size * input.numel()`` elements). The course's
    :func:`ring_all_gather`, or torch's own with ``builtin=True``. ``input`` may be this rank's slot
    of ``output`` (as in ZeRO, whose shard is a view into the full buffer). ``transport`` as in
    :func:`all_reduce`. Returns ``output``."""
    _no_transport_with_builtin(builtin, transport)
    if not builtin:
        return ring_all_gather(output, input, group=group, transport=transport)
    if input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        # torch's all-gather works in place only when the input is exactly this rank's slot of the
        # output; a copy is right for any input that shares the output's memory
        input = input.clone()
    compat.all_gather_single(output, input, group=group)
    return output


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op="sum", group=None, *,
                          builtin: bool = False, transport=None) -> torch.Tensor:
    """``dist.reduce_scatter_single(output, input, op, group)``: ``input`` reduced over the ranks, rank
    r keeps block r in ``output`` (``input.numel() / world_size`` elements). The course's
    :func:`ring_reduce_scatter`, or torch's own with ``builtin=True`` (``"avg"``: a sum and one
    division, as :func:`all_reduce`). ``input`` is not modified. ``transport`` as in :func:`all_reduce`.
    Returns ``output``."""
    op = _parse_op(op)
    _no_transport_with_builtin(builtin, transport)
    if not builtin:
        return ring_reduce_scatter(output, input, op, group=group, transport=transport)
    compat.reduce_scatter_single(output, input, group=group)
    if op == "avg":
        output.div_(dist.get_world_size(group))
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None, *,
                      builtin: bool = False) -> torch.Tensor:
    """``dist.all_to_all_single(output, input, group)`` with equal blocks: ``input``'s dim 0 is cut
    into ``world_size`` blocks, block j goes to rank j, and rank i's block lands in ``output``'s block
    i. The course's pairwise :func:`all_to_all` on those blocks, or torch's own with ``builtin=True``.
    Returns ``output``."""
    n = dist.get_world_size(group)
    for what, t in (("input", input), ("output", output)):
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"all_to_all_single: {what} has shape {tuple(t.shape)}, whose first dimension "
                             f"does not split into world_size={n} equal blocks; pad it to a multiple of {n}")
    if builtin:
        dist.all_to_all_single(output, input, group=group)
    else:
        all_to_all(list(output.chunk(n)), list(input.chunk(n)), group=group)
    return output
