"""Hybrid parallelism: a device mesh from scratch, DP x PP x TP on it, and a layout planner.

A *mesh* arranges the ``world_size`` ranks as an n-dimensional array, one axis per kind of
parallelism. The course's order is ``("dp", "pp", "tp")``, row-major (the last axis varies fastest),
the order of ``torch.distributed.device_mesh.init_device_mesh`` and of Megatron-LM: ranks ``0..t-1``
are one tensor-parallel group, so with ``t`` GPUs per node tensor parallelism stays inside a node, the
pipeline's neighbours are ``t`` ranks apart and the data-parallel replicas furthest apart::

    shape (dp=2, pp=2, tp=2), 8 ranks          rank = (d * pp + s) * tp + k

              dp = 0                 dp = 1
           tp=0   tp=1           tp=0   tp=1
    pp=0  [ 0 ]--[ 1 ]          [ 4 ]--[ 5 ]      -- tp group (all-reduces inside every layer)
            |      |              |      |        |  pp group (activations / gradients, send/recv)
    pp=1  [ 2 ]--[ 3 ]          [ 6 ]--[ 7 ]      dp groups {0,4} {1,5} {2,6} {3,7} (gradients, once a step)

Pieces:

* :class:`Mesh`: the arithmetic (rank <-> coordinates, the ranks of every group along an axis), no
  processes; :func:`mesh_coords` and :func:`axis_groups` are the same as two plain functions.
* :func:`init_process_mesh`: inside a worker, one process group per slice along every axis
  (:class:`ProcessMesh`); :func:`device_mesh_ranks` builds torch's ``DeviceMesh`` to compare with.
* :class:`CommMeter`: counts the bytes this rank sends and receives on each axis of a mesh.
* :class:`HybridGPT`: one rank's share of a :class:`course_lib.models.TinyGPT` trained with
  data parallelism (notebook 04), tensor parallelism (notebook 07) and pipeline parallelism
  (notebook 08) at once, from those notebooks' modules.
* The planner: :class:`ModelSpec`, :class:`ClusterSpec`, :func:`enumerate_layouts`,
  :func:`layout_memory`, :func:`layout_traffic`, :func:`layout_step_time`, :func:`plan_layouts`.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import collectives

__all__ = [
    "AXES", "MeshError", "Mesh", "mesh_coords", "axis_groups",
    "ProcessMesh", "init_process_mesh", "device_mesh_ranks",
    "CommMeter", "HybridGPT", "hybrid_param_count",
    "ModelSpec", "ClusterSpec", "Layout", "enumerate_layouts", "layout_memory", "layout_traffic", "total_traffic",
    "measure_link", "measure_flops",
    "layout_step_time", "plan_layouts", "GPT3_175B", "dgx_a100_cluster",
]

AXES = ("dp", "pp", "tp")


class MeshError(ValueError):
    """A mesh that cannot be built: its shape, names or world size do not fit together."""


# --------------------------------------------------------------------------- the arithmetic
def _check_shape(shape, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if isinstance(shape, dict):
        names, shape = tuple(shape), tuple(shape.values())
    try:
        shape = tuple(shape)
    except TypeError:
        raise MeshError(f"a mesh shape is a tuple of degrees, e.g. (2, 2, 2); got {shape!r}") from None
    names = tuple(names)
    if len(shape) != len(names):
        raise MeshError(f"the shape {shape} has {len(shape)} axes but names {names} has {len(names)}; "
                        f"give one name per axis")
    if len(set(names)) != len(names):
        raise MeshError(f"axis names must be distinct, got {names}")
    for n, d in zip(names, shape):
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise MeshError(f"the {n} degree must be an int >= 1, got {d!r}")
    return tuple(int(d) for d in shape), names


def mesh_coords(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The coordinates of ``rank`` in a row-major mesh of ``shape`` (the last axis varies fastest).

    ``mesh_coords(5, (2, 2, 2)) == (1, 0, 1)``: ``5 = (1 * 2 + 0) * 2 + 1``."""
    shape, _ = _check_shape(shape, [f"axis {i}" for i in range(len(tuple(shape)))])
    size = math.prod(shape)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < size:
        raise MeshError(f"rank must be an int in [0, {size}) for a mesh of shape {shape}, got {rank!r}")
    out = []
    for d in reversed(shape):
        rank, c = divmod(int(rank), d)
        out.append(c)
    return tuple(reversed(out))


def axis_groups(shape: Sequence[int], axis: int) -> list[list[int]]:
    """Every group along ``axis`` (an index) of a row-major mesh: the ranks that differ only in that
    coordinate, in coordinate order; groups ordered by the other coordinates (row-major). Every rank
    is in exactly one group per axis."""
    shape, _ = _check_shape(shape, [f"axis {i}" for i in range(len(tuple(shape)))])
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not 0 <= axis < len(shape):
        raise MeshError(f"axis must be an index in [0, {len(shape)}) for a mesh of shape {shape}, got {axis!r}")
    stride = math.prod(shape[axis + 1:])
    groups = []
    for r in range(math.prod(shape)):
        if mesh_coords(r, shape)[axis] == 0:
            groups.append([r + k * stride for k in range(shape[axis])])
    return groups


class Mesh:
    """A row-major mesh of ``shape`` with axis ``names`` (default ``("dp", "pp", "tp")``).

    ``shape`` may also be a dict ``{"dp": 2, "pp": 2, "tp": 2}``. ``world_size``, when given, must
    equal the product of the degrees (the error says which degrees would do).
    """

    def __init__(self, shape, names: Sequence[str] = AXES, world_size: int | None = None):
        self.shape, self.names = _check_shape(shape, names)
        self.size = math.prod(self.shape)
        if world_size is not None and world_size != self.size:
            raise MeshError(_world_mismatch(self.shape, self.names, world_size))

    def _axis(self, axis) -> int:
        if isinstance(axis, str):
            if axis not in self.names:
                raise MeshError(f"no axis {axis!r} in this mesh; its axes are {self.names}")
            return self.names.index(axis)
        if isinstance(axis, numbers.Integral) and 0 <= axis < len(self.shape):
            return int(axis)
        raise MeshError(f"axis must be one of {self.names} or an index below {len(self.shape)}, got {axis!r}")

    def degree(self, axis) -> int:
        return self.shape[self._axis(axis)]

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": d, "pp": s, "tp": k}`` of ``rank``."""
        return dict(zip(self.names, mesh_coords(rank, self.shape)))

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (every axis must be named)."""
        if set(coords) != set(self.names):
            raise MeshError(f"give a coordinate for every axis {self.names}, got {sorted(coords)}")
        r = 0
        for n, d in zip(self.names, self.shape):
            c = coords[n]
            if not (isinstance(c, numbers.Integral) and 0 <= c < d):
                raise MeshError(f"coordinate {n}={c!r} is outside [0, {d})")
            r = r * d + int(c)
        return r

    def groups(self, axis) -> list[list[int]]:
        """Every group of ranks along ``axis`` (see :func:`axis_groups`)."""
        return axis_groups(self.shape, self._axis(axis))

    def group_of(self, rank: int, axis) -> list[int]:
        """The ranks of ``rank``'s group along ``axis`` (``rank`` included)."""
        for g in self.groups(axis):
            if rank in g:
                return g
        raise MeshError(f"rank {rank!r} is not in this mesh of {self.size} ranks")

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={d}" for n, d in zip(self.names, self.shape)) + ")"


def _world_mismatch(shape, names, world_size: int) -> str:
    size = math.prod(shape)
    return (f"the mesh {dict(zip(names, shape))} has {size} ranks but the world has {world_size}: "
            f"choose degrees whose product is {world_size} (e.g. "
            f"{dict(zip(names, _factor_hint(world_size, len(shape))))})")


def _factor_hint(n: int, k: int) -> tuple[int, ...]:
    """A factorisation of ``n`` into ``k`` degrees, the largest last (for error messages)."""
    out = [1] * k
    i, rest = k - 1, n
    while rest > 1 and i >= 0:
        f = next(f for f in range(2, rest + 1) if rest % f == 0)
        out[i] *= f
        rest //= f
        i = i - 1 if i > 0 else k - 1
    return tuple(out)


# --------------------------------------------------------------------------- process groups
@dataclass
class ProcessMesh:
    """This rank's view of a mesh: its coordinates and one process group per axis.

    Attributes: ``mesh`` (:class:`Mesh`), ``rank`` (global), ``coords`` (``{"dp": .., ...}``),
    ``groups`` (``{axis: ProcessGroup}``: this rank's group along each axis).
    """
    mesh: Mesh
    rank: int
    coords: dict
    groups: dict

    def group(self, axis: str):
        """This rank's process group along ``axis``."""
        return self.groups[self.mesh.names[self.mesh._axis(axis)]]

    def size(self, axis: str) -> int:
        return self.mesh.degree(axis)

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (= its rank inside that axis's group)."""
        return self.coords[self.mesh.names[self.mesh._axis(axis)]]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``."""
        return self.mesh.group_of(self.rank, axis)


def init_process_mesh(shape, names: Sequence[str] = AXES) -> ProcessMesh:
    """Inside a worker: build the mesh's process groups and return this rank's :class:`ProcessMesh`.

    Every rank of the default group must call it with the same ``shape`` (``dist.new_group`` is
    collective: all ranks create every group, in the same order, and keep their own). Raises
    :class:`MeshError` (on every rank, before any group exists) when the shape does not multiply to
    the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_process_mesh needs an initialised default process group: call it inside "
                           "a worker of course_lib.launch.Cluster / run, or after init_from_env under torchrun")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(shape, names)
    if mesh.size != world:
        raise MeshError(_world_mismatch(mesh.shape, mesh.names, world))
    mine = {}
    for n in mesh.names:
        for ranks in mesh.groups(n):
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[n] = g
    return ProcessMesh(mesh, rank, mesh.coords(rank), mine)


def device_mesh_ranks(shape, names: Sequence[str] = AXES, device_type: str | None = None) -> dict:
    """PyTorch's answer: ``init_device_mesh(device_type, shape, mesh_dim_names=names)`` and, for each
    axis, the global ranks of this rank's group (``{axis: [ranks]}``), to compare with our mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = _check_shape(shape, names)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dm = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return {n: sorted(dist.get_process_group_ranks(dm.get_group(n))) for n in names}


# --------------------------------------------------------------------------- measuring traffic
_P2P = ("isend", "irecv", "send", "recv")
_BATCH = "batch_isend_irecv"
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_gather_single", "reduce_scatter_single", "all_to_all",
                "all_to_all_single")


class CommMeter:
    """Count the bytes this process sends and receives on each axis of a mesh, while active.

    ``CommMeter({"tp": tp_group, "pp": pp_group, ...})`` (or ``CommMeter(process_mesh)``, which uses
    its axes). While the ``with`` block runs, ``torch.distributed``'s point-to-point calls
    (``isend``/``irecv``/``send``/``recv``, and each operation of a ``batch_isend_irecv``, the form
    the course's collectives and pipeline runner post) and its collectives are wrapped: each call's
    payload is added to the axis whose group it was given (``"other"`` for any other group,
    ``"world"`` for the default one). The course's ring collectives, the pipeline runner and the tensor-parallel layers
    (with ``builtin=False``) all communicate point to point, so for them ``sent``/``recv`` are the bytes
    that went onto the wire. A built-in collective's internal traffic is the backend's business: its
    payload goes to ``collective`` (counted, not claimed as wire bytes).

    Attributes after (or during) the block: ``sent``, ``recv``, ``collective`` (``{axis: bytes}``),
    ``messages`` (``{axis: number of point-to-point sends}``). One process, one thread: wrapping is
    undone on exit and meters do not nest.
    """

    _active = False

    def __init__(self, groups):
        if isinstance(groups, ProcessMesh):
            groups = dict(groups.groups)
        if not isinstance(groups, dict):
            raise TypeError(f"CommMeter takes {{axis: process group}} or a ProcessMesh, got {type(groups).__name__}")
        self.groups = dict(groups)
        names = list(self.groups) + ["other", "world"]
        self.sent = dict.fromkeys(names, 0)
        self.recv = dict.fromkeys(names, 0)
        self.collective = dict.fromkeys(names, 0)
        self.messages = dict.fromkeys(names, 0)
        self._saved: dict = {}

    def _axis(self, group) -> str:
        for n, g in self.groups.items():
            if g is group:
                return n
        return "world" if group is None or group is dist.group.WORLD else "other"

    def _wrap(self, name: str, fn):
        meter = self

        def wrapped(tensor, *args, **kwargs):
            group = kwargs.get("group")
            if group is None and len(args) >= 2 and name in _P2P:
                group = args[1]
            axis = meter._axis(group)
            blocks = tensor if isinstance(tensor, (list, tuple)) else [tensor]   # all_to_all: a list
            nbytes = sum(t.numel() * t.element_size() for t in blocks)
            if name in ("isend", "send"):
                meter.sent[axis] += nbytes
                meter.messages[axis] += 1
            elif name in ("irecv", "recv"):
                meter.recv[axis] += nbytes
            else:
                meter.collective[axis] += nbytes
            return fn(tensor, *args, **kwargs)

        wrapped.__wrapped__ = fn
        return wrapped

    def _wrap_batch(self, fn):
        meter = self
        isend = dist.distributed_c10d.isend   # what P2POp holds: torch's own function, never a wrapper

        def wrapped(p2p_ops, *args, **kwargs):
            for op in p2p_ops:
                axis = meter._axis(op.group)
                nbytes = op.tensor.numel() * op.tensor.element_size()
                if getattr(op.op, "__wrapped__", op.op) is isend:
                    meter.sent[axis] += nbytes
                    meter.messages[axis] += 1
                else:
                    meter.recv[axis] += nbytes
            return fn(p2p_ops, *args, **kwargs)

        wrapped.__wrapped__ = fn
        return wrapped

    def __enter__(self) -> "CommMeter":
        if CommMeter._active:
            raise RuntimeError("a CommMeter is already active in this process; meters do not nest")
        CommMeter._active = True
        self._saved[_BATCH] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(dist.batch_isend_irecv)
        for name in _P2P + _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:   # all_gather_single / reduce_scatter_single: torch >= 2.13 only
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        CommMeter._active = False

    def totals(self) -> dict:
        """``{axis: bytes sent}`` for the axes of the mesh (plus ``other``/``world`` when non-zero)."""
        return {n: b for n, b in self.sent.items() if n in self.groups or b}


# --------------------------------------------------------------------------- DP x PP x TP
class _Embed(nn.Module):
    """Stage 0's first layer: vocabulary-parallel token embedding + replicated position embedding."""

    def __init__(self, wte: nn.Module, wpe: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)          # (B, T, h), the same on every tp rank


class _Head(nn.Module):
    """The last stage's final layer norm and LM head, tied to the token embedding: ``x W_r^T`` gives
    this rank's vocabulary slice of the logits ``(B, T, V/t)`` (the loss is vocabulary parallel)."""

    def __init__(self, ln_f: nn.LayerNorm, weight: nn.Parameter, group, builtin: bool):
        super().__init__()
        from course_lib.tensor_parallel import copy_to_tensor_parallel
        self._f = copy_to_tensor_parallel
        self.ln_f, self.weight, self.group, self.builtin = ln_f, weight, group, builtin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._f(self.ln_f(x), self.group, builtin=self.builtin)   # f: all-reduce in the backward
        return F.linear(x, self.weight)                                # (B, T, V/t)


class HybridGPT:
    """One rank's share of a :class:`course_lib.models.TinyGPT` under data x pipeline x tensor
    parallelism, built from the course's own modules:

    * pipeline (notebook 08): the blocks are cut into ``pp`` stages balanced by block count
      (:func:`course_lib.pipeline.balance`); stage 0 also holds the embeddings, the last stage the
      final layer norm and the LM head; one step runs a schedule (``"1f1b"`` by default) with
      :func:`course_lib.pipeline.run_schedule` over the ``pp`` group;
    * tensor (notebook 07): every block becomes a :class:`course_lib.tensor_parallel.ParallelBlock`
      on the ``tp`` group, the token embedding a ``VocabParallelEmbedding`` and the loss
      :func:`~course_lib.tensor_parallel.vocab_parallel_cross_entropy`;
    * data (notebook 04): after the pipeline's backward every gradient is averaged over the ``dp``
      group with one ring all-reduce of all of them flattened (:func:`course_lib.collectives.ring_all_reduce`,
      one bucket).

    The LM head is tied to the token embedding (as GPT-2). With ``pp > 1`` they live on different
    ranks, so the last stage keeps a copy and the two copies' gradients are summed over a group of
    {first stage, last stage} ranks (Megatron-LM's "embedding group") before the data-parallel average;
    both copies then take the same optimizer step.

    Args:
        model: the full model (every rank passes the same one, e.g. built from the same seed); its
            weights are copied into the shards, ``model`` itself is not changed.
        pmesh: this rank's :class:`ProcessMesh` with axes ``dp``, ``pp`` and ``tp``.
        schedule: a name of :data:`course_lib.pipeline.SCHEDULES` without virtual stages
            (``"1f1b"``, ``"gpipe"``, ``"zb-h1"``).
        builtin: torch's collectives for tensor and data parallelism instead of the course's rings.

    ``tp`` must divide the heads and the vocabulary, ``pp`` must not exceed the number of blocks.
    """

    def __init__(self, model: nn.Module, pmesh: ProcessMesh, *, schedule: str = "1f1b", builtin: bool = False):
        from course_lib import pipeline

        if set(pmesh.mesh.names) != set(AXES):
            raise MeshError(f"HybridGPT needs a mesh with axes {AXES}, got {pmesh.mesh.names}")
        if schedule not in pipeline.SCHEDULES or schedule in ("interleaved", "naive"):
            raise ValueError(f"schedule must be one of 'gpipe', '1f1b', 'zb-h1' (one stage per rank), got {schedule!r}")
        dp, pp, tp = (pmesh.size(a) for a in AXES)
        L, heads = len(model.blocks), model.blocks[0].attn.n_head
        vocab = model.wte.num_embeddings
        if heads % tp or vocab % tp:
            raise MeshError(f"tp={tp} must divide the number of heads ({heads}) and the vocabulary ({vocab}); "
                            f"choose tp among {[d for d in range(1, heads + 1) if heads % d == 0 and vocab % d == 0]}")
        if pp > L:
            raise MeshError(f"pp={pp} stages but the model has {L} blocks: every stage needs at least one; "
                            f"use pp <= {L} or a deeper model")
        self.pmesh, self.schedule_name, self.builtin = pmesh, schedule, builtin
        self.dp, self.pp, self.tp = dp, pp, tp
        self.stage = pmesh.local_rank("pp")
        self.bounds = pipeline.balance([1.0] * L, pp)
        self.module = self._build(model)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        # the embedding group: the first and the last stage of my (dp, tp) pipeline (all ranks create all)
        self.tied_group = None
        if pp > 1:
            mesh = pmesh.mesh
            for d in range(dp):
                for k in range(tp):
                    ranks = [mesh.rank_of(dp=d, pp=0, tp=k), mesh.rank_of(dp=d, pp=pp - 1, tp=k)]
                    g = dist.new_group(ranks)
                    if pmesh.rank in ranks:
                        self.tied_group = g

    def _build(self, model: nn.Module) -> nn.Sequential:
        """This rank's stage of ``model``, sharded for tensor parallelism (weights copied)."""
        from course_lib.tensor_parallel import VocabParallelEmbedding

        tp_group = self.pmesh.group("tp")
        layers: list[nn.Module] = []
        wte = VocabParallelEmbedding.from_embedding(model.wte, tp_group, builtin=self.builtin)
        if self.stage == 0:
            layers.append(_Embed(wte, copy.deepcopy(model.wpe)))
        for i in self.bounds[self.stage]:
            layers.append(self._shard_block(model.blocks[i], tp_group))
        if self.stage == self.pp - 1:
            # one stage: the head shares the embedding's Parameter (tied); else a copy, kept in sync
            weight = wte.weight if self.stage == 0 else nn.Parameter(wte.weight.detach().clone())
            layers.append(_Head(copy.deepcopy(model.ln_f), weight, tp_group, self.builtin))
        return nn.Sequential(*layers)

    def _shard_block(self, block: nn.Module, tp_group) -> nn.Module:
        """One block of this stage, tensor parallel (subclasses add recomputation or MoE blocks)."""
        from course_lib.tensor_parallel import ParallelBlock
        return ParallelBlock.from_block(block, tp_group, builtin=self.builtin)

    def comm_groups(self) -> dict:
        """``{"dp", "pp", "tp", "tied"}`` -> this rank's process groups (for :class:`CommMeter`)."""
        return {**self.pmesh.groups, "tied": self.tied_group}

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (shards and replicated ones), each once."""
        return list(self.module.parameters())

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors of ``model`` that this rank's :meth:`parameters` hold, in the same order and
        shape: shard a model whose weights are, e.g., the full model's gradients to get the slice
        each local gradient must equal."""
        return [p.detach() for p in self._build(model).parameters()]

    def _tied(self) -> list[nn.Parameter]:
        if self.pp == 1 or not (self.first or self.last):
            return []                  # one stage: one shared Parameter; a middle stage: neither copy
        return [self.module[0].wte.weight] if self.first else [self.module[-1].weight]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from course_lib.tensor_parallel import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits, target, self.pmesh.group("tp"), builtin=self.builtin)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, n_micro: int, sync_dp: bool = True) -> float | None:
        """Gradients of the mean loss over the global batch ``(x, y)`` (every rank passes all of it):
        this rank's data-parallel shard is cut into ``n_micro`` micro-batches and pipelined, then the
        tied embedding and (with ``sync_dp``) the data-parallel replicas are synchronised; pass
        ``sync_dp=False`` when an optimizer such as ZeRO reduces the gradients itself. Returns this
        replica's mean loss on last-stage ranks, ``None`` elsewhere. Gradients accumulate: call
        :meth:`zero_grad`."""
        from course_lib import pipeline
        from course_lib.data_parallel import shard_range

        n = x.shape[0]
        if n % self.dp:
            raise ValueError(f"the global batch of {n} sequences does not split into dp={self.dp} equal "
                             f"shards; use a multiple of {self.dp}")
        mine = shard_range(n, self.pmesh.local_rank("dp"), self.dp)
        xs = pipeline.split_microbatches(x[mine], n_micro) if self.first else None
        ys = pipeline.split_microbatches(y[mine], n_micro) if self.last else None
        sched = pipeline.make_schedule(self.schedule_name, self.pp, n_micro)
        out = pipeline.run_schedule(sched, {self.stage: self.module}, xs, ys,
                                    self.loss_fn if self.last else None, self.pmesh.group("pp"))
        for p in self._tied():                          # embedding group: sum the two copies' gradients
            g = getattr(p, "main_grad", None)           # ZeRO(reduce_dtype=...)'s fp32 gradient, if any
            self._all_reduce(p.grad if g is None else g, self.tied_group)
        if self.dp > 1 and sync_dp:                     # data parallel: one flat bucket, then average
            params = [p for p in self.parameters() if p.grad is not None]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self._all_reduce(flat, self.pmesh.group("dp"))
            flat /= self.dp
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return out["loss"]

    def _all_reduce(self, t: torch.Tensor, group) -> None:
        collectives.all_reduce(t, group=group, builtin=self.builtin)

    def __repr__(self) -> str:
        c = self.pmesh.coords
        return (f"HybridGPT(rank {self.pmesh.rank}: dp={c['dp']}/{self.dp}, stage {self.stage}/{self.pp} "
                f"blocks {list(self.bounds[self.stage])}, tp={c['tp']}/{self.tp})")


def hybrid_param_count(n_layer: int, hidden: int, vocab: int, block_size: int, tp: int, pp: int) -> dict:
    """Parameters of :class:`HybridGPT` (a TinyGPT: 4x MLP, biases, tied head) summed over the ranks
    of one data-parallel replica (``tp * pp`` ranks), counting every replicated copy: tensor
    parallelism splits the matrices and the QKV / MLP-input biases but replicates the layer norms,
    the output-projection biases and the position embedding on all ``t`` ranks, and ``pp > 1`` keeps
    a second copy of the tied embedding on the last stage.

    Returns ``{"sharded", "replicated", "tied_copy", "total"}``; ``total`` over a replica is what a
    data-parallel all-reduce of all gradients carries."""
    h, t = hidden, tp
    sharded = n_layer * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) + vocab * h
    replicated_once = n_layer * (2 * h + 2 * h + h + h) + block_size * h + 2 * h
    tied = vocab * h if pp > 1 else 0
    return {"sharded": sharded, "replicated": t * replicated_once, "tied_copy": tied,
            "total": sharded + t * replicated_once + tied}


# --------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a GPT: ``n_layer``, ``hidden``, ``heads``, ``seq``
    (sequence length), ``vocab``, ``global_batch`` (sequences per optimizer step) and, optionally,
    ``n_params`` (default: :func:`course_lib.estimate.gpt_param_count` with the vocabulary and ``seq``
    learned positions, the LM head tied)."""
    name: str
    n_layer: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    n_params: float = 0.0

    def __post_init__(self):
        for k in ("n_layer", "hidden", "heads", "seq", "vocab", "global_batch"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"ModelSpec.{k} must be a positive int, got {v!r}")
        if not self.n_params:
            from course_lib.estimate import gpt_param_count
            object.__setattr__(self, "n_params", float(gpt_param_count(self.n_layer, self.hidden, self.vocab, self.seq)))


@dataclass(frozen=True)
class ClusterSpec:
    """A GPU cluster: ``nodes`` x ``gpus_per_node``; per GPU ``memory`` (bytes), ``peak_flops`` (dense
    16-bit FLOP/s) and ``efficiency`` (the fraction of peak its matmuls reach); per GPU and direction
    ``intra_bw`` (NVLink, bytes/s) and ``inter_bw`` (its network adapter, bytes/s); latencies (alpha,
    seconds) ``intra_latency`` / ``inter_latency``."""
    name: str
    nodes: int
    gpus_per_node: int
    memory: float
    peak_flops: float
    efficiency: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def dgx_a100_cluster(nodes: int, memory_gb: float = 80.0, efficiency: float = 0.5) -> ClusterSpec:
    """DGX A100 nodes: 8 A100s, 312 TFLOP/s dense bf16 each, NVLink 3 at 300 GB/s per direction per GPU,
    one InfiniBand HDR adapter (200 Gb/s = 25 GB/s) per GPU (NVIDIA A100 datasheet, DGX A100 user
    guide; the figures notebook 07 uses). ``efficiency``: the matmuls' fraction of peak (an assumption)."""
    return ClusterSpec(f"{nodes} x DGX A100 ({memory_gb:g} GB)", nodes, 8, memory_gb * 1e9, 312e12,
                       efficiency, 300e9, 25e9)


#: GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048,
#: batch 3.2M tokens = 1536 sequences of 2048 (as Narayanan et al. 2021 train it); GPT-2's 50257-token
#: vocabulary.
GPT3_175B = ModelSpec("GPT-3 175B", n_layer=96, hidden=12288, heads=96, seq=2048, vocab=50257,
                      global_batch=1536)


@dataclass
class Layout:
    """One candidate: degrees ``dp``, ``tp``, ``pp``, ``micro_batch`` (sequences per micro-batch) and
    ``m`` (micro-batches per step per replica); filled in by :func:`plan_layouts`: ``memory`` and
    ``time`` (dicts, bytes and seconds), ``fits`` and ``axis_links`` (``{axis: "nvlink"/"network"}``)."""
    dp: int
    tp: int
    pp: int
    micro_batch: int
    m: int
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)
    fits: bool = True
    axis_links: dict = field(default_factory=dict)

    @property
    def degrees(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.pp)

    def __str__(self) -> str:
        s = f"dp={self.dp:<3d} tp={self.tp:<2d} pp={self.pp:<3d} micro-batch={self.micro_batch:<2d} m={self.m:<4d}"
        if self.memory:
            s += f" memory {self.memory['total'] / 1e9:6.1f} GB"
        if self.time:
            s += f"  step {self.time['step']:7.2f} s"
        return s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelSpec, world_size: int, micro_batches: Iterable[int] | None = None) -> list[Layout]:
    """Every valid ``(dp, tp, pp, micro_batch)`` for ``model`` on ``world_size`` GPUs:

    * ``dp * tp * pp == world_size``;
    * ``tp`` divides the heads (each rank gets whole heads) and the hidden size;
    * ``pp`` divides the layers (equal stages, as Megatron-LM requires);
    * ``dp`` divides the global batch, and ``micro_batch`` divides each replica's ``global_batch / dp``
      sequences (``m = global_batch / (dp * micro_batch)`` micro-batches);
    * ``micro_batch`` among ``micro_batches`` when given (default: every divisor).

    Ordered by (dp, tp, pp, micro_batch)."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    allowed = None if micro_batches is None else set(micro_batches)
    out = []
    for tp in _divisors(world_size):
        if model.heads % tp or model.hidden % tp:
            continue
        for pp in _divisors(world_size // tp):
            if model.n_layer % pp:
                continue
            dp = world_size // (tp * pp)
            if model.global_batch % dp:
                continue
            per_replica = model.global_batch // dp
            for mb in _divisors(per_replica):
                if allowed is not None and mb not in allowed:
                    continue
                out.append(Layout(dp, tp, pp, mb, per_replica // mb))
    return sorted(out, key=lambda l: (l.dp, l.tp, l.pp, l.micro_batch))


def layout_memory(model: ModelSpec, layout: Layout, zero_stage: int = 1, sequence_parallel: bool = True,
                  recompute: str = "selective", grad_bytes: int = 4) -> dict:
    """Predicted bytes on the busiest GPU (the first pipeline stage) with mixed-precision Adam:

    * model states (notebook 06): :func:`course_lib.estimate.zero_model_state_bytes` of the parameters
      split ``tp * pp`` ways, with ZeRO ``zero_stage`` over the ``dp`` replicas, and ``grad_bytes`` per
      gradient value: 4 for Megatron-LM's fp32 main gradients (bf16 parameters, gradients accumulated
      and reduced in fp32: its distributed optimizer, ``zero_stage=1``, holds ``6 + 12/d`` bytes per
      parameter, Megatron-Core's distributed-optimizer docs), 2 for the ZeRO paper's accounting
      (``2 + 2 + 12/d``);
    * activations (notebook 01 / 07, Korthikanti et al. 2022 Table 2): per layer and micro-batch
      :func:`course_lib.estimate.activation_bytes_per_layer`; under 1F1B the first stage holds
      ``min(pp, m)`` micro-batches of its ``L / pp`` layers (Korthikanti §4.2.3: ``L`` layers' worth
      when ``m >= pp``, whatever ``pp``).

    Returns ``{"parameters", "gradients", "optimizer_states", "activations", "total"}``."""
    from course_lib.estimate import activation_bytes_per_layer, zero_model_state_bytes

    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes is 2 (bf16 gradients) or 4 (fp32 main gradients), got {grad_bytes!r}")
    states = zero_model_state_bytes(model.n_params / (layout.tp * layout.pp), zero_stage, layout.dp)
    states["gradients"] *= grad_bytes / 2            # zero_model_state_bytes counts 2-byte gradients
    per_layer = activation_bytes_per_layer(model.seq, layout.micro_batch, model.hidden, model.heads,
                                           tp=layout.tp, sequence_parallel=sequence_parallel and layout.tp > 1,
                                           recompute=recompute)
    in_flight = min(layout.pp, layout.m)
    out = dict(states)
    out["activations"] = model.n_layer / layout.pp * in_flight * per_layer
    out["total"] = sum(out.values())
    return out


def layout_traffic(model: ModelSpec, layout: Layout, stage: int = 0, bytes_per_value: int = 2,
                   header_bytes: int = 0) -> dict:
    """Bytes one GPU of pipeline ``stage`` sends per optimizer step on each axis, ring collectives:

    * ``tp``: 4 all-reduces per layer and micro-batch of ``b s h`` values (notebook 07) over the
      stage's ``L / pp`` layers and ``m`` micro-batches, plus one for the vocabulary-parallel embedding
      (first stage, forward) and one for the LM head (last stage, backward), plus the loss's two
      all-reduces of one value per token (last stage);
    * ``pp``: an activation to the next stage and a gradient to the previous one, ``b s h`` values
      each per micro-batch, plus ``header_bytes`` once per neighbour (the course's runner sends a
      72-byte shape header);
    * ``dp``: one all-reduce of the GPU's gradients (``n_params / (tp pp)`` values; also what ZeRO-1's
      reduce-scatter + all-gather move). Replicated layer norms and biases are not counted;
    * ``tied``: with ``pp > 1`` the first and last stages sum the tied embedding's gradient
      (``V h / t`` values, a ring of 2).

    Returns ``{"tp", "pp", "dp", "tied"}`` in bytes."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must be in [0, {layout.pp}), got {stage!r}")
    from course_lib.collectives import ring_all_reduce_bytes as ring
    from course_lib.tensor_parallel import tp_bytes_per_layer

    first, last = stage == 0, stage == layout.pp - 1
    b, t, m = layout.micro_batch, layout.tp, layout.m
    n_mb = b * model.seq * model.hidden * bytes_per_value
    layers = model.n_layer / layout.pp
    per_all_reduce = tp_bytes_per_layer(b, model.seq, model.hidden, t, bytes_per_value)["sent_per_all_reduce"]
    tp = m * (4 * layers + first + last) * per_all_reduce + last * m * 2 * ring(b * model.seq * bytes_per_value, t)
    neighbours = (not last) + (not first) if layout.pp > 1 else 0
    return {
        "tp": tp,
        "pp": neighbours * (m * n_mb + header_bytes),
        "dp": ring(model.n_params / (t * layout.pp) * bytes_per_value, layout.dp),
        "tied": ring(model.vocab * model.hidden / t * bytes_per_value, 2) if layout.pp > 1 and (first or last) else 0.0,
    }


def total_traffic(model: ModelSpec, layout: Layout, bytes_per_value: int = 2, header_bytes: int = 0) -> dict:
    """:func:`layout_traffic` summed over every GPU of the layout (all stages, ``dp * tp`` GPUs each)."""
    out = dict.fromkeys(("tp", "pp", "dp", "tied"), 0.0)
    for s in range(layout.pp):
        for k, v in layout_traffic(model, layout, s, bytes_per_value, header_bytes).items():
            out[k] += layout.dp * layout.tp * v
    return out


def _axis_links(layout: Layout, gpus_per_node: int) -> dict:
    """``{axis: "nvlink" | "network"}``: does every group of the axis sit inside one node? Ranks are
    placed row-major (dp, pp, tp), ``gpus_per_node`` consecutive ranks per node."""
    world = layout.dp * layout.tp * layout.pp
    out = {}
    for a, k, stride in (("dp", layout.dp, layout.tp * layout.pp), ("pp", layout.pp, layout.tp),
                         ("tp", layout.tp, 1)):
        # a group is {first + j * stride}; its first members are the ranks whose coordinate on `a` is 0
        firsts = (r for r in range(world) if (r // stride) % k == 0)
        inside = all(f // gpus_per_node == (f + (k - 1) * stride) // gpus_per_node for f in firsts)
        out[a] = "nvlink" if inside else "network"
    return out


def layout_step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout, bytes_per_value: int = 2) -> dict:
    """Predicted seconds of one optimizer step (assumptions stated; nothing overlaps):

    * ``compute``: ``m`` micro-batches of the stage's share of the training FLOPs
      (:func:`course_lib.estimate.gpt_training_flops` / (tp pp)) at ``peak_flops * efficiency``;
      recomputation is not counted (selective recomputation adds s / (3 (6h + s)) of a step, 0.9 % for
      GPT-3 175B at s = 2048; Korthikanti et al. §5 quote 2.7 %, the same FLOPs relative to the forward);
    * ``tp``: the first stage's all-reduces per micro-batch (4 per layer and the embedding's), alpha-beta
      (notebook 03, :func:`course_lib.tensor_parallel.tp_comm_seconds`) on NVLink when the tp group is
      inside a node, else on the network;
    * ``pp``: each of the ``m + pp - 1`` pipeline slots waits for one activation hop and one gradient hop;
    * ``bubble``: ``(pp - 1)`` slots of a micro-batch's compute + tp time (1F1B / GPipe, notebook 08);
    * ``dp``: one ring all-reduce of the GPU's gradients after the backward.

    Returns ``{"compute", "tp", "pp", "bubble", "dp", "step"}``."""
    from course_lib.collectives import ring_all_reduce_bytes as ring
    from course_lib.estimate import gpt_training_flops
    from course_lib.tensor_parallel import tp_comm_seconds

    links = _axis_links(layout, cluster.gpus_per_node)

    def link(axis):
        return ((cluster.intra_bw, cluster.intra_latency) if links[axis] == "nvlink"
                else (cluster.inter_bw, cluster.inter_latency))

    flops_mb = gpt_training_flops(model.n_layer, layout.micro_batch, model.seq, model.hidden,
                                  model.vocab) / (layout.tp * layout.pp)
    t_mb = flops_mb / (cluster.peak_flops * cluster.efficiency)
    n_mb = layout.micro_batch * model.seq * model.hidden * bytes_per_value
    layers = model.n_layer / layout.pp
    bw, lat = link("tp")
    n_ar = 4 * layers + 1 + (layout.pp == 1)     # the first stage's: its layers', the embedding's (and the head's)
    # tp_comm_seconds is a layer's 4 all-reduces of b s h values: a quarter of it per all-reduce
    tp_mb = n_ar * tp_comm_seconds(layout.micro_batch, model.seq, model.hidden, layout.tp, bw, lat,
                                   bytes_per_value) / 4 if layout.tp > 1 else 0.0
    bw, lat = link("pp")
    hop = 2 * (lat + n_mb / bw) if layout.pp > 1 else 0.0
    bw, lat = link("dp")
    grads = model.n_params / (layout.tp * layout.pp) * bytes_per_value
    t_dp = (2 * (layout.dp - 1) * lat + ring(grads, layout.dp) / bw) if layout.dp > 1 else 0.0
    out = {"compute": layout.m * t_mb, "tp": layout.m * tp_mb,
           "pp": (layout.m + layout.pp - 1) * hop,
           "bubble": (layout.pp - 1) * (t_mb + tp_mb), "dp": t_dp}
    out["step"] = sum(out.values())
    return out


def plan_layouts(model: ModelSpec, cluster: ClusterSpec, micro_batches: Iterable[int] | None = (1, 2, 4, 8),
                 zero_stage: int = 1, sequence_parallel: bool = True, recompute: str = "selective",
                 reserve: float = 0.1, grad_bytes: int = 4) -> list[Layout]:
    """Every valid layout of ``model`` on ``cluster`` (:func:`enumerate_layouts`) with its predicted
    memory (:func:`layout_memory`), traffic (:func:`layout_traffic`) and step time
    (:func:`layout_step_time`); ``fits`` when the memory is within ``(1 - reserve)`` of the GPU's
    (a share kept for buffers and fragmentation). ``grad_bytes`` as in :func:`layout_memory` (default 4:
    Megatron-LM's fp32 main gradients). Sorted: layouts that fit first, fastest first."""
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve is a fraction of the GPU's memory in [0, 1), got {reserve!r}")
    out = []
    for lay in enumerate_layouts(model, cluster.world_size, micro_batches):
        lay.memory = layout_memory(model, lay, zero_stage, sequence_parallel, recompute, grad_bytes)
        lay.traffic = layout_traffic(model, lay)
        lay.time = layout_step_time(model, cluster, lay)
        lay.fits = lay.memory["total"] <= (1 - reserve) * cluster.memory
        lay.axis_links = _axis_links(lay, cluster.gpus_per_node)
        out.append(lay)
    return sorted(out, key=lambda l: (not l.fits, l.time["step"]))


# --------------------------------------------------------------------------- calibrating a machine
def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_link(group=None, sizes: tuple[int, int] = (64, 4 << 20), repeats: int = 5,
                 device: torch.device | str | None = None) -> tuple[float, float]:
    """``(alpha, bandwidth)`` of the links between the ranks of ``group`` (every rank calls it), fitted
    to the course's ring all-reduce: ``t(n) = 2 (N-1) alpha + 2 (N-1)/N n / bandwidth`` through the
    median times of a small and a large float32 message (bytes ``sizes``). On the virtual cluster
    this measures loopback TCP and the processes' scheduling, not a network. The messages are on
    ``device`` (default: :func:`course_lib.collectives.comm_device` of ``group``, the GPU under NCCL)."""
    N = dist.get_world_size(group)
    if N < 2:
        raise ValueError("measure_link needs a group of at least 2 ranks")
    device = collectives.comm_device(group) if device is None else torch.device(device)
    times = []
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // 4, N), device=device)
        collectives.ring_all_reduce(t, group=group)           # warm-up
        ts = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            collectives.ring_all_reduce(t, group=group)
            ts.append(time.perf_counter() - t0)
        times.append(_median(ts))
    (n0, n1), (t0, t1) = [max(n // 4, N) * 4 for n in sizes], times
    inv_bw = max((t1 - t0) / (2 * (N - 1) / N * (n1 - n0)), 1e-15)
    alpha = max((t0 - 2 * (N - 1) / N * n0 * inv_bw) / (2 * (N - 1)), 0.0)
    return alpha, 1.0 / inv_bw


def measure_flops(fn, flops: float, group=None, repeats: int = 5) -> float:
    """FLOP/s of ``fn()`` (which does ``flops`` floating-point operations) when every rank of ``group``
    runs it at the same moment: the rate a rank gets while the others compute too (on the virtual
    cluster they share the machine's cores). Median of ``repeats`` after one warm-up."""
    fn()
    ts = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return flops / _median(ts)
