"""Tensor parallelism from scratch: Megatron-LM's layers on ``torch.distributed`` (Shoeybi et al. 2019).

A linear layer ``Y = X W^T`` (``W``: ``(out, in)``, as ``nn.Linear`` stores it) is split across the
``t`` ranks of a tensor-parallel group in one of two ways::

    column parallel (split the outputs)         row parallel (split the inputs)
    W = [W_0; W_1; ...]   rows of W             W = [W_0 | W_1 | ...]  columns of W
    X ──f──┬── X W_0^T = Y_0   (rank 0)         X_0 W_0^T ─┐
           └── X W_1^T = Y_1   (rank 1)         X_1 W_1^T ─┴──g── Y = sum_r X_r W_r^T
    every rank needs all of X, gets a slice     every rank has a slice of X, gets a partial sum
    of Y's features                             that one all-reduce completes

A column-parallel layer followed by a row-parallel one needs *no* communication in between: the
column layer's output slice is exactly the row layer's input slice. So Megatron's MLP
(``fc`` column parallel, GELU on each slice, ``fc_proj`` row parallel) and attention (heads split:
``qkv`` column parallel by heads, ``proj`` row parallel) each cost one all-reduce forward and one
backward. The two *conjugate operators* (Shoeybi et al. §3, Fig. 3) carry that communication:

=========================================  ========================  =========================
operator                                   forward                   backward
=========================================  ========================  =========================
:func:`copy_to_tensor_parallel` ("f")      identity                  all-reduce the gradient
:func:`reduce_from_tensor_parallel` ("g")  all-reduce                identity
:func:`gather_from_sequence_parallel`      all-gather the sequence   reduce-scatter
:func:`reduce_scatter_to_sequence_parallel`  reduce-scatter            all-gather
:func:`scatter_to_sequence_parallel`       keep my sequence chunk    all-gather
=========================================  ========================  =========================

Sequence parallelism (Korthikanti et al. 2022, §4.2.2) replaces each ``f`` by an all-gather and each
``g`` by a reduce-scatter along the sequence, so layer norm and dropout run on ``s/t`` tokens per rank
and their activations are split too; the bytes moved stay the same (an all-reduce *is* a
reduce-scatter plus an all-gather).

Per transformer layer and micro-batch, tensor parallelism costs 4 all-reduces (2 forward, 2
backward) of ``b s h`` values each: :func:`tp_bytes_per_layer` gives the ring's bytes per rank, and
:func:`tp_comm_seconds` its time under the alpha-beta model of notebook 03.

Collectives. ``builtin=False`` (default) runs the course's ring collectives
(:mod:`course_lib.collectives`, isend/irecv; their transfers are recorded in an active
:class:`course_lib.trace.Recorder`); ``builtin=True`` uses ``dist.all_reduce`` and friends (NCCL on
GPUs). Either way, every collective is recorded in an active recorder as one span of kind ``"comm"``
named after the operation, ``"all-reduce: <what>"``, ``"all-gather: <what>"`` or
``"reduce-scatter: <what>"`` (:mod:`course_lib.trace`'s vocabulary), which is how the notebook counts them.
Every layer takes its process group explicitly (``group=None``: the default group).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import collectives, trace
from course_lib.models import causal_attention

__all__ = [
    "even_shard",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelBlock",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "all_reduce_sequence_parallel_grads",
    "tp_bytes_per_layer",
    "tp_comm_seconds",
]


# --------------------------------------------------------------------------- groups and shards

def _size_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs an initialised process group: run the code on "
                           "the ranks of course_lib.launch.Cluster / run, or under torchrun with "
                           "course_lib.launch.init_from_env()")
    return dist.get_world_size(group), dist.get_rank(group)


def even_shard(n: int, rank: int, world_size: int, what: str = "dimension") -> tuple[int, int]:
    """``(lo, hi)`` of rank ``rank``'s equal slice of ``range(n)`` among ``world_size`` ranks; ``n`` must
    divide evenly.

    Tensor parallelism gives every rank the same shape (Megatron requires it), so a degree that does
    not divide ``n`` is an error that names the sizes that would work (``what`` names the dimension in
    it). The data-parallel split is :func:`course_lib.data_parallel.shard_range`: the same arguments in
    the same order, but a ``slice``, and uneven shards allowed (sizes differ by at most one).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    if n % world_size:
        ok = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"tensor-parallel degree {world_size} does not divide the {what} ({n}); "
                         f"every rank needs an equal slice: use a degree in {ok} or change the {what}")
    k = n // world_size
    return rank * k, (rank + 1) * k


def _all_reduce(x: torch.Tensor, group, builtin: bool, name: str) -> torch.Tensor:
    x = x.contiguous().clone()
    if dist.get_world_size(group) == 1:
        return x
    with trace.span("comm", f"all-reduce: {name}"):
        collectives.all_reduce(x, group=group, builtin=builtin)
    return x


def _all_gather(x: torch.Tensor, dim: int, group, builtin: bool, name: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    t = dist.get_world_size(group)
    if t == 1:
        return x.contiguous().clone()
    x = x.movedim(dim, 0).contiguous()                      # (chunk, ...) with the split dim first
    out = torch.empty((t * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    with trace.span("comm", f"all-gather: {name}"):
        collectives.all_gather_single(out, x, group=group, builtin=builtin)
    return out.movedim(0, dim).contiguous()                 # back to the caller's layout


def _reduce_scatter(x: torch.Tensor, dim: int, group, builtin: bool, name: str) -> torch.Tensor:
    """Sum over ranks, keep this rank's slice along ``dim``."""
    t, r = _size_rank(group)
    if t == 1:
        return x.contiguous().clone()
    even_shard(x.shape[dim], r, t, f"dimension {dim} of the {name} input")
    full = x.movedim(dim, 0).contiguous()                   # (n, ...): rank r's rows are one block
    out = torch.empty((full.shape[0] // t,) + tuple(full.shape[1:]), dtype=x.dtype, device=x.device)
    with trace.span("comm", f"reduce-scatter: {name}"):
        collectives.reduce_scatter_single(out, full, group=group, builtin=builtin)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    t, r = _size_rank(group)
    lo, hi = even_shard(x.shape[dim], r, t, f"dimension {dim}")
    return x.narrow(dim, lo, hi - lo).contiguous()


# --------------------------------------------------------------------------- the conjugate operators

class _CopyToTP(torch.autograd.Function):
    """Megatron's f: forward, the identity; backward, the gradient summed over ``group`` (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group, builtin):
        ctx.group, ctx.builtin = group, builtin
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.builtin, "f backward"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward, the input summed over ``group`` (all-reduce); backward, the identity."""

    @staticmethod
    def forward(ctx, x, group, builtin):
        return _all_reduce(x, group, builtin, "g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, builtin):
        ctx.group = group
        return _all_gather(x, -1, group, builtin, "gather output")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, builtin):
        ctx.dim, ctx.group, ctx.builtin = dim, group, builtin
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.builtin, "scatter backward"), None, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, builtin):
        ctx.dim, ctx.group, ctx.builtin = dim, group, builtin
        return _all_gather(x, dim, group, builtin, "all-gather forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.builtin, "reduce-scatter backward"), \
            None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, builtin):
        ctx.dim, ctx.group, ctx.builtin = dim, group, builtin
        return _reduce_scatter(x, dim, group, builtin, "reduce-scatter forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.builtin, "all-gather backward"), None, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group=None, *, builtin: bool = False) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward.

    Put it where a replicated input enters a column-parallel region: every rank's slice of the
    output depends on all of ``x``, so ``x``'s gradient is the sum of the ranks' contributions.
    """
    _size_rank(group)
    return _CopyToTP.apply(x, group, builtin)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None, *, builtin: bool = False) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward (the conjugate of ``f``).

    Put it where a row-parallel region's partial sums leave: the sum is every rank's output, and the
    gradient of a sum with respect to each term is the gradient itself.
    """
    _size_rank(group)
    return _ReduceFromTP.apply(x, group, builtin)


def gather_from_tensor_parallel(x: torch.Tensor, group=None, *, builtin: bool = False) -> torch.Tensor:
    """All-gather the last dimension forward (``(..., n/t) -> (..., n)``), keep my slice backward."""
    _size_rank(group)
    return _GatherFromTP.apply(x, group, builtin)


def scatter_to_sequence_parallel(x: torch.Tensor, dim: int = 1, group=None, *,
                                 builtin: bool = False) -> torch.Tensor:
    """Keep my chunk of the sequence dimension ``dim`` forward; all-gather the gradient backward."""
    _size_rank(group)
    return _ScatterToSP.apply(x, dim, group, builtin)


def gather_from_sequence_parallel(x: torch.Tensor, dim: int = 1, group=None, *,
                                  builtin: bool = False) -> torch.Tensor:
    """Sequence parallelism's ``f``: all-gather along ``dim`` forward, reduce-scatter backward."""
    _size_rank(group)
    return _GatherFromSP.apply(x, dim, group, builtin)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, dim: int = 1, group=None, *,
                                        builtin: bool = False) -> torch.Tensor:
    """Sequence parallelism's ``g``: reduce-scatter along ``dim`` forward, all-gather backward."""
    _size_rank(group)
    return _ReduceScatterToSP.apply(x, dim, group, builtin)


# --------------------------------------------------------------------------- linear layers

def _uniform(shape, fan_in: int, generator) -> torch.Tensor:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, nn.Linear's default, for one shard only: on the
    generator's device (a generator fills tensors on its own device), else torch's default device, where
    ``nn.Linear`` creates its weights."""
    bound = 1.0 / math.sqrt(fan_in)
    device = generator.device if generator is not None else torch.get_default_device()
    return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)


def _rows_of(n: int, t: int, r: int, fused: int, what: str) -> torch.Tensor:
    """Indices of rank r's rows when ``n`` rows stack ``fused`` equal matrices, each split t ways (on the
    CPU: they index the full layer's weight on any device)."""
    if fused < 1 or n % fused:
        raise ValueError(f"{what}: {n} rows cannot hold fused={fused} equal matrices")
    part = n // fused
    lo, hi = even_shard(part, r, t, what if fused == 1 else f"{what} of each of the {fused} fused matrices")
    return torch.cat([torch.arange(j * part + lo, j * part + hi, device="cpu") for j in range(fused)])


class ColumnParallelLinear(nn.Module):
    """``Y_r = X W_r^T + b_r``: rank r holds ``out_features / t`` rows of ``W`` (output features).

    Args:
        in_features, out_features: the full (unsharded) layer's sizes; ``t`` must divide
            ``out_features`` (per fused matrix).
        bias: as ``nn.Linear``.
        group: the tensor-parallel process group (``None``: the default group).
        gather_output: all-gather the output features (``(..., out)`` on every rank) instead of
            returning this rank's slice ``(..., out/t)`` (the default, for a row-parallel layer next).
        sequence_parallel: the input is this rank's chunk of the sequence (dim 1) and is all-gathered
            first (backward: reduce-scatter), instead of being replicated (``f``).
        fused: the weight stacks this many equal matrices (3 for a fused Q, K, V projection); each is
            split separately so that a rank gets whole heads of Q, K and V.
        builtin: ``dist`` collectives instead of the course's ring (see the module docstring).
        generator: draws this rank's shard (and only it: the full matrix is never built) from
            nn.Linear's distribution ``U(-1/sqrt(in), 1/sqrt(in))``; seed it differently on each
            rank (Megatron's "model-parallel RNG"), or ranks get identical shards.

    Use :meth:`from_linear` to shard an existing ``nn.Linear`` (exactly its values).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 gather_output: bool = False, sequence_parallel: bool = False, fused: int = 1,
                 builtin: bool = False, generator: torch.Generator | None = None,
                 _full: nn.Linear | None = None):
        super().__init__()
        t, r = _size_rank(group)
        self.group, self.tp, self.tp_rank = group, t, r
        self.in_features, self.out_features, self.fused = in_features, out_features, fused
        self.gather_output, self.sequence_parallel, self.builtin = gather_output, sequence_parallel, builtin
        rows = _rows_of(out_features, t, r, fused, "out_features")
        if _full is None:   # draw only this rank's shard, with nn.Linear's distribution
            self.weight = nn.Parameter(_uniform((len(rows), in_features), in_features, generator))
            self.bias = nn.Parameter(_uniform((len(rows),), in_features, generator)) if bias else None
        else:
            self.weight = nn.Parameter(_full.weight.detach()[rows].clone())      # (out/t, in)
            self.bias = nn.Parameter(_full.bias.detach()[rows].clone()) if _full.bias is not None else None
        self.shard_rows = _runs(rows)   # [(lo, hi), ...]: the full weight's rows this rank holds

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "ColumnParallelLinear":
        """Shard ``linear`` (every rank passes the same layer): this rank keeps its rows of W and b."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                   _full=linear, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear expects inputs with {self.in_features} features "
                             f"in the last dimension, got shape {tuple(x.shape)}")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, 1, self.group, builtin=self.builtin)  # (B, T, in)
        else:
            x = copy_to_tensor_parallel(x, self.group, builtin=self.builtin)
        y = F.linear(x, self.weight, self.bias)                                   # (..., out/t)
        return gather_from_tensor_parallel(y, self.group, builtin=self.builtin) if self.gather_output else y

    def shard_layout(self) -> dict:
        """Which block of the full weight this rank holds, and which features of the input and output
        activations it reads and writes: a plain dict, for ``cluster.run`` to return from every rank and
        :func:`course_lib.viz.plot_tp_split` to draw::

            {"layer": "column", "rank": r, "tp": t, "full_shape": (out, in),
             "rows": [(lo, hi), ...], "cols": [(0, in)], "bias": "split",
             "input": {"features": [(0, in)], "of": in, "state": "replicated", "before": None},
             "output": {"features": [(lo, hi), ...], "of": out, "state": "split", "after": None}}

        ``full_shape``, ``rows`` and ``cols`` refer to the full ``(out_features, in_features)`` weight as
        ``nn.Linear`` stores it (a fused layer holds one row range per fused matrix). An activation's
        ``state`` is ``"replicated"`` (the same on every rank), ``"split"`` (this rank's features),
        ``"sequence"`` (this rank's chunk of the sequence) or ``"partial"`` (a partial sum); ``before``
        and ``after`` name the forward collective that runs before the matmul or after it.
        """
        return {"layer": "column", "rank": self.tp_rank, "tp": self.tp,
                "full_shape": (self.out_features, self.in_features),
                "rows": list(self.shard_rows), "cols": [(0, self.in_features)],
                "bias": "split" if self.bias is not None else None,
                "input": {"features": [(0, self.in_features)], "of": self.in_features,
                          "state": "sequence" if self.sequence_parallel else "replicated",
                          "before": "all-gather" if self.sequence_parallel else None},
                "output": {"features": list(self.shard_rows), "of": self.out_features, "state": "split",
                           "after": "all-gather" if self.gather_output else None}}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), tp={self.tp}, fused={self.fused}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T + b``: rank r holds ``in_features / t`` columns of ``W``.

    Args:
        in_features, out_features: the full layer's sizes; ``t`` must divide ``in_features``.
        bias: as ``nn.Linear``; the bias is replicated and added once, after the reduction.
        group: the tensor-parallel process group.
        input_is_parallel: the input is already this rank's slice ``(..., in/t)`` (the output of a
            column-parallel layer; default). ``False``: the input is full and is split here.
        sequence_parallel: reduce-scatter the output along the sequence (dim 1) instead of
            all-reducing it: each rank gets the sum for its chunk of tokens.
        builtin, generator: as :class:`ColumnParallelLinear` (fan-in: the full ``in_features``);
            the bias, the same on every rank, starts at zero (as Megatron initialises biases).

    The bias is a replicated parameter; every rank receives the same full gradient for it, except
    under sequence parallelism, where it is added to this rank's tokens only: sum its gradient with
    :func:`all_reduce_sequence_parallel_grads`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, builtin: bool = False,
                 generator: torch.Generator | None = None, _full: nn.Linear | None = None):
        super().__init__()
        t, r = _size_rank(group)
        self.group, self.tp, self.tp_rank = group, t, r
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.builtin = input_is_parallel, sequence_parallel, builtin
        lo, hi = even_shard(in_features, r, t, "in_features")
        if _full is None:   # my columns, nn.Linear's distribution; the replicated bias starts at 0
            self.weight = nn.Parameter(_uniform((out_features, hi - lo), in_features, generator))
            self.bias = nn.Parameter(torch.zeros(out_features, device=self.weight.device)) if bias else None
        else:
            self.weight = nn.Parameter(_full.weight.detach()[:, lo:hi].clone())  # (out, in/t)
            self.bias = nn.Parameter(_full.bias.detach().clone()) if _full.bias is not None else None
        if self.bias is not None and sequence_parallel:
            self.bias._sequence_parallel = True  # added to my tokens only: its gradient is partial
        self.shard_cols = (lo, hi)      # the full weight's columns this rank holds

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "RowParallelLinear":
        """Shard ``linear`` (every rank passes the same layer): this rank keeps its columns of W."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                   _full=linear, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterToSP.apply(x, -1, self.group, self.builtin) if x.dim() else x  # (..., in/t)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear on rank {self.tp_rank} expects this rank's slice of "
                             f"{self.weight.shape[1]} input features (in_features={self.in_features} / "
                             f"tp={self.tp}), got shape {tuple(x.shape)}")
        partial = F.linear(x, self.weight)                                       # (..., out), a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(partial, 1, self.group, builtin=self.builtin)
        else:
            y = reduce_from_tensor_parallel(partial, self.group, builtin=self.builtin)
        return y + self.bias if self.bias is not None else y

    def shard_layout(self) -> dict:
        """As :meth:`ColumnParallelLinear.shard_layout`: this rank's columns of the full weight; its input
        is its slice of the features (``input_is_parallel``) or all of them, its output a partial sum of
        all ``out_features`` that an all-reduce (``g``; a reduce-scatter with sequence parallelism) completes."""
        lo, hi = self.shard_cols
        return {"layer": "row", "rank": self.tp_rank, "tp": self.tp,
                "full_shape": (self.out_features, self.in_features),
                "rows": [(0, self.out_features)], "cols": [(lo, hi)],
                "bias": "replicated" if self.bias is not None else None,
                "input": {"features": [(lo, hi)] if self.input_is_parallel else [(0, self.in_features)],
                          "of": self.in_features, "state": "split" if self.input_is_parallel else "replicated",
                          "before": None},
                "output": {"features": [(0, self.out_features)], "of": self.out_features, "state": "partial",
                           "after": "reduce-scatter" if self.sequence_parallel else "all-reduce"}}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.tp}, sequence_parallel={self.sequence_parallel}")


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """The increasing indices ``index`` as contiguous ranges ``[(lo, hi), ...]``."""
    runs: list[list[int]] = []
    for i in index.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(lo, hi) for lo, hi in runs]


# --------------------------------------------------------------------------- MLP, attention, block

class ParallelMLP(nn.Module):
    """Megatron's MLP: ``fc`` column parallel, GELU on each slice, ``fc_proj`` row parallel.

    ``(B, T, h) -> (B, T, h)``; one all-reduce forward (in ``fc_proj``) and one backward (in ``fc``'s
    ``f``). With ``sequence_parallel`` the input and output are ``(B, T/t, h)`` chunks.
    Build it from the unsharded layers with :meth:`from_linears` (e.g. a ``models.Block``'s
    ``fc`` and ``fc_proj``).
    """

    def __init__(self, fc: ColumnParallelLinear, fc_proj: RowParallelLinear):
        super().__init__()
        self.fc, self.fc_proj = fc, fc_proj

    @classmethod
    def from_linears(cls, fc: nn.Linear, fc_proj: nn.Linear, group=None, *,
                     sequence_parallel: bool = False, builtin: bool = False) -> "ParallelMLP":
        kw = dict(sequence_parallel=sequence_parallel, builtin=builtin)
        return cls(ColumnParallelLinear.from_linear(fc, group, **kw),
                   RowParallelLinear.from_linear(fc_proj, group, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_proj(F.gelu(self.fc(x)))   # (B, T, 4h/t) inside, (B, T, h) out


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split across ranks (Shoeybi et al. §3, Fig. 3b).

    ``qkv`` is column parallel with ``fused=3`` (rank r gets heads ``r·a/t … (r+1)·a/t - 1`` of Q, K
    and V), each rank runs attention on its own heads with no communication, and ``proj`` is row
    parallel. ``t`` must divide the number of heads.
    """

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head: int):
        super().__init__()
        even_shard(n_head, qkv.tp_rank, qkv.tp, "number of attention heads")
        self.qkv, self.proj, self.n_head, self.local_heads = qkv, proj, n_head, n_head // qkv.tp

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None, *, sequence_parallel: bool = False,
                       builtin: bool = False) -> "ParallelSelfAttention":
        """Shard a :class:`course_lib.models.CausalSelfAttention` (fused ``qkv``, then ``proj``)."""
        t, r = _size_rank(group)
        even_shard(attn.n_head, r, t, "number of attention heads")
        kw = dict(sequence_parallel=sequence_parallel, builtin=builtin)
        return cls(ColumnParallelLinear.from_linear(attn.qkv, group, fused=3, **kw),
                   RowParallelLinear.from_linear(attn.proj, group, **kw), attn.n_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                   # (B, T, 3 C/t): [q | k | v] of my heads
        B, T, _ = qkv.shape
        c = qkv.shape[-1] // 3                              # C/t channels = local_heads * head_dim
        hd = c // self.local_heads
        # (B, T, C/t) -> (B, local_heads, T, head_dim)
        q, k, v = (u.view(B, T, self.local_heads, hd).transpose(1, 2) for u in qkv.split(c, dim=2))
        y = causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, c)   # (B, T, C/t)
        return self.proj(y)                                 # (B, T, C) after g (or (B, T/t, C) with SP)


class ParallelBlock(nn.Module):
    """A tensor-parallel pre-norm transformer block (``models.Block``'s maths).

    ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``: 2 all-reduces forward and 2 backward. With
    ``sequence_parallel`` the block's input and output are the rank's sequence chunk ``(B, T/t, C)``;
    the layer norms run on it and their (replicated) parameters get partial gradients: call
    :func:`all_reduce_sequence_parallel_grads` after the backward.
    """

    def __init__(self, ln1: nn.LayerNorm, attn: ParallelSelfAttention, ln2: nn.LayerNorm,
                 mlp: ParallelMLP, sequence_parallel: bool = False):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.sequence_parallel = sequence_parallel
        for ln in (ln1, ln2):
            for p in ln.parameters():
                p._sequence_parallel = sequence_parallel  # marks the grads that need a sum over ranks

    @classmethod
    def from_block(cls, block: nn.Module, group=None, *, sequence_parallel: bool = False,
                   builtin: bool = False) -> "ParallelBlock":
        """Shard a :class:`course_lib.models.Block` (its layer norms are copied, replicated)."""
        import copy
        kw = dict(sequence_parallel=sequence_parallel, builtin=builtin)
        return cls(copy.deepcopy(block.ln1), ParallelSelfAttention.from_attention(block.attn, group, **kw),
                   copy.deepcopy(block.ln2), ParallelMLP.from_linears(block.fc, block.fc_proj, group, **kw),
                   sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def all_reduce_sequence_parallel_grads(module: nn.Module, group=None, *, builtin: bool = False) -> int:
    """Sum the gradients of replicated parameters that saw only this rank's tokens (sequence
    parallel layer norms); returns how many were reduced. Without it the ranks' copies drift apart."""
    n = 0
    for p in module.parameters():
        if getattr(p, "_sequence_parallel", False) and p.grad is not None:
            p.grad.copy_(_all_reduce(p.grad, group, builtin, "sequence-parallel grads"))
            n += 1
    return n


# --------------------------------------------------------------------------- vocabulary parallel

class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (token ids): rank r holds ids ``[r·V/t, (r+1)·V/t)``.

    Built from scratch it allocates only those ``V/t`` rows (the full table never exists on a rank), on
    ``device`` (``None``: torch's default device, as ``nn.Embedding``);
    :meth:`from_embedding` splits an existing ``nn.Embedding`` (equal to it, for checking).

    Each rank looks up the ids it owns, writes zeros for the others, and ``g`` (all-reduce) sums
    the ranks' partial results: ``(B, T)`` ids -> ``(B, T, h)`` on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *, builtin: bool = False,
                 device=None, _full: nn.Embedding | None = None):
        super().__init__()
        t, r = _size_rank(group)
        self.group, self.builtin, self.num_embeddings = group, builtin, num_embeddings
        self.lo, self.hi = even_shard(num_embeddings, r, t, "vocabulary size")
        if _full is None:   # only this rank's rows, initialised as nn.Embedding initialises (N(0, 1))
            self.weight = nn.Parameter(torch.randn(self.hi - self.lo, embedding_dim, device=device))  # (V/t, h)
        else:
            self.weight = nn.Parameter(_full.weight.detach()[self.lo:self.hi].clone())   # (V/t, h)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, **kw) -> "VocabParallelEmbedding":
        return cls(emb.num_embeddings, emb.embedding_dim, group, _full=emb, **kw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1)               # (B, T, h), zeros elsewhere
        return reduce_from_tensor_parallel(out, self.group, builtin=self.builtin)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, group, builtin, ignore_index):
        # logits: (N, V/t) this rank's vocabulary slice, in any float dtype; target: (N,) global ids
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16/fp16 -> fp32, as Megatron
        m = logits.max(dim=-1).values
        if dist.get_world_size(group) > 1:
            with trace.span("comm", "all-reduce: cross-entropy max"):
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)   # max has no ring here: builtin
        z = logits - m.unsqueeze(-1)
        e = z.exp()
        s = _all_reduce(e.sum(-1), group, builtin, "cross-entropy sum-exp")         # (N,)
        n_local = logits.shape[-1]
        mine = (target >= lo) & (target < lo + n_local)
        idx = torch.where(mine, target - lo, torch.zeros_like(target))
        picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        picked = _all_reduce(picked, group, builtin, "cross-entropy target logit")  # (N,)
        valid = (target != ignore_index).float()                                    # (N,) 0 for ignored
        count = valid.sum()
        ctx.save_for_backward(e / s.unsqueeze(-1), idx, mine, valid, count)
        return ((s.log() - picked) * valid).sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g *= (valid * (grad / count)).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *,
                                 builtin: bool = False, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy when each rank holds only its vocabulary slice of the logits.

    ``logits``: ``(..., V/t)``, rank r's columns ``[r·V/t, (r+1)·V/t)``, in any float dtype (the softmax
    is computed in at least fp32, as Megatron-LM does for bf16/fp16 logits; the loss is fp32 or fp64 and
    the gradient has the logits' dtype); ``target``: ``(...)`` global token ids, where ``ignore_index`` (padding, a
    prompt's tokens) counts for nothing, as in ``F.cross_entropy``: the mean is over the other tokens.
    Three all-reduces of one value per token (max, sum of exponentials, target logit) replace gathering
    ``(..., V)`` logits (Shoeybi et al. §3: "fuse the output with the cross entropy"); the gradient is
    ``softmax - onehot`` on each rank's slice, with no communication.
    """
    t, r = _size_rank(group)
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: target needs "
                         f"the logits' shape without the vocabulary dimension")
    lo = r * logits.shape[-1]
    return _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), lo, group, builtin,
                                  ignore_index)


# --------------------------------------------------------------------------- cost model

def tp_bytes_per_layer(batch: int, seq: int, hidden: int, tp: int, bytes_per_value: int = 2) -> dict:
    """Tensor-parallel traffic of one transformer layer, one micro-batch, per rank (ring collectives).

    4 all-reduces (2 forward: after attention and after the MLP; 2 backward: their conjugates ``f``)
    of ``b s h`` values; a ring all-reduce sends ``2 (t-1)/t`` of its bytes per rank. Sequence
    parallelism replaces each all-reduce by an all-gather and a reduce-scatter, ``(t-1)/t`` each:
    the same bytes.
    """
    for k, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("tp", tp), ("bytes_per_value", bytes_per_value)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    n = batch * seq * hidden * bytes_per_value
    per = 2 * (tp - 1) / tp * n
    return {"all_reduces": 4, "bytes_per_all_reduce": n, "sent_per_all_reduce": per, "sent": 4 * per}


def tp_comm_seconds(batch: int, seq: int, hidden: int, tp: int, bandwidth: float, latency: float = 0.0,
                    bytes_per_value: int = 2) -> float:
    """Alpha-beta time of one layer's 4 ring all-reduces: ``4 (2 (t-1) alpha + 2 (t-1)/t · n / bandwidth)``.

    ``bandwidth`` in bytes/s per direction of each rank's link, ``latency`` (alpha) in seconds.
    """
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"bandwidth must be > 0 and latency >= 0, got {bandwidth}, {latency}")
    b = tp_bytes_per_layer(batch, seq, hidden, tp, bytes_per_value)
    return 4 * (2 * (tp - 1) * latency) + b["sent"] / bandwidth
