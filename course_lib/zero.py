"""ZeRO from scratch: stages 1, 2 and 3 of the Zero Redundancy Optimizer (Rajbhandari et al. 2020).

Plain data parallelism keeps a full copy of the *model states* on every rank: parameters,
gradients and optimizer states, ``(2 + 2 + K) Psi`` bytes for ``Psi`` parameters in mixed precision
with Adam (``K = 12``: fp32 master weights, momentum, variance; ZeRO §3.1). ZeRO-DP (§5) keeps the
data-parallel computation but gives each of the ``N`` ranks only a ``1/N`` shard of them:

=========  ============================  ===================================  ========================
stage      sharded (paper §5.1-5.3)      per-rank model states (mixed, Adam)  bytes sent per step (§7)
=========  ============================  ===================================  ========================
0 (DDP)    nothing                       ``(4 + K) Psi``                      2 Psi (all-reduce)
1 ``P_os`` optimizer states              ``4 Psi + K Psi / N``                2 Psi (RS + AG)
2 ``P_g``  + gradients                   ``2 Psi + (2 + K) Psi / N``          2 Psi (RS + AG)
3 ``P_p``  + parameters                  ``(4 + K) Psi / N``                  3 Psi (AG, AG, RS)
=========  ============================  ===================================  ========================

(The paper rounds the ring's ``(N-1)/N`` to 1; :func:`comm_bytes_per_step` keeps it.)

How the shards are laid out (the ``FlatParameter`` idea that FSDP also uses)::

    unit (one layer): [ w1 ........ | b1 .. | w2 ........ | b2 .. | pad ]   padded to a multiple of N
                      |<- rank 0 ->|<- rank 1 ->|<- rank 2 ->|<- rank 3 ->|   shard = padded / N

The model is cut into *units*: by default every layer of every ``nn.ModuleList`` (the blocks of
``TinyGPT``, the layers of ``TinyMLP``) is one unit and the parameters left over (embeddings, final
norm, head) form the root unit. Each unit's trainable parameters are concatenated into one flat
vector, zero-padded so that ``N`` divides it, and rank ``r`` owns the ``r``-th equal slice.

* Stage 0: every rank holds everything; gradients are ring all-reduced (averaged) and every rank
  steps the full Adam. This is the baseline of the paper's Figure 1.
* Stage 1 (§5.1): every rank keeps Adam's states only for its slice. After backward the full
  gradient is reduce-scattered (rank r receives the averaged slice r), rank r steps its slice, and
  the updated slices are all-gathered into every rank's full parameters.
* Stage 2 (§5.2): as stage 1, but each unit's gradient is reduce-scattered *as soon as backward has
  produced it* (a post-accumulate-grad hook) and the full gradient is dropped: a rank keeps only
  its gradient slice.
* Stage 3 (§5.3): the parameters are sharded too. A unit's full parameters are all-gathered just
  before its forward and freed after it, all-gathered again just before its backward (a hook on
  the unit's output gradient) and freed after it; its gradient is reduce-scattered as backward
  produces it. While one unit computes, the next unit's all-gather is already in flight (prefetch,
  §7.2.2 "pre-fetching"): communication runs on a background thread, overlapping compute.

Freeing uses FSDP's trick: the parameters stay views into one flat buffer whose *storage* is
resized to 0 bytes after use and back before the next use, so the tensors autograd saved for the
backward see the re-gathered values.

Communication goes through the course's own ring collectives (:mod:`course_lib.collectives`,
recorded by :mod:`course_lib.trace`), or through the ``torch.distributed`` built-ins with
``builtin=True`` (faster; then nothing is recorded). Mixed precision (``param_dtype=torch.bfloat16``)
computes in bf16 and keeps an fp32 master slice for Adam (ZeRO §3.1; FSDP2's
``MixedPrecisionPolicy(param_dtype=...)``). The gradients are accumulated over micro-batches and
reduced in ``reduce_dtype`` (default: ``param_dtype``, as the ZeRO paper's 2-byte gradients):
``reduce_dtype=torch.float32`` is what production runs use (FSDP2's ``reduce_dtype``, Megatron-LM's
fp32 "main gradients"), at twice the gradient bytes; in stages 0-1 every parameter then has a
``main_grad`` attribute, an fp32 view into the flat gradient buffer, into which each backward's bf16
``.grad`` is added and then dropped (Megatron-LM's name and scheme). :meth:`ZeRO.clip_grad_norm_`
clips by the global norm of the gradients, every element counted once across the shards.

Frozen parameters (``requires_grad=False``) are not sharded: every rank keeps them, as in DDP.
Tied parameters (one tensor registered twice) are sharded once. A unit must run at most once per
forward. Activation checkpointing composes with stage 3 (production's default pairing, FSDP + AC):
a checkpoint around a unit re-runs it while its parameters are gathered for its backward; a unit
re-run inside a larger checkpoint is gathered again and kept until its gradient is reduced (a
forward during a backward does not free). Not covered: CPU offload (ZeRO-Offload), activation
partitioning (ZeRO-R, §6).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import collectives, trace
from course_lib.data_parallel import broadcast_parameters

__all__ = ["ZeRO", "comm_bytes_per_step", "default_units"]

STAGES = (0, 1, 2, 3)


def comm_bytes_per_step(n_params: int, stage: int, world_size: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per training step under ZeRO stage ``stage`` (ZeRO §7.2).

    A ring reduce-scatter or all-gather of ``n`` elements sends ``(N-1)/N * n`` elements per rank,
    a ring all-reduce twice that. Stages 0-2: ``2 (N-1)/N Psi`` (all-reduce, or reduce-scatter +
    all-gather: "the same communication volume as baseline DP"); stage 3: ``3 (N-1)/N Psi`` (an
    all-gather for the forward, one for the backward, a reduce-scatter: 1.5x). The paper writes
    ``2 Psi`` and ``3 Psi``, the limit for large ``N``.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * n_params * bytes_per_element


def default_units(module: nn.Module) -> list[nn.Module]:
    """The layers ZeRO-3 gathers one at a time: every child of an ``nn.ModuleList`` in ``module``
    (outermost lists only). The remaining parameters form the root unit."""
    units, inside = [], set()
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and id(m) not in inside:
            for child in m:
                units.append(child)
                inside.update(id(x) for x in child.modules())
    return units


class _Unit:
    """One unit's flat buffers. Shapes: ``full`` (padded,), ``shard``/``master`` (padded // N,)."""

    def __init__(self, name, module, params, world_size, rank, stage):
        self.name, self.module, self.params = name, module, params
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shard_size = -(-off // world_size)            # ceil(Psi_unit / N)
        self.padded = self.shard_size * world_size
        lo = 0 if stage == 0 else rank * self.shard_size    # stage 0: a rank "owns" everything
        self.lo, self.hi = lo, self.padded if stage == 0 else lo + self.shard_size
        self.full = self.shard = self.master = None
        self.grad_full = self.grad_shard = None             # stages 0-1 / stages 2-3
        self.pending: list[Future] = []                     # reduce-scatters in flight
        self.gather: Future | None = None
        self.is_full = True
        self.n_ready = 0
        self.t_start = None


class ZeRO(nn.Module):
    """Data parallelism with ZeRO stage 0-3 sharding, model and optimizer in one object.

    Args:
        module: the model; its trainable parameters are flattened into per-unit buffers (the
            module's parameters become views into them) and rank ``src``'s values are broadcast
            to every rank first, so ranks may start from different initialisations.
        stage: 0 (plain data parallelism), 1 (shard Adam states), 2 (+ gradients), 3 (+ parameters).
        lr, betas, eps, weight_decay: ``torch.optim.Adam``'s, which steps each rank's slice.
        group: process group (``None`` = default group); the data-parallel ranks.
        units: the submodules to gather one at a time (:func:`default_units` when ``None``).
        param_dtype: e.g. ``torch.bfloat16`` for mixed precision (compute, gradients and
            communication in bf16, fp32 master slice); ``None`` keeps the parameters' fp32.
        reduce_dtype: the dtype gradients are accumulated over micro-batches and reduced in
            (``None``: ``param_dtype``); ``torch.float32`` with bf16 parameters keeps fp32 gradients
            (and sends twice the bytes), see the module docstring.
        builtin: use ``dist.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce``
            instead of the course's ring (faster; not recorded by ``course_lib.trace``).
        transport: the ring collectives' point-to-point layer (``None``: ``torch.distributed``'s),
            e.g. :class:`course_lib.netem.PacedTransport` to run over an emulated link.
        prefetch: stage 3: issue the next unit's all-gather while the current one computes.
        src: the global rank whose parameters are broadcast at set-up.

    Use like a model plus its optimizer: each rank feeds its own slice of the batch (equal slices
    give the full-batch step)::

        model = ZeRO(TinyGPT(), stage=3, lr=1e-3)
        loss = loss_fn(model(x_shard), y_shard); loss.backward()
        model.step(); model.zero_grad()
    """

    def __init__(self, module: nn.Module, stage: int, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, group=None, units=None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 builtin: bool = False, prefetch: bool = True, src: int = 0, transport=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ZeRO wraps an nn.Module, got {type(module).__name__}")
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"stage must be 0, 1, 2 or 3 (0: plain data parallelism, 1: shard the "
                             f"optimizer states, 2: also the gradients, 3: also the parameters), "
                             f"got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; run inside a rank started by "
                               "course_lib.launch.run / Cluster, or call dist.init_process_group")
        params = [p for p in module.parameters() if p.requires_grad]  # tied weights once
        if not params:
            raise ValueError("the model has no trainable parameters (none with requires_grad=True); "
                             "ZeRO shards parameters, gradients and optimizer states, so give it a "
                             "model with at least one trainable parameter")
        if len({(p.dtype, p.device) for p in params}) > 1 or not params[0].is_floating_point():
            raise TypeError("ZeRO needs all trainable parameters in one floating dtype on one "
                            "device; got " + ", ".join(sorted({f"{p.dtype}@{p.device}" for p in params})))
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        n_total = sum(p.numel() for p in params)
        if self.world_size > n_total:
            raise ValueError(f"world_size={self.world_size} is larger than the model's {n_total} "
                             f"trainable parameters, so some ranks would own nothing; use a group of "
                             f"at most {n_total} ranks or a larger model")
        for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
                raise TypeError(f"{name} must be a floating torch.dtype such as torch.bfloat16 or "
                                f"torch.float32, got {dt!r}")
        self.module, self.stage, self.group = module, stage, group
        if builtin and transport is not None:
            raise ValueError("transport= is for the course's ring collectives; with builtin=True torch's "
                             "own collectives talk through their backend: pass one or the other")
        self.builtin, self.prefetch, self.transport = bool(builtin), bool(prefetch), transport
        self.master_dtype, self.device = params[0].dtype, params[0].device
        self.param_dtype = param_dtype or self.master_dtype
        self.mixed = self.param_dtype != self.master_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # stages 0-1 with another reduce dtype: .grad (param dtype) is added into main_grad, then dropped
        self.main_grads = stage <= 1 and self.reduce_dtype != self.param_dtype
        broadcast_parameters(module, src=src, group=group)

        # -- units: layers first claim their parameters, the root takes the rest --
        layer_modules = default_units(module) if units is None else list(units)
        claimed, self.units = set(), []
        trainable = {id(p) for p in params}
        names = {id(m): n for n, m in module.named_modules()}
        for m in layer_modules + [module]:
            own = [p for p in m.parameters() if id(p) in trainable and id(p) not in claimed]
            claimed.update(id(p) for p in own)
            if own:
                self.units.append(_Unit(names.get(id(m)) or "root", m, own, self.world_size,
                                        self.rank, stage))
        self.root = self.units[-1] if self.units[-1].module is module else None
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        self._build_buffers()
        self.optimizer = torch.optim.Adam([u.master for u in self.units], lr=lr, betas=betas,
                                          eps=eps, weight_decay=weight_decay, foreach=False)
        # One communication thread: every rank issues its collectives in the same order on it.
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-comm")
        weakref.finalize(self, self._comm.shutdown, wait=False)
        self._hooks = []
        self._reduced = False
        if stage >= 2:
            for u in self.units:
                for p in u.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p, u=u: self._on_grad_ready(u)))
        elif self.main_grads:
            for u in self.units:
                for p in u.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._to_main_grad))
        if stage == 3:
            for u in self.units:
                if u is not self.root:
                    self._hooks.append(u.module.register_forward_pre_hook(
                        lambda m, args, u=u: self._pre_forward(u)))
                    self._hooks.append(u.module.register_forward_hook(
                        lambda m, args, out, u=u: self._post_forward(u, out)))
            for u in self.units:
                self._free(u)

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def _build_buffers(self) -> None:
        for u in self.units:
            u.full = torch.zeros(u.padded, dtype=self.param_dtype, device=self.device)
            master_full = torch.zeros(u.padded, dtype=self.master_dtype, device=self.device)
            for p, off in zip(u.params, u.offsets):
                master_full[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = u.full[off:off + p.numel()].view(p.shape)   # p is now a view into full
            u.full.copy_(master_full)
            # stage 3 keeps its slice in its own storage (full is freed); otherwise a view
            u.shard = u.full[u.lo:u.hi].clone() if self.stage == 3 else u.full[u.lo:u.hi]
            # fp32: Adam updates the slice in place; mixed: a separate fp32 master slice
            u.master = nn.Parameter(master_full[u.lo:u.hi].clone() if self.mixed else u.shard)
            if self.stage <= 1:
                u.grad_full = torch.zeros(u.padded, dtype=self.reduce_dtype, device=self.device)
                for p, off in zip(u.params, u.offsets):
                    view = u.grad_full[off:off + p.numel()].view(p.shape)
                    if self.main_grads:
                        p.main_grad = view     # Megatron-LM's name: the fp32 gradient of p
                    else:
                        p.grad = view
        if self.mixed:
            for p in self.frozen:
                p.data = p.data.to(self.param_dtype)

    # ------------------------------------------------------------------ communication
    def _submit(self, fn, *args) -> Future:
        return self._comm.submit(fn, *args)

    def _all_gather(self, u: _Unit) -> None:
        with trace.span("comm", f"all-gather: {u.name}"):
            collectives.all_gather_single(u.full, u.shard, group=self.group, builtin=self.builtin,
                                          transport=self.transport)

    def _reduce_scatter(self, u: _Unit, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` (padded,) over the ranks; return this rank's slice (shard_size,)."""
        out = torch.empty(u.shard_size, dtype=flat.dtype, device=flat.device)
        with trace.span("comm", f"reduce-scatter: {u.name}"):
            collectives.reduce_scatter_single(out, flat, "avg", group=self.group, builtin=self.builtin,
                                              transport=self.transport)
        return out

    def _all_reduce(self, u: _Unit) -> None:
        with trace.span("comm", f"all-reduce: {u.name}"):
            collectives.all_reduce(u.grad_full, "avg", group=self.group, builtin=self.builtin,
                                   transport=self.transport)

    # ------------------------------------------------------------------ stage 3: gather / free
    def _start_gather(self, u: _Unit) -> None:
        if u.is_full or u.gather is not None:
            return
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())  # allocate again
        u.gather = self._submit(self._all_gather, u)

    def _ensure_full(self, u: _Unit) -> None:
        self._start_gather(u)
        if u.gather is not None:
            u.gather.result()
            u.gather = None
            u.is_full = True

    def _free(self, u: _Unit) -> None:
        if self.stage == 3 and u.is_full:
            u.full.untyped_storage().resize_(0)   # the views stay; their bytes are gone
            u.is_full = False

    def _neighbour(self, u: _Unit, step: int):
        layers = [v for v in self.units if v is not self.root]
        if u is self.root:
            return (layers[0] if step > 0 else layers[-1]) if layers else None
        i = layers.index(u) + step
        return layers[i] if 0 <= i < len(layers) else None

    def _pre_forward(self, u: _Unit) -> None:
        self._reduced = False
        self._ensure_full(u)
        nxt = self._neighbour(u, +1)
        if self.prefetch and nxt is not None and not _in_backward():   # not for a checkpoint's re-run
            self._start_gather(nxt)
        u.t_start = _now()

    def _post_forward(self, u: _Unit, out) -> None:
        _record(f"forward {u.name}", u.t_start)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
        if not _in_backward():   # a forward re-run by activation checkpointing: its backward is next
            self._free(u)

    def _pre_backward(self, u: _Unit) -> None:
        self._ensure_full(u)
        prv = self._neighbour(u, -1)
        if self.prefetch and prv is not None and prv.n_ready == 0:
            self._start_gather(prv)
        if u.n_ready == 0:
            u.t_start = _now()

    # ------------------------------------------------------------------ stages 2-3: gradients
    @torch.no_grad()
    def _on_grad_ready(self, u: _Unit) -> None:
        self._reduced = False
        u.n_ready += 1
        if u.n_ready == len(u.params):   # the whole unit's gradient is final: reduce it now
            self._launch_reduce(u)
            if u is not self.root:
                _record(f"backward {u.name}", u.t_start)
            self._free(u)

    @torch.no_grad()
    def _to_main_grad(self, p: nn.Parameter) -> None:
        """Stages 0-1 with ``main_grads``: add this backward's ``.grad`` into ``p.main_grad``, drop it."""
        p.main_grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def _launch_reduce(self, u: _Unit) -> None:
        flat = torch.zeros(u.padded, dtype=self.reduce_dtype, device=self.device)   # (padded,), freed once reduced
        for p, off in zip(u.params, u.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None                                 # keep only the slice
        u.pending.append(self._submit(self._reduce_scatter, u, flat))
        u.n_ready = 0

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Finish this backward's gradient reduction (``step`` calls it; a second call is a no-op).

        Afterwards rank r holds the gradient averaged over the ranks: the full gradient in
        stage 0, its slice in stages 1-3 (stage 1 keeps the full buffer, only the slice is
        averaged). Parameters that got no gradient contribute zeros, as in DDP.
        """
        if self._reduced:
            return
        for u in self.units:
            if self.stage <= 1:
                for p, off in zip(u.params, u.offsets):   # a fresh .grad (set_to_none): copy in
                    view = u.grad_full[off:off + p.numel()].view(p.shape)
                    if self.main_grads:
                        if p.grad is not None:          # set by hand, not by a backward
                            self._to_main_grad(p)
                    elif p.grad is None:
                        p.grad = view
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                        p.grad = view
                if self.stage == 0:
                    self._submit(self._all_reduce, u).result()
                else:
                    u.grad_full[u.lo:u.hi].copy_(self._submit(self._reduce_scatter, u, u.grad_full).result())
            else:
                if u.n_ready > 0 or (not u.pending and u.grad_shard is None):
                    self._launch_reduce(u)   # unused parameters: zeros
                for fut in u.pending:
                    g = fut.result()
                    u.grad_shard = g if u.grad_shard is None else u.grad_shard.add_(g)
                u.pending = []
                self._free(u)
        self._reduced = True

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Reduce the gradients, step Adam on this rank's slice, and share the new parameters:
        all-gather them into every rank's full buffer (stages 1-2); stage 3 gathers at the next
        forward; stage 0 stepped everything everywhere."""
        self.reduce_gradients()
        for u in self.units:
            g = u.grad_full[u.lo:u.hi] if self.stage <= 1 else u.grad_shard
            u.master.grad = g if g.dtype == self.master_dtype else g.to(self.master_dtype)
        self.optimizer.step()
        for u in self.units:
            if self.mixed:
                u.shard.copy_(u.master)        # fp32 master -> bf16 slice
            u.master.grad = None
        if self.stage in (1, 2):
            for fut in [self._submit(self._all_gather, u) for u in self.units]:
                fut.result()
        self._reduced = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, *, norm_group=None, skip=()) -> torch.Tensor:
        """Reduce the gradients, then scale them so that their global L2 norm is at most ``max_norm``
        (``torch.nn.utils.clip_grad_norm_``'s rule: multiply by ``min(1, max_norm / (norm + 1e-6))``);
        returns the norm before clipping (a float32 scalar, the same on every rank). Call it between
        the backward and :meth:`step`.

        Every gradient element must be counted once. Each rank adds the squares of the elements it
        owns (its slice; in stage 0, where every rank holds all of them, only the group's rank 0), and
        the sums are all-reduced over ``norm_group`` (``None``: this ZeRO's ``group``). When the model
        is also split over other ranks (tensor or pipeline parallelism), pass a group that spans all
        of them (e.g. ``dist.group.WORLD``) and, in ``skip``, this rank's parameters whose gradients
        another rank already counts (a copy replicated over the tensor-parallel ranks, counted on tp
        rank 0 only; the pipeline's second copy of a tied embedding); they are still scaled.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.reduce_gradients()
        skip_ids = {id(p) for p in skip}
        unknown = skip_ids - {id(p) for u in self.units for p in u.params}
        if unknown:
            raise ValueError(f"skip holds {len(unknown)} tensor(s) that are not trainable parameters of "
                             "this ZeRO model; pass the model's own parameters")
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for u in self.units:
            g = u.grad_full[u.lo:u.hi] if self.stage <= 1 else u.grad_shard
            grads.append(g)
            if self.stage == 0 and self.rank != 0:
                continue
            sq += g.double().square().sum()
            for p, off in zip(u.params, u.offsets):   # what another rank counts: take it out again
                lo, hi = max(off, u.lo), min(off + p.numel(), u.hi)
                if id(p) in skip_ids and lo < hi:
                    sq -= g[lo - u.lo:hi - u.lo].double().square().sum()
        group = self.group if norm_group is None else norm_group
        self._submit(lambda: collectives.all_reduce(sq, group=group, builtin=True)).result()
        norm = sq.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (stages 0-1 zero the flat buffer the ``.grad`` views live in)."""
        for u in self.units:
            if u.grad_full is not None:
                u.grad_full.zero_()
            u.grad_shard = None

    def forward(self, *args, **kwargs):
        if self.mixed:   # FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True)
            args = tuple(a.to(self.param_dtype) if torch.is_tensor(a) and a.is_floating_point()
                         else a for a in args)
        if self.root is None or self.stage < 3:
            return self.module(*args, **kwargs)
        self._pre_forward(self.root)
        out = self.module(*args, **kwargs)
        self._post_forward(self.root, out)
        return out

    # ------------------------------------------------------------------ inspection
    def state_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer states this rank holds *now*, measured
        from the storages of its tensors (each storage counted once; padding included).

        ``optimizer_states`` holds Adam's ``exp_avg``/``exp_avg_sq`` (and 4-byte step counters)
        plus, in mixed precision, the fp32 master slice (ZeRO's ``K = 12``). Compare with
        :func:`course_lib.estimate.zero_model_state_bytes` after ``reduce_gradients()``.
        """
        out = {"parameters": 0, "gradients": 0, "optimizer_states": 0}
        seen = set()

        def add(key, t):
            if t is None:
                return
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out[key] += st.nbytes()

        for u in self.units:
            add("parameters", u.full)
            add("parameters", u.shard)
        for p in self.frozen:
            add("parameters", p)
        for u in self.units:
            add("gradients", u.grad_full)
            add("gradients", u.grad_shard)
            for p in u.params:
                add("gradients", p.grad)
        for u in self.units:
            add("optimizer_states", u.master)
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    add("optimizer_states", v)
        return out

    def shard_layout(self) -> dict:
        """Which part of each unit's flat vector this rank keeps, per model state, read from its buffers.

        A plain dict, so that ``cluster.run`` can return it from every rank and
        :func:`course_lib.viz.plot_zero_layout` can draw the list::

            {"rank": r, "world_size": N, "stage": s, "units": [
                {"name": "layers.0", "numel": 36, "padded": 36, "shard_size": 9, "owned": (lo, hi),
                 "parameters": {"lo": 0, "hi": 36, "dtype": "float32", "copies": 1, "bytes": 144},
                 "gradients": {...}, "optimizer_states": {..., "copies": 2}}, ...]}

        ``[lo, hi)`` indexes the unit's padded flat vector (``[numel, padded)`` is the padding);
        ``owned`` is the slice this rank steps. ``copies`` counts the tensors of that range: 1 for
        parameters and gradients; for the optimizer states Adam's ``m`` and ``v``, plus the fp32 master
        slice in mixed precision; ``bytes`` is ``copies * (hi - lo)`` elements of ``dtype`` (Adam's
        4-byte step counters are left out). It describes a rank at rest, between steps: stage 3's
        full parameters exist only while their unit computes, and Adam's states from the first step on.
        """
        def entry(lo, n, dtype, copies=1):
            itemsize = dtype.itemsize
            return {"lo": lo, "hi": lo + n, "dtype": str(dtype).removeprefix("torch."),
                    "copies": copies, "bytes": copies * n * itemsize}

        units = []
        for u in self.units:
            if u.full.untyped_storage().nbytes():            # the full vector is allocated (stages 0-2)
                params = entry(0, u.full.numel(), u.full.dtype)
            else:                                            # stage 3 at rest: only the slice
                params = entry(u.lo, u.shard.numel(), u.shard.dtype)
            if u.grad_full is not None:                      # stages 0-1: a full gradient buffer
                grads = entry(0, u.grad_full.numel(), u.grad_full.dtype)
            else:                                            # stages 2-3: the reduce-scatter's slice
                grads = entry(u.lo, u.shard_size, self.reduce_dtype)
            # Adam's m and v have the master slice's shape; the master is a tensor of its own only
            # in mixed precision (in fp32 it is the parameters' slice itself)
            optim = entry(u.lo, u.master.numel(), u.master.dtype, copies=3 if self.mixed else 2)
            units.append({"name": u.name, "numel": u.numel, "padded": u.padded, "shard_size": u.shard_size,
                          "owned": (u.lo, u.hi), "parameters": params, "gradients": grads,
                          "optimizer_states": optim})
        return {"rank": self.rank, "world_size": self.world_size, "stage": self.stage, "units": units}

    # ------------------------------------------------------------------ checkpoints
    def _adam_state(self, u: _Unit) -> dict:
        state = self.optimizer.state.get(u.master, {})
        if not state:   # before the first step: what Adam starts from (its step count on the CPU, as Adam's)
            return {"exp_avg": torch.zeros_like(u.master), "exp_avg_sq": torch.zeros_like(u.master),
                    "step": torch.tensor(0.0, device="cpu")}
        return state

    @torch.no_grad()
    def sharded_state_dict(self) -> dict:
        """This rank's part of the model states, for a sharded checkpoint
        (:func:`course_lib.checkpoint.save_sharded`): the fp32 master values and Adam's two moments of the
        slice it owns, addressed by *global* offsets so that a checkpoint saved on N ranks loads on M.

        Returns ``{"shards": {key: (start, tensor)}, "lengths": {key: numel}, "replicated": {...}}``
        with keys ``"<unit>/master"``, ``"<unit>/exp_avg"``, ``"<unit>/exp_avg_sq"``; ``start`` is the
        offset into the unit's flat vector without padding (padding is not saved: it depends on N).
        Stage 0 holds everything on every rank, so only rank 0 contributes shards there.
        """
        shards, lengths = {}, {}
        steps = set()
        for u in self.units:
            state = self._adam_state(u)
            steps.add(float(state["step"]))
            hi = min(u.hi, u.numel)
            n = max(0, hi - u.lo)
            for kind, t in (("master", u.master), ("exp_avg", state["exp_avg"]),
                            ("exp_avg_sq", state["exp_avg_sq"])):
                key = f"{u.name}/{kind}"
                lengths[key] = u.numel
                if n and (self.stage > 0 or self.rank == 0):
                    shards[key] = (u.lo, t.detach()[:n].to('cpu', copy=True))
        return {"shards": shards, "lengths": lengths,
                "replicated": {"adam_step": steps.pop() if len(steps) == 1 else sorted(steps),
                               "stage": self.stage, "units": [u.name for u in self.units]}}

    @torch.no_grad()
    def load_sharded_state_dict(self, fetch, replicated: dict) -> None:
        """Load the states saved by :meth:`sharded_state_dict` on any number of ranks.

        ``fetch(key, start, stop)`` returns the values ``[start, stop)`` of the global flat vector
        ``key`` (:func:`course_lib.checkpoint.load_sharded` reads them from whichever shard files hold
        them); ``replicated`` is the saved ``"replicated"`` dict. Every rank of the group must call it.
        """
        names = [u.name for u in self.units]
        if replicated.get("units") != names:
            raise ValueError(f"the checkpoint's ZeRO units {replicated.get('units')} differ from this "
                             f"model's {names}: it was saved from a different model")
        step = replicated["adam_step"]
        for u in self.units:
            hi = min(u.hi, u.numel)
            n = max(0, hi - u.lo)
            values = {}
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                v = torch.zeros(u.master.numel(), dtype=self.master_dtype, device=self.device)
                if n:
                    v[:n] = fetch(f"{u.name}/{kind}", u.lo, hi).to(self.device, self.master_dtype)
                values[kind] = v
            u.master.data.copy_(values["master"])
            if self.mixed or self.stage == 3:
                u.shard.copy_(u.master)
            step_count = torch.tensor(float(step), device="cpu")   # where torch.optim.Adam keeps it
            self.optimizer.state[u.master] = {"step": step_count, "exp_avg": values["exp_avg"],
                                              "exp_avg_sq": values["exp_avg_sq"]}
        if self.stage in (1, 2):   # stage 0's slice is the full buffer; stage 3 gathers at forward
            for fut in [self._submit(self._all_gather, u) for u in self.units]:
                fut.result()

    @torch.no_grad()
    def gather_full_parameters(self) -> list[torch.Tensor]:
        """The trainable parameters (fp32 master values, full shapes, in ``module.parameters()``
        order) on every rank: an all-gather of the master slices, for checks, not for training."""
        result = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=self.master_dtype, device=self.device)
            if self.stage == 0:
                full.copy_(u.master)
            else:
                self._submit(collectives.ring_all_gather, full, u.master.detach(), self.group).result()
            for p, off in zip(u.params, u.offsets):
                result[id(p)] = full[off:off + p.numel()].view(p.shape).clone()
        return [result[id(p)] for p in self.module.parameters() if id(p) in result]

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._comm.shutdown(wait=True)


# ---------------------------------------------------------------------- small helpers
def _in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (a checkpoint re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


def _now() -> float:
    rec = trace.current()
    return rec.now() if rec is not None else 0.0


def _record(name: str, start) -> None:
    """Add a compute span from ``start`` to now to the active recorder (when there is one)."""
    rec = trace.current()
    if rec is not None and start:
        rec.events.append(dict(rank=rec.rank, kind="compute", name=name, start=start,
                               end=rec.now(), bytes_sent=0, bytes_recv=0))


def _tensors(out):
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
