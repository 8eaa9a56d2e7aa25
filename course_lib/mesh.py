"""A device mesh from scratch: ranks as an n-dimensional array, one process group per axis slice.

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

A fourth axis, ``cp`` (context parallelism: the sequence split over ranks, notebook 15), goes between
``pp`` and ``tp``: :data:`CP_AXES` ``("dp", "pp", "cp", "tp")``, the order of Llama 3's
``[TP, CP, PP, DP]`` groups (innermost first; Dubey et al. 2024, arXiv:2407.21783, §3.3.2): the
ring's neighbours are ``t`` ranks apart, next to the tensor-parallel group::

    shape (dp=2, pp=1, cp=2, tp=1), 4 ranks      rank = ((d * pp + s) * cp + c) * tp + k
    cp groups {0,1} {2,3} (K/V blocks, every layer)     dp groups {0,2} {1,3}

What runs on a mesh lives next door (notebook 09): :mod:`course_lib.hybrid_gpt` (the tiny GPT trained
with data x pipeline x tensor parallelism on a ``(dp, pp, tp)`` mesh) and :mod:`course_lib.planner`
(which layout to choose for a model on a cluster: memory, traffic and step time of every layout).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

__all__ = [
    "AXES", "CP_AXES", "MeshError", "Mesh", "mesh_coords", "axis_groups",
    "ProcessMesh", "init_process_mesh", "device_mesh_ranks", "CommMeter",
]

AXES = ("dp", "pp", "tp")
CP_AXES = ("dp", "pp", "cp", "tp")   # with context parallelism (notebook 15)


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

