"""Data parallelism from scratch: gradient averaging, a naive DDP and a bucketed, overlapped DDP.

Every rank holds a full replica of the model and a different slice of the batch. After backward,
the gradients are averaged over the ranks with an all-reduce, so every replica takes the same
optimizer step -- the step a single process would take on the whole batch (synchronous SGD).
With a mean loss and equal per-rank batches ``b``, for ``N`` ranks:

    g = 1/(N b) sum_{i=1}^{N b} grad l_i = 1/N sum_{r=0}^{N-1} ( 1/b sum_{i in shard r} grad l_i ) = 1/N sum_r g_r

Three versions, from the textbook to what ``torch.nn.parallel.DistributedDataParallel`` does
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB,
section 3.2: bucketing, overlapping communication with computation, skipping unused parameters,
``no_sync``):

* :func:`average_gradients`: one blocking all-reduce per parameter after backward.
* :class:`NaiveDDP`: broadcast the initial parameters from one rank, then :func:`average_gradients`.
* :class:`BucketedDDP`: per-parameter hooks fire as soon as a gradient is final; gradients are packed
  into buckets (filled in reverse registration order, roughly the order backward produces them) and
  each full bucket is all-reduced asynchronously *while backward keeps computing earlier layers*.

All functions take an explicit ``group`` (``None`` = the default process group) and work with any
backend (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.collectives import ring_all_reduce_bytes

__all__ = [
    "broadcast_parameters",
    "trainable_parameters",
    "average_gradients",
    "NaiveDDP",
    "BucketedDDP",
    "shard_range",
    "shard_loss_weight",
    "accumulate_gradients",
]


def _current_recorder():
    """The active ``course_lib.trace.Recorder`` or None (trace is optional at import time)."""
    try:
        from course_lib import trace
    except ImportError:  # pragma: no cover - trace.py ships with the course
        return None
    return trace.current()


def shard_range(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` samples, a ``slice``: the first ``n % world_size`` ranks
    get one sample more, so sizes differ by at most one (e.g. n=30, N=4 -> 8, 8, 7, 7).

    Raises ValueError when a rank would get no sample (its gradient would be undefined). Tensor
    parallelism's split is :func:`course_lib.tensor_parallel.even_shard`: the same arguments in the same
    order, but ``(lo, hi)``, and ``n`` must divide evenly (every rank the same shape).
    """
    for name, v in (("n", n), ("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if n < world_size:
        raise ValueError(f"cannot split n={n} samples over world_size={world_size} ranks: some rank "
                         f"would get none; use a global batch of at least {world_size} samples")
    from course_lib.collectives import chunk_bounds  # the same split the ring uses for its chunks

    start, end = chunk_bounds(n, world_size)[rank]
    return slice(start, end)


def shard_loss_weight(n: int, rank: int, world_size: int) -> float:
    """Factor for rank ``rank``'s *mean* loss so that DDP's average equals the full-batch mean.

    DDP averages the per-rank gradients with equal weights 1/N. With shards of sizes ``n_r`` the
    full-batch mean gradient is ``sum_r (n_r / n) g_r``, so rank r must scale its mean loss by
    ``N * n_r / n`` (exactly 1 when N divides n). Without it, samples on smaller shards count more.
    """
    s = shard_range(n, rank, world_size)
    return world_size * (s.stop - s.start) / n


def _check_module(module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}; wrap your model "
                        "in an nn.Module before handing it to data parallelism")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run this inside a rank started by "
                           "course_lib.launch.run / Cluster, or call dist.init_process_group first")


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that data parallelism must synchronise, in registration order.

    Frozen parameters (``requires_grad=False``) are skipped: no gradient, nothing to reduce.
    Tied parameters (the same tensor registered twice, e.g. ``TinyGPT.lm_head.weight is
    TinyGPT.wte.weight``) appear once, because ``Module.parameters()`` deduplicates by identity --
    reducing a tied weight twice would double its gradient.
    """
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's replica (in place).

    Data parallelism only computes the full-batch step if all replicas start identical; different
    random initialisations on different ranks would silently train N different models.
    ``src`` is a global rank, as in ``dist.broadcast``.
    """
    _check_module(module)
    seen = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        dist.broadcast(t.data, src=src, group=group)


@torch.no_grad()
def average_gradients(module: nn.Module, group=None) -> int:
    """Average every trainable parameter's ``.grad`` over the ranks of ``group``: one blocking
    all-reduce per parameter, then divide by the world size. Returns the number of all-reduces.

    A parameter whose ``.grad`` is None on this rank (unused in this forward) contributes zeros, so
    every rank issues the same sequence of collectives (a missing call would deadlock the others).
    Each all-reduce carries one extra element, the number of ranks that had a gradient; if no rank
    had one, ``.grad`` stays None -- the semantics of ``DistributedDataParallel(find_unused_parameters=True)``.
    """
    _check_module(module)
    world = dist.get_world_size(group)
    rec = _current_recorder()
    n = 0
    for p in trainable_parameters(module):
        g = p.grad
        flat = torch.empty(p.numel() + 1, dtype=p.dtype, device=p.device)
        if g is None:
            flat.zero_()
        else:
            flat[:-1].copy_(g.reshape(-1))
            flat[-1] = 1.0
        t0 = time.time()
        dist.all_reduce(flat, group=group)
        if rec is not None:
            nb = round(ring_all_reduce_bytes(flat.numel() * flat.element_size(), world))
            rec.comm("all_reduce", nb, nb, t0, time.time())
        n += 1
        if flat[-1].item() == 0:  # no rank produced a gradient: leave it None
            continue
        avg = flat[:-1].div_(world).view_as(p)
        if g is None:
            p.grad = avg.clone()
        else:
            g.copy_(avg)
    return n


class NaiveDDP(nn.Module):
    """Data parallelism the textbook way: broadcast parameters once, all-reduce after backward.

    Usage (inside a rank)::

        model = NaiveDDP(TinyMLP())
        loss_fn(model(x_shard), y_shard).backward()
        model.sync_gradients()        # one blocking all-reduce per parameter
        opt.step()

    Communication starts only after the whole backward has finished, and every parameter pays one
    collective's fixed latency: this is what :class:`BucketedDDP` improves on.
    """

    def __init__(self, module: nn.Module, group=None, src: int = 0):
        super().__init__()
        _check_module(module)
        self.module = module
        self.group = group
        broadcast_parameters(module, src=src, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> int:
        """Average the gradients over the ranks; returns the number of all-reduces issued."""
        return average_gradients(self.module, self.group)


@dataclass
class _Bucket:
    """Parameters whose gradients travel in one all-reduce.

    ``flat`` is a slice of the module's one flat gradient buffer (no storage of its own): the
    parameters' gradients back to back, ``numel`` elements, then one "had a gradient" flag per
    parameter. ``views[slot]`` is parameter ``slot``'s gradient as a view into ``flat``, shaped like it.
    """

    params: list
    offsets: list
    numel: int
    flat: torch.Tensor | None = None
    views: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    n_ready: int = 0
    work: object = None
    t_launch: float = 0.0
    t_done: list = field(default_factory=list)


class BucketedDDP(nn.Module):
    """Bucketed data parallelism with communication overlapped with backward.

    * At construction the replicas are made identical (broadcast from ``src``) and the trainable
      parameters are split into buckets, walking them in *reverse* registration order (backward
      visits the last layers first, so the first bucket fills first); a bucket is closed as soon as
      it holds ``bucket_cap_bytes`` or more, so it overshoots the cap by less than one parameter --
      the rule torch DDP uses (``_compute_bucket_assignment_by_size``).
    * All gradients live in one flat buffer per dtype/device (``grad_buffers``; one for a usual
      model), laid out bucket after bucket; a bucket's ``flat`` is a slice of it and every
      ``param.grad`` becomes a view into its bucket (torch DDP's ``gradient_as_bucket_view=True``).
      Backward then accumulates straight into the buffer, and no gradient is copied into or out of
      the bucket -- except once after ``zero_grad(set_to_none=True)``, when autograd hands back a
      fresh ``.grad`` that is copied into the view (divided by N in the same pass) and replaced by it.
    * ``param.register_post_accumulate_grad_hook`` marks a parameter ready once its ``.grad`` is final
      for this backward. When a bucket is complete it is divided by the world size in place and
      handed to ``dist.all_reduce(async_op=True)``; backward continues with earlier layers while the
      bytes move.
    * Buckets are launched strictly in bucket order: collectives are matched by call order, so every
      rank must issue them in the same order even when gradients arrive in a different order.
    * At the end of backward (an autograd-engine callback) the remaining buckets are launched -- a
      parameter that received no gradient contributes zeros, as in DDP(find_unused_parameters=True)
      -- and every all-reduce is waited for: ``.grad`` already holds the average (it is a view).
      A parameter no rank produced a gradient for keeps ``.grad = None``.
    * ``with model.no_sync():`` turns communication off; gradients accumulate locally and the first
      backward outside the context reduces the accumulated sum (gradient accumulation with one
      all-reduce per accumulation window).

    Frozen parameters are not bucketed; tied parameters are bucketed once.
    Source: Li et al. 2020 (VLDB), "PyTorch Distributed", sections 3.2.2-3.2.4.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_bytes: int = 25 * 2**20, src: int = 0):
        super().__init__()
        _check_module(module)
        if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int):
            raise TypeError(f"bucket_cap_bytes must be an int number of bytes, got "
                            f"{type(bucket_cap_bytes).__name__} ({bucket_cap_bytes!r})")
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}; use e.g. "
                             "25 * 2**20 (25 MiB, the torch DDP default) or a few KiB for tiny models")
        self.module = module
        self.group = group
        self.bucket_cap_bytes = bucket_cap_bytes
        self.world_size = dist.get_world_size(group)
        self.sync_enabled = True
        broadcast_parameters(module, src=src, group=group)

        params = trainable_parameters(module)
        if not params:
            raise ValueError("the module has no trainable parameters (all requires_grad=False); "
                             "there is nothing for data parallelism to synchronise")
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, slot)
        cur, cur_bytes = [], 0
        for p in reversed(params):
            # one flat buffer per bucket: a dtype/device change starts a new bucket
            if cur and (p.dtype != cur[0].dtype or p.device != cur[0].device):
                self._add_bucket(cur)
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += p.numel() * p.element_size()
            if cur_bytes >= bucket_cap_bytes:  # full: close it (it may overshoot by < one parameter)
                self._add_bucket(cur)
                cur, cur_bytes = [], 0
        if cur:
            self._add_bucket(cur)
        self.grad_buffers: list[torch.Tensor] = []
        self._alloc_grad_buffers()

        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._next_bucket = 0
        self._in_backward = False
        self._t_prev = None
        self.last_comm_count = 0  # all-reduces issued by the last synchronised backward

    def _add_bucket(self, params: list) -> None:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        b = _Bucket(params=params, offsets=offsets, numel=n, ready=[False] * len(params))
        for slot, p in enumerate(params):
            self._where[id(p)] = (len(self.buckets), slot)
        self.buckets.append(b)

    @torch.no_grad()
    def _alloc_grad_buffers(self) -> None:
        """One flat buffer per run of buckets with the same dtype/device; buckets are slices of it."""
        start = 0
        while start < len(self.buckets):
            p0 = self.buckets[start].params[0]
            end = start
            while end < len(self.buckets) and (self.buckets[end].params[0].dtype == p0.dtype
                                               and self.buckets[end].params[0].device == p0.device):
                end += 1
            group = self.buckets[start:end]
            buf = torch.zeros(sum(b.numel + len(b.params) for b in group), dtype=p0.dtype, device=p0.device)
            off = 0
            for b in group:
                b.flat = buf[off:off + b.numel + len(b.params)]  # a view: shares buf's storage
                b.views = [b.flat[o:o + p.numel()].view_as(p) for p, o in zip(b.params, b.offsets)]
                off += b.numel + len(b.params)
            self.grad_buffers.append(buf)
            start = end

    def forward(self, *args, **kwargs):
        if self._in_backward:
            raise RuntimeError("forward called while a previous backward's gradient synchronisation "
                               "is still pending; call finish_gradient_sync() first")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this context backward does not communicate: gradients accumulate in ``.grad``.

        The first backward after the context synchronises the accumulated gradients.
        """
        old = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = old

    def bucket_sizes(self) -> list[int]:
        """Bytes of gradient per bucket, in launch order (the flags are not counted)."""
        return [b.numel * b.params[0].element_size() for b in self.buckets]

    # -- the hook path -------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        now = time.time()
        if not self._in_backward:
            # first gradient of this backward: ask autograd to call us when backward is done
            self._in_backward = True
            self._next_bucket = 0
            self._t_prev = now
            self.last_comm_count = 0
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        bi, slot = self._where[id(p)]
        b = self.buckets[bi]
        if not b.ready[slot]:
            b.ready[slot] = True
            b.n_ready += 1
        # launch every complete bucket whose predecessors have all been launched
        while self._next_bucket < len(self.buckets):
            nb = self.buckets[self._next_bucket]
            if nb.n_ready < len(nb.params):
                break
            self._launch(self._next_bucket)
            self._next_bucket += 1

    @torch.no_grad()
    def _launch(self, bi: int) -> None:
        b = self.buckets[bi]
        flat = b.flat
        flags = []
        for p, view in zip(b.params, b.views):
            g = p.grad
            if g is None:  # no gradient on this rank: contribute zeros, flag 0
                view.zero_()
                flags.append(0.0)
                continue
            if g.data_ptr() == view.data_ptr():  # already the view: backward accumulated into it
                view.div_(self.world_size)
            else:  # a fresh .grad (after zero_grad(set_to_none=True)): one pass, copy and divide
                torch.div(g, self.world_size, out=view)
                p.grad = view
            flags.append(1.0)
        flat[b.numel:] = torch.tensor(flags, dtype=flat.dtype, device=flat.device)
        rec = _current_recorder()
        now = time.time()
        if rec is not None and self._t_prev is not None:
            # the backward computation since the previous launch produced this bucket's gradients
            rec.events.append(dict(rank=rec.rank, kind="compute", name=f"backward -> bucket {bi}",
                                   start=self._t_prev, end=now, bytes_sent=0, bytes_recv=0))
        self._t_prev = now
        b.t_launch = now
        b.t_done = []
        b.work = dist.all_reduce(flat, group=self.group, async_op=True)
        if rec is not None:
            # completion time observed by the backend thread, not when we get around to waiting
            b.work.get_future().then(lambda fut, b=b: b.t_done.append(time.time()))
        self.last_comm_count += 1

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all all-reduces, write back averaged grads.

        Called automatically at the end of each synchronised backward; calling it again is a no-op.
        """
        if not self._in_backward:
            return
        while self._next_bucket < len(self.buckets):
            self._launch(self._next_bucket)
            self._next_bucket += 1
        rec = _current_recorder()
        t_wait = time.time()
        for bi, b in enumerate(self.buckets):
            b.work.wait()
            if rec is not None:
                end = b.t_done[0] if b.t_done else time.time()
                nb = round(ring_all_reduce_bytes(b.numel * b.flat.element_size(), self.world_size))
                rec.comm(f"all_reduce bucket {bi}", nb, nb, b.t_launch, end)
            had_grad = b.flat[b.numel:].tolist()  # per parameter: how many ranks had a gradient
            for slot, (p, view) in enumerate(zip(b.params, b.views)):
                if had_grad[slot] != 0 and p.grad is None:  # only other ranks had one: use the view
                    p.grad = view
                # (no rank had a gradient: .grad stays None; otherwise .grad is the view already)
            b.work = None
            b.ready = [False] * len(b.params)
            b.n_ready = 0
        if rec is not None and self._t_prev is not None and t_wait > self._t_prev:
            rec.events.append(dict(rank=rec.rank, kind="compute", name="backward (tail)",
                                   start=self._t_prev, end=t_wait, bytes_sent=0, bytes_recv=0))
        self._in_backward = False
        self._t_prev = None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapped module can then be reused without DDP)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def accumulate_gradients(model: nn.Module, loss_fn, micro_batches) -> float:
    """Run forward/backward on each ``(x, y)`` micro-batch, accumulating into ``.grad``; return the loss.

    Gradient accumulation: ``.grad`` *adds up* over backward calls, so k micro-batches give the
    gradient of one batch of all their samples -- provided each micro-batch's *mean* loss is scaled by
    its share of the samples, ``n_j / n`` (``1/k`` for equal sizes). Without the scaling the gradient
    is k times too large. Only one micro-batch's activations are alive at a time.

    If ``model`` has ``no_sync()`` (a DDP wrapper), every micro-batch but the last runs inside it, so
    gradients are all-reduced once per accumulation window instead of k times.

    Shapes: each ``x`` is ``(n_j, ...)`` with ``n_j >= 1``. Returns the mean loss over all samples
    (a float). The caller zeroes the gradients before and steps the optimizer after.
    """
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("micro_batches is empty; pass a list of (x, y) pairs, e.g. "
                         "list(zip(x.chunk(k), y.chunk(k)))")
    sizes = [len(x) for x, _ in micro_batches]
    if min(sizes) < 1:
        raise ValueError(f"every micro-batch needs at least one sample, got sizes {sizes}")
    n = sum(sizes)
    total = 0.0
    for j, ((x, y), n_j) in enumerate(zip(micro_batches, sizes)):
        last = j == len(micro_batches) - 1
        ctx = model.no_sync() if (hasattr(model, "no_sync") and not last) else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) * (n_j / n)  # mean over n_j samples -> share of the mean over n
            loss.backward()
        total += loss.item()
    return total
