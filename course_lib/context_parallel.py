"""Long context from scratch: memory-efficient attention, ring attention and DeepSpeed-Ulysses.

Attention of ``s`` queries over ``s`` keys computes an ``s x s`` score matrix per head. Written the
plain way (:func:`naive_attention`), autograd keeps that matrix's softmax for the backward: ``b a s^2``
values, which at ``s = 128k`` (2^17) is 64 GiB in fp32 per head and layer of one sequence. Three ideas
remove the ``s^2`` and then split ``s`` over ``N`` ranks. Shapes are ``F.scaled_dot_product_attention``'s:
``q, k, v`` are ``(b, a, s, d)`` (batch, heads, sequence, head dim; GLOSSARY.md).

**1. Blockwise (memory-efficient) attention.** Softmax over a row can be computed one block of keys
at a time, keeping per query row a running max ``m`` and a running sum ``l`` of ``exp(score - m)``
(the *online softmax*: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Rabe &
Staats 2021, "Self-attention does not need O(n^2) memory"; Dao et al. 2022, "FlashAttention", Alg. 1).
A block's partial result is ``(out, lse)``: its output normalised over its own keys and the
log-sum-exp ``lse = m + log l`` of its scores (:func:`attend_block`). Two partial results over
disjoint key sets combine exactly (:func:`merge`)::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

:func:`blockwise_attention` tiles queries and keys into ``block_size`` blocks, merges the key blocks
of each query block, and keeps for the backward only ``q, k, v``, the output and ``lse`` (``b a s``
values: O(s), not O(s^2)). Its backward recomputes each tile's probabilities from ``lse``
(FlashAttention's backward, Dao et al. 2022, Alg. 4; Dao 2023, "FlashAttention-2", Alg. 2)::

    P = exp(q k^T * scale - lse)        dV += P^T dO          dP = dO V^T
    dS = P * (dP - rowsum(dO * O))      dQ += dS K * scale    dK += dS^T Q * scale

:func:`attention_saved_bytes` measures what autograd keeps (``course_lib.estimate``'s saved-tensor
hooks): ``b a s^2`` values for :func:`naive_attention`, ``b a s (d + 1)`` for the blockwise one.

**2. Ring attention** (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"). Each of the ``N`` ranks of ``group`` holds ``n = s/N`` tokens of ``q, k, v``.
The key/value blocks travel around the ring: in step ``i`` rank ``r`` holds the K/V of rank
``(r - i) mod N``, computes its queries against them (:func:`attend_block`), merges the partial
result (:func:`merge`), and meanwhile already sends that block to rank ``r + 1`` and receives the
next one from rank ``r - 1`` (the transfer is posted before the compute and waited for after it: it
overlaps). After ``N`` steps every query has seen every key. The backward (:func:`ring_attention`'s
autograd Function) runs the ring again: the K/V blocks travel ahead, and each block's gradient
``(dK, dV)`` follows one exchange behind, collecting every rank's contribution on the way home::

    rank 0        rank 1        rank 2        rank 3          step i: rank r holds K/V of r - i
    K0V0   --->   K0V0   --->   K0V0   --->   K0V0            forward: merge (out, lse)
    (own)         dK0 dV0 -->   += --------->  += ---> rank 0  backward: dK/dV ride behind

Bytes one rank sends (:func:`ring_attention_bytes`; one K/V block is ``2 b a n d`` values)::

    forward   (N - 1) * 2 b a (s/N) d           the K/V blocks
    backward  (N - 1) * 2 b a (s/N) d * 2       the K/V blocks again, and their dK/dV

*Causal masking and load balance.* With the contiguous layout (rank ``r`` holds tokens
``[r n, (r+1) n)``) rank 0's queries see only its own block while rank ``N-1``'s see all of them:
skipping the future's blocks, rank ``r`` computes ``(r + 1) n^2`` (query, key) pairs and the step
waits for the slowest, ``N n^2``. The *zig-zag* layout cuts the sequence into ``2N`` chunks and gives
rank ``r`` chunks ``r`` and ``2N-1-r`` (one early, one late): every rank then computes
``(2N + 1) (n/2)^2`` pairs (:func:`ring_work` gives both, :func:`ring_tiles` which tiles, step by
step; the ring reports what it computed in ``trace`` spans). This is the layout of Megatron-LM's context parallelism (Megatron-Core's
``get_batch_on_this_cp_rank``) and of ``torch.distributed.tensor.experimental.context_parallel``'s
head-tail load balancer; Brandon et al. 2023 ("Striped Attention") balance with a striped layout
(token ``t`` on rank ``t mod N``) instead, which is not implemented here. :func:`sequence_positions`,
:func:`shard_sequence`, :func:`unshard_sequence` and :func:`gather_sequence` map between the full
sequence and the ranks' shares.

**3. DeepSpeed-Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models"). An all-to-all turns the sequence-sharded
``(b, a, s/N, d)`` into head-sharded ``(b, a/N, s, d)``: every rank now has the whole sequence for
``a/N`` heads and runs ordinary attention (any kernel); a second all-to-all turns the output back.
The backward of an all-to-all is the reverse all-to-all. ``N`` must divide ``a``. One rank sends
(:func:`ulysses_bytes`) ``(N-1)/N`` of its share of each of the 4 tensors moved (q, k, v in; out
back), and as much again in the backward::

    forward   4 (N - 1)/N * b a (s/N) d          backward: the same

so Ulysses' bytes per rank fall as ``1/N`` while the ring's, ``2 (N-1)/N * b a s d``, approach
``2 b a s d``: the ring sends ``N/2`` times Ulysses' bytes (as much for ``N = 2``, twice for
``N = 4``). The ring, in exchange, scales ``N`` past ``a``, needs no all-to-all (only neighbours
talk) and hides its transfers behind the compute; Ulysses needs ``N`` to divide ``a``.

**The production API.** ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13; tried
on the course's gloo cluster with CPU tensors) patches ``F.scaled_dot_product_attention`` to run on
DTensors sharded along the sequence, and has ring rules only for the CUDA kernels' ops
(``aten._scaled_dot_product_flash_attention``, ``..._efficient_attention``, ``..._cudnn_attention``).
On the CPU, SDPA's default kernel is ``aten._scaled_dot_product_flash_attention_for_cpu``:

* non-causal forward: runs and equals one-process attention, but DTensor first propagates shardings
  through the op's decomposition (45-105 s on 2 CPU cores, once per process), then all-gathers K and
  V (on 2 ranks: two ``all_gather_into_tensor``): no ring;
* causal forward: ``NotImplementedError: Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered.``;
* backward: ``NotImplementedError: Operator
  aten._scaled_dot_product_flash_attention_for_cpu_backward.default does not have a sharding strategy
  registered.``

With SDPA held to its math backend (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``) the
non-causal forward and backward run in a fraction of a second: SDPA decomposes into matmuls and a
softmax on DTensors, and DTensor's sharding propagation picks each op's placement by its cost model,
so no ring either (at ``(b, a, s, d) = (2, 4, 32, 8)`` on 2 ranks: K and V all-gathered, their
gradients reduce-scattered). The inputs are sharded in the zig-zag layout above (its head-tail load
balancer), but the output is returned as DTensor left it, which depends on the shapes (4 ranks): at
``(2, 4, 32, 8)`` each rank gets its sequence share, equal to :func:`ring_attention`'s zig-zag output
(the tests compare outputs and gradients there); at ``(1, 8, 1024, 64)`` all of the (zig-zag
ordered) sequence for ``a/N`` heads, ``(1, 2, 1024, 64)``; at ``(1, 8, 64, 64)`` a partial sum of
the whole output (summed over the ranks it is right). Causal fails there: ``RuntimeError:
aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before
calling distributed operators!`` (the math path adds a plain-tensor mask). Every case here is also
compared with one process's attention.

Conventions (as in :mod:`course_lib.collectives`): every rank of ``group`` calls with tensors of the
same shape; ``group=None`` is the default group, ranks inside it are group ranks; point-to-point
goes through ``collectives``' exchange (``batch_isend_irecv`` under NCCL or with
``transport=collectives.PairedP2P()``); every buffer lives on the device of the tensors it serves;
transfers are recorded in an active :class:`course_lib.trace.Recorder`. Scores, softmax and
accumulators are computed in float32 (float64 for float64 inputs); results have the inputs' dtype.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import collectives, estimate, trace

__all__ = [
    "naive_attention",
    "attend_block",
    "attend_block_backward",
    "merge",
    "blockwise_attention",
    "attention_saved_bytes",
    "LAYOUTS",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "ring_attention",
    "ring_work",
    "ring_tiles",
    "ring_attention_bytes",
    "ulysses_attention",
    "ulysses_bytes",
]

LAYOUTS = ("contiguous", "zigzag")
DEFAULT_BLOCK_SIZE = 128  # FlashAttention's tiles are 64-128 rows: what fits a GPU's shared memory


# --------------------------------------------------------------------------- checks

def _check_qkv(q, k, v, what: str, same_length: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}; q, k, v are (b, a, s, d) "
                             "(batch, heads, sequence, head dim), as F.scaled_dot_product_attention "
                             "takes them: use x.view(b, s, a, d).transpose(1, 2) on a (b, s, h) tensor")
        if not t.is_floating_point():
            raise TypeError(f"{what}: {name} has dtype {t.dtype}; attention needs floating-point tensors")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; every key "
                         "needs its value: give k and v the same shape")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q has shape {tuple(q.shape)} and k {tuple(k.shape)}; they must agree "
                         "in batch, heads and head dim (b, a, ., d)")
    if same_length and q.shape != k.shape:
        raise ValueError(f"{what}: q has shape {tuple(q.shape)} but k and v {tuple(k.shape)}; each rank "
                         "holds the same tokens' q, k and v (self-attention): give them one shape")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise TypeError(f"{what}: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; use one dtype")
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError(f"{what}: q, k, v are on {q.device}, {k.device}, {v.device}; put them on one "
                         "device")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores and accumulators live: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# --------------------------------------------------------------------------- one process

def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` written out: the ``(b, a, s_q, s_k)`` probabilities are a tensor
    that autograd keeps for the backward (``b a s_q s_k`` values). ``causal``: query ``i`` sees keys
    ``j <= i`` (top-left aligned, as SDPA's ``is_causal``). Returns ``(b, a, s_q, d)``."""
    _check_qkv(q, k, v, "naive_attention")
    scores = q @ k.transpose(-2, -1) * _scale(q, scale)
    if causal:
        s_q, s_k = scores.shape[-2:]
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _future(s_q: int, s_k: int, q_offset: int, k_offset: int, device) -> torch.Tensor | None:
    """The ``(s_q, s_k)`` mask of keys after their query (positions ``offset + index``), or ``None``
    when no key of the block is after any of its queries."""
    if k_offset + s_k - 1 <= q_offset:
        return None
    qp = torch.arange(q_offset, q_offset + s_q, device=device)
    kp = torch.arange(k_offset, k_offset + s_k, device=device)
    return kp[None, :] > qp[:, None]


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                 q_offset: int = 0, k_offset: int = 0,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend queries ``q`` ``(b, a, s_q, d)`` to one block of keys/values ``(b, a, s_k, d)``.

    Returns ``(out, lse)``: ``out`` ``(b, a, s_q, d)``, the output normalised over this block's keys
    only, and ``lse`` ``(b, a, s_q)``, the log-sum-exp of each row's scores, ``m + log l`` with ``m``
    the row max and ``l = sum exp(score - m)``; both in float32 (float64 for float64 inputs).
    :func:`merge` combines such results over disjoint blocks into attention over their union.

    ``causal``: the queries sit at positions ``q_offset, q_offset+1, ...`` of the sequence and the
    keys at ``k_offset, ...``; a key after its query is masked. A row with no key left has
    ``out = 0`` and ``lse = -inf`` (it contributes nothing to a merge).
    """
    _check_qkv(q, k, v, "attend_block")
    acc = _acc_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * _scale(q, scale)
    mask = _future(q.shape[-2], k.shape[-2], q_offset, k_offset, q.device) if causal else None
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # an all-masked row: exp(-inf - 0) = 0
    p = torch.exp(scores - m)
    l = p.sum(dim=-1, keepdim=True)
    out = (p @ v.to(acc)) / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log(l)).squeeze(-1)                        # log 0 = -inf for an all-masked row
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial results over disjoint key sets (from
    :func:`attend_block`): ``out`` ``(..., s_q, d)``, ``lse`` ``(..., s_q)``. Returns ``(out, lse)``
    of attention over both key sets. A row with ``lse = -inf`` on one side takes the other side's
    result; on both sides it stays ``(0, -inf)``. Symmetric in ``a`` and ``b``."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge: out {tuple(out_a.shape)}/{tuple(out_b.shape)} and lse "
                         f"{tuple(lse_a.shape)}/{tuple(lse_b.shape)}; both sides need out (..., s_q, d) "
                         "and lse (..., s_q) of the same queries")
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    return w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b, lse


def attend_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                          lse: torch.Tensor, delta: torch.Tensor, *, causal: bool = False,
                          q_offset: int = 0, k_offset: int = 0,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile of FlashAttention's backward: this key block's share of the gradients.

    ``lse`` ``(b, a, s_q)`` is the log-sum-exp over **all** keys of the final output and ``delta``
    ``(b, a, s_q)`` is ``rowsum(dO * O)`` of the final output ``O``; ``dout`` is ``dO`` ``(b, a, s_q, d)``
    for these queries. Recomputes ``P = exp(q k^T * scale - lse)`` (the true probabilities of this
    tile) and returns ``(dq, dk, dv)``: the tile's contribution to ``dQ`` (sum it over key blocks)
    and to ``dK``, ``dV`` (sum over query blocks), in float32 (float64 for float64 inputs).
    """
    acc = _acc_dtype(q.dtype)
    sc = _scale(q, scale)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    scores = (q @ k.transpose(-2, -1)) * sc
    mask = _future(q.shape[-2], k.shape[-2], q_offset, k_offset, q.device) if causal else None
    lse = lse.to(acc).unsqueeze(-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    p = torch.where(torch.isfinite(lse), p, torch.zeros_like(p))
    if mask is not None:
        p = p.masked_fill(mask, 0.0)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - delta.to(acc).unsqueeze(-1))
    return (ds @ k) * sc, (ds.transpose(-2, -1) @ q) * sc, dv


def _ranges(n: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, n)) for lo in range(0, n, block)]


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_size, scale):
        b, a, s_q, d = q.shape
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(b, a, s_q, d, dtype=acc, device=q.device)
        lse = torch.full((b, a, s_q), float("-inf"), dtype=acc, device=q.device)
        for q_lo, q_hi in _ranges(s_q, block_size):
            o_i, l_i = out[..., q_lo:q_hi, :], lse[..., q_lo:q_hi]
            for k_lo, k_hi in _ranges(k.shape[-2], block_size):
                if causal and k_lo > q_hi - 1:            # every key of the block is in the future
                    break
                o, l = attend_block(q[..., q_lo:q_hi, :], k[..., k_lo:k_hi, :], v[..., k_lo:k_hi, :],
                                    causal=causal, q_offset=q_lo, k_offset=k_lo, scale=scale)
                o_i, l_i = merge(o_i, l_i, o, l)
            out[..., q_lo:q_hi, :], lse[..., q_lo:q_hi] = o_i, l_i
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)          # O(s): no (s_q, s_k) tensor
        ctx.causal, ctx.block_size, ctx.scale = causal, block_size, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for k_lo, k_hi in _ranges(k.shape[-2], ctx.block_size):      # FlashAttention-2: keys outside
            for q_lo, q_hi in _ranges(q.shape[-2], ctx.block_size):
                if ctx.causal and k_lo > q_hi - 1:
                    continue
                g = attend_block_backward(q[..., q_lo:q_hi, :], k[..., k_lo:k_hi, :], v[..., k_lo:k_hi, :],
                                          dout[..., q_lo:q_hi, :], lse[..., q_lo:q_hi],
                                          delta[..., q_lo:q_hi], causal=ctx.causal, q_offset=q_lo,
                                          k_offset=k_lo, scale=ctx.scale)
                dq[..., q_lo:q_hi, :] += g[0]
                dk[..., k_lo:k_hi, :] += g[1]
                dv[..., k_lo:k_hi, :] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        block_size: int = DEFAULT_BLOCK_SIZE, scale: float | None = None) -> torch.Tensor:
    """Memory-efficient attention: equal to ``F.scaled_dot_product_attention(q, k, v,
    is_causal=causal, scale=scale)`` (outputs and gradients, to rounding), in blocks.

    ``q`` ``(b, a, s_q, d)``, ``k``, ``v`` ``(b, a, s_k, d)``; returns ``(b, a, s_q, d)``. Queries and
    keys are cut into tiles of ``block_size`` (the last may be shorter); each query tile merges its key
    tiles with the online softmax (tiles wholly in the future are skipped when ``causal``). Autograd
    keeps ``q, k, v``, the output and the ``(b, a, s_q)`` log-sum-exp; the backward recomputes each
    tile's probabilities (module docstring). Transient memory: one ``block_size^2`` tile per head.
    """
    _check_qkv(q, k, v, "blockwise_attention")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return _Blockwise.apply(q, k, v, bool(causal), block_size, scale)


def attention_saved_bytes(attn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          **kwargs) -> int:
    """Bytes autograd saves for the backward while ``attn(q, k, v, **kwargs)`` runs, without ``q, k, v``
    themselves (they exist anyway): each saved storage counted once
    (:func:`course_lib.estimate.saved_activation_bytes`). Pass tensors that require grad.

    :func:`naive_attention`: the ``(b, a, s_q, s_k)`` probabilities (plus the bool mask when causal);
    :func:`blockwise_attention`: the output and the log-sum-exp, ``b a s_q (d + 1)`` values.
    """
    _, total, _ = estimate.saved_activation_bytes(attn, q, k, v, exclude=(q, k, v), **kwargs)
    return total


# --------------------------------------------------------------------------- layouts

def _share(s: int, world_size: int, layout: str, what: str = "sequence") -> int:
    """``n = s / N``, checked: ``N`` must divide ``s``, and ``2N`` for the zig-zag layout."""
    _check_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if s % parts:
        why = ("the zig-zag layout cuts it into 2N = " if layout == "zigzag" else "it is cut into N = ")
        raise ValueError(f"the {what} length s={s} does not split over N={world_size} ranks: {why}{parts} "
                         f"equal chunks; pad the sequence to a multiple of {parts} "
                         f"(e.g. s={-(-s // parts) * parts}) or use another N")
    return s // world_size


def _chunks(rank: int, world_size: int, n: int, layout: str) -> list[tuple[int, int, int]]:
    """This rank's chunks as ``(lo, hi, start)``: rows ``[lo, hi)`` of its share hold the sequence's
    positions ``start, start + 1, ...``."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2                                             # zig-zag: chunks r and 2N-1-r of 2N
    return [(0, c, rank * c), (c, n, (2 * world_size - 1 - rank) * c)]


def sequence_positions(s: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """The positions (a 1-D int64 tensor of ``s/N``) of the sequence that rank ``rank`` of ``N =
    world_size`` holds, in the order it holds them.

    ``"contiguous"``: ``[r s/N, (r+1) s/N)``. ``"zigzag"``: chunks ``r`` and ``2N-1-r`` of the ``2N``
    chunks of length ``s/(2N)``; e.g. ``s=8, N=2``: rank 0 holds ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.
    """
    n = _share(s, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    return torch.cat([torch.arange(start, start + hi - lo) for lo, hi, start in _chunks(rank, world_size, n, layout)])


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous",
                   dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s share of the full-sequence tensor ``x`` (a contiguous copy): the positions of
    :func:`sequence_positions` along ``dim`` (2 for ``(b, a, s, d)``). No communication."""
    pos = sequence_positions(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, pos).contiguous()


def unshard_sequence(shares, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's share (``shares[r]`` rank ``r``'s, along ``dim``): the
    inverse of :func:`shard_sequence`. No communication."""
    shares = list(shares)
    N = len(shares)
    if N == 0 or len({tuple(t.shape) for t in shares}) != 1:
        raise ValueError(f"unshard_sequence needs one share per rank, all of one shape; got shapes "
                         f"{[tuple(t.shape) for t in shares]}")
    s = N * shares[0].shape[dim]
    pos = torch.cat([sequence_positions(s, N, r, layout) for r in range(N)]).to(shares[0].device)
    inverse = torch.empty_like(pos)
    inverse[pos] = torch.arange(s, device=pos.device)
    return torch.cat(shares, dim=dim).index_select(dim, inverse)


def gather_sequence(x: torch.Tensor, group=None, *, layout: str = "contiguous", dim: int = 2,
                    builtin: bool = False) -> torch.Tensor:
    """All-gather every rank's share ``x`` and return the full sequence in order (a collective: every
    rank of ``group`` calls it). The course's ring all-gather, or torch's with ``builtin=True``. For
    inspecting results: it does not take part in autograd."""
    _check_layout(layout)
    N = dist.get_world_size(group)
    x = x.detach().movedim(dim, 0).contiguous()
    out = torch.empty((N * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather_single(out, x, group=group, builtin=builtin)
    return unshard_sequence(list(out.movedim(0, dim).chunk(N, dim=dim)), layout=layout, dim=dim)


# --------------------------------------------------------------------------- ring attention

def _tiles(mine, theirs, causal: bool):
    """The (query chunk, key chunk) tiles a rank computes as ``(q_lo, q_hi, q_start, k_lo, k_hi,
    k_start)``: without a mask the whole share against the whole block (positions do not matter);
    when ``causal``, every pair of chunks with at least one key not after its query (a tile wholly
    in the future is skipped)."""
    if not causal:
        yield mine[0][0], mine[-1][1], 0, theirs[0][0], theirs[-1][1], 0
        return
    for q_lo, q_hi, q_start in mine:
        for k_lo, k_hi, k_start in theirs:
            if k_start > q_start + (q_hi - q_lo) - 1:
                continue
            yield q_lo, q_hi, q_start, k_lo, k_hi, k_start


def _ring_setup(q, group, layout, transport):
    g = collectives._Group(group, transport)
    N, n = g.size, q.shape[-2]
    _share(N * n, N, layout, "sequence (N x the local share)")
    return g, [_chunks(r, N, n, layout) for r in range(N)]


_KV_TAG, _DKV_TAG = 1, 2  # gloo: K/V and dK/dV exchanges in flight together never match each other


def _post(g, send: torch.Tensor, recv: torch.Tensor, tag: int):
    """One ring exchange, posted now and waited for by :func:`_done`: ``send`` to the right neighbour
    while ``recv`` comes from the left one (one ``batch_isend_irecv`` when paired: NCCL)."""
    start = time.perf_counter()
    return g.exchange([(send, g.right())], [(recv, g.left())], tag=tag), start


def _done(handle, g, rec, name: str, sent, got, step: int) -> None:
    if handle is None:
        return
    work, start = handle
    work.wait()
    if rec is not None:
        rec.comm(name, sent.numel() * sent.element_size() if sent is not None else 0,
                 got.numel() * got.element_size() if got is not None else 0, start, time.perf_counter(),
                 peer=g.global_ranks[g.right()], step=step)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, transport):
        g, chunks = _ring_setup(q, group, layout, transport)
        N, r, rec = g.size, g.rank, trace.current()
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()             # one message per step: (2, b, a, n, d)
        for i in range(N):
            src = (r - i) % N                              # whose K/V this rank holds in step i
            nxt = torch.empty_like(kv) if i < N - 1 else None
            handle = _post(g, kv, nxt, _KV_TAG) if nxt is not None else None  # overlaps the compute below
            tiles = list(_tiles(chunks[r], chunks[src], causal))
            with trace.span("compute", f"ring_attention/step {i}", step=i, src=src, pairs=_pairs(tiles),
                            tiles=_rects(chunks[r], chunks[src], tiles)):
                for q_lo, q_hi, q_st, k_lo, k_hi, k_st in tiles:
                    o, l = attend_block(q[..., q_lo:q_hi, :], kv[0, ..., k_lo:k_hi, :], kv[1, ..., k_lo:k_hi, :],
                                        causal=causal, q_offset=q_st, k_offset=k_st, scale=scale)
                    out[..., q_lo:q_hi, :], lse[..., q_lo:q_hi] = merge(
                        out[..., q_lo:q_hi, :], lse[..., q_lo:q_hi], o, l)
            _done(handle, g, rec, f"ring_attention/kv step {i}", kv, nxt, i)
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale, ctx.transport = group, causal, layout, scale, transport
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        g, chunks = _ring_setup(q, ctx.group, ctx.layout, ctx.transport)
        N, r, rec = g.size, g.rank, trace.current()
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        mine = None                                        # this rank's own dK/dV (step 0)
        pending = None                                     # the dK/dV exchange in flight
        for i in range(N):
            src = (r - i) % N
            nxt = torch.empty_like(kv) if i < N - 1 else None
            handle = _post(g, kv, nxt, _KV_TAG) if nxt is not None else None
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=q.device)
            tiles = list(_tiles(chunks[r], chunks[src], ctx.causal))
            with trace.span("compute", f"ring_attention backward/step {i}", step=i, src=src,
                            pairs=_pairs(tiles), tiles=_rects(chunks[r], chunks[src], tiles)):
                for q_lo, q_hi, q_st, k_lo, k_hi, k_st in tiles:
                    gq, gk, gv = attend_block_backward(
                        q[..., q_lo:q_hi, :], kv[0, ..., k_lo:k_hi, :], kv[1, ..., k_lo:k_hi, :],
                        dout[..., q_lo:q_hi, :], lse[..., q_lo:q_hi], delta[..., q_lo:q_hi],
                        causal=ctx.causal, q_offset=q_st, k_offset=k_st, scale=ctx.scale)
                    dq[..., q_lo:q_hi, :] += gq
                    dkv[0, ..., k_lo:k_hi, :] += gk
                    dkv[1, ..., k_lo:k_hi, :] += gv
            if i == 0:
                mine = dkv                                 # my own block: added to what comes home
            else:
                # dK/dV of block ``src`` started at rank src+1 (step 1) and collects one term per hop;
                # what arrives now (from the left, sent in its step i-1) is block src's sum so far
                if pending is not None:
                    _done(pending[0], g, rec, f"ring_attention backward/dkv step {i - 1}", *pending[1:], i - 1)
                    dkv += pending[2]
                incoming = torch.empty_like(dkv)           # block src-1's partial sum, from the left
                pending = (_post(g, dkv, incoming, _DKV_TAG), dkv, incoming)
            _done(handle, g, rec, f"ring_attention backward/kv step {i}", kv, nxt, i)
            kv = nxt
        if pending is not None:                            # the last hop brings my own block home
            _done(pending[0], g, rec, f"ring_attention backward/dkv step {N - 1}", *pending[1:], N - 1)
            mine += pending[2]
        return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None)


def _pairs(tiles) -> int:
    """The (query, key) pairs of ``tiles`` (per batch element and head): their areas."""
    return sum((q_hi - q_lo) * (k_hi - k_lo) for q_lo, q_hi, _, k_lo, k_hi, _ in tiles)


def _rects(mine, theirs, tiles) -> list[tuple[int, int, int, int]]:
    """``tiles`` (rows of the local shares) as rectangles of sequence positions ``(q_lo, q_hi, k_lo,
    k_hi)``, one per (query chunk, key chunk) a tile covers: what :func:`ring_tiles` reports."""
    out = []
    for q_lo, q_hi, _, k_lo, k_hi, _ in tiles:
        for lo, hi, start in mine:
            a, b = max(lo, q_lo), min(hi, q_hi)
            for klo, khi, kstart in theirs:
                c, e = max(klo, k_lo), min(khi, k_hi)
                if a < b and c < e:
                    out.append((start + a - lo, start + b - lo, kstart + c - klo, kstart + e - klo))
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous", scale: float | None = None,
                   transport=None) -> torch.Tensor:
    """Ring attention over the ``N`` ranks of ``group`` (context parallelism; module docstring).

    Args:
        q, k, v: this rank's share of the sequence, ``(b, a, s/N, d)`` each, holding the positions
            :func:`sequence_positions` gives for ``layout`` (make them with :func:`shard_sequence`).
        group: process group (``None`` = default group); ranks are group ranks.
        causal: query at position ``i`` sees keys at positions ``<= i`` of the **full** sequence.
        layout: ``"contiguous"`` or ``"zigzag"`` (load-balanced for ``causal``; needs ``s/N`` even).
        scale: score scale (default ``1/sqrt(d)``).
        transport: what carries the point-to-point messages (``None``: ``torch.distributed``;
            ``collectives.PairedP2P()``: NCCL's paired discipline on gloo).

    Returns:
        This rank's share of the output, ``(b, a, s/N, d)``: equal to the matching rows of attention
        over the full sequence. Differentiable: the backward runs the ring again and returns this
        rank's share of ``dq, dk, dv``. Sends ``ring_attention_bytes`` per rank; with a
        :class:`course_lib.trace.Recorder` active, every step adds a ``"compute"`` span carrying
        ``pairs`` (the (query, key) pairs it computed per batch element and head: :func:`ring_work`)
        and ``tiles`` (which ones, as rectangles of sequence positions: :func:`ring_tiles`), and a
        ``"comm"`` event with its bytes.
    """
    _check_qkv(q, k, v, "ring_attention", same_length=True)
    _check_layout(layout)
    return _Ring.apply(q, k, v, group, bool(causal), layout, scale, transport)


def ring_work(s: int, world_size: int, *, causal: bool, layout: str = "contiguous") -> list[int]:
    """The (query, key) pairs each rank's ring computes per batch element and head (forward; the
    backward computes the same tiles), rank by rank: its score tiles' areas, whole tiles counted
    (a diagonal tile is computed whole, then masked).

    ``n = s/N``. Non-causal: ``N n^2`` on every rank. Causal, contiguous: rank ``r`` skips the blocks
    of ranks after it, ``(r + 1) n^2`` (rank ``N-1`` does ``N`` times rank 0's work). Causal, zig-zag
    (chunks of ``c = n/2``): ``3 c^2`` on its own block and ``2 c^2`` on each other one,
    ``(2N + 1) c^2`` on every rank. Multiply by ``4 b a d`` for the forward's FLOPs.
    """
    n = _share(s, world_size, layout)
    N = world_size
    if not causal:
        return [N * n * n] * N
    if layout == "contiguous":
        return [(r + 1) * n * n for r in range(N)]
    return [(2 * N + 1) * (n // 2) ** 2] * N


def ring_tiles(s: int, world_size: int, rank: int, *, causal: bool,
               layout: str = "contiguous") -> list[dict]:
    """What rank ``rank`` of :func:`ring_attention` computes at each ring step, from the same tiles
    the ring runs: ``[{"step": i, "src": (rank - i) mod N, "tiles": [(q_lo, q_hi, k_lo, k_hi), ...],
    "pairs": p}, ...]``, one dict per step. Each tile is a rectangle of **sequence positions**
    (queries ``[q_lo, q_hi)`` against keys ``[k_lo, k_hi)``, one per pair of chunks); ``pairs`` is
    their area, the (query, key) pairs per batch element and head (a tile on the diagonal is
    computed whole, then masked). The ring's ``"compute"`` trace spans carry the same ``step``,
    ``src``, ``tiles`` and ``pairs``; summed over the steps, ``pairs`` is :func:`ring_work`.
    :func:`course_lib.viz.plot_ring_tiles` draws them."""
    n = _share(s, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    chunks = [_chunks(r, world_size, n, layout) for r in range(world_size)]
    out = []
    for i in range(world_size):
        src = (rank - i) % world_size
        tiles = list(_tiles(chunks[rank], chunks[src], bool(causal)))
        out.append({"step": i, "src": src, "tiles": _rects(chunks[rank], chunks[src], tiles),
                    "pairs": _pairs(tiles)})
    return out


def ring_attention_bytes(b: int, a: int, s: int, d: int, world_size: int, *,
                         bytes_per_value: int = 4) -> dict:
    """Bytes one rank sends in :func:`ring_attention` (and receives: the ring is symmetric):
    ``{"forward": (N-1) * 2 b a (s/N) d * bytes, "backward": (N-1) * 2 b a (s/N) d * (bytes + acc)}``:
    the backward sends the K/V blocks once more and their dK/dV, each ``N-1`` hops. dK/dV travel as
    accumulators, ``acc`` = 4 bytes (float32; 8 for float64 inputs), so for fp32 the backward sends
    twice the forward's bytes."""
    n = _share(s, world_size, "contiguous")
    acc = 8 if bytes_per_value == 8 else 4
    block = 2 * b * a * n * d
    return {"forward": (world_size - 1) * block * bytes_per_value,
            "backward": (world_size - 1) * block * (bytes_per_value + acc)}


# --------------------------------------------------------------------------- DeepSpeed-Ulysses

def _seq_to_heads(x: torch.Tensor, group, builtin: bool) -> torch.Tensor:
    """``(*, a, s/N, d)`` (my tokens, all heads) -> ``(*, a/N, s, d)`` (all tokens, my heads)."""
    N = dist.get_world_size(group)
    *lead, a, n, d = x.shape
    blocks = x.reshape(*lead, N, a // N, n, d).movedim(-4, 0).contiguous()   # block j: heads of rank j
    got = torch.empty_like(blocks)                                          # block i: rank i's tokens
    with trace.span("comm", "ulysses/all-to-all sequence -> heads"):
        collectives.all_to_all_single(got, blocks, group=group, builtin=builtin)
    return got.movedim(0, -3).reshape(*lead, a // N, N * n, d)


def _heads_to_seq(x: torch.Tensor, group, builtin: bool) -> torch.Tensor:
    """``(*, a/N, s, d)`` (all tokens, my heads) -> ``(*, a, s/N, d)`` (my tokens, all heads)."""
    N = dist.get_world_size(group)
    *lead, ah, s, d = x.shape
    blocks = x.reshape(*lead, ah, N, s // N, d).movedim(-3, 0).contiguous()  # block j: tokens of rank j
    got = torch.empty_like(blocks)                                          # block i: rank i's heads
    with trace.span("comm", "ulysses/all-to-all heads -> sequence"):
        collectives.all_to_all_single(got, blocks, group=group, builtin=builtin)
    return got.movedim(0, -4).reshape(*lead, N * ah, s // N, d)


class _SeqToHeads(torch.autograd.Function):
    """All-to-all sequence-sharded -> head-sharded; its backward is the reverse all-to-all (an
    all-to-all is a permutation of blocks, whose transpose is its inverse)."""

    @staticmethod
    def forward(ctx, x, group, builtin):
        ctx.group, ctx.builtin = group, builtin
        return _seq_to_heads(x, group, builtin)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.builtin), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, builtin):
        ctx.group, ctx.builtin = group, builtin
        return _heads_to_seq(x, group, builtin)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.builtin), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                      causal: bool = False, attn: Callable | None = None,
                      builtin: bool = False) -> torch.Tensor:
    """DeepSpeed-Ulysses over the ``N`` ranks of ``group`` (module docstring).

    Args:
        q, k, v: this rank's contiguous share of the sequence, ``(b, a, s/N, d)`` each (rank ``r``
            holds positions ``[r s/N, (r+1) s/N)``); ``N`` must divide the heads ``a``.
        group: process group (``None`` = default group).
        causal: passed to ``attn`` as ``is_causal``: after the all-to-all every rank holds the whole
            sequence in order, so the usual mask is right.
        attn: ``attn(q, k, v, is_causal=...)`` on ``(b, a/N, s, d)``; default
            ``F.scaled_dot_product_attention`` (looked up at call time). E.g.
            ``lambda q, k, v, is_causal: blockwise_attention(q, k, v, causal=is_causal)``.
        builtin: the course's pairwise all-to-all (default; transfers recorded by ``trace``) or
            ``dist.all_to_all_single``.

    Returns:
        This rank's share of the output, ``(b, a, s/N, d)``. Differentiable (the backward runs the
        all-to-alls in reverse). One all-to-all carries q, k and v together, one the output back.
    """
    _check_qkv(q, k, v, "ulysses_attention", same_length=True)
    N = dist.get_world_size(group) if dist.is_initialized() else None
    if N is None:
        raise RuntimeError("ulysses_attention needs an initialised process group: run it on the ranks "
                           "of course_lib.launch.Cluster / run, or under torchrun")
    a = q.shape[1]
    if a % N:
        ok = [x for x in range(1, a + 1) if a % x == 0]
        raise ValueError(f"ulysses_attention splits the a={a} heads over N={N} ranks, so N must divide a: "
                         f"use a group of size in {ok}, or a number of heads that is a multiple of {N} "
                         "(ring_attention splits the sequence instead and has no such limit)")
    attn = F.scaled_dot_product_attention if attn is None else attn
    qkv = _SeqToHeads.apply(torch.stack((q, k, v)), group, builtin)          # (3, b, a/N, s, d)
    out = attn(qkv[0], qkv[1], qkv[2], is_causal=bool(causal))
    return _HeadsToSeq.apply(out, group, builtin)


def ulysses_bytes(b: int, a: int, s: int, d: int, world_size: int, *, bytes_per_value: int = 4) -> dict:
    """Bytes one rank sends in :func:`ulysses_attention` (and receives):
    ``{"forward": 4 (N-1)/N * b a (s/N) d * bytes, "backward": the same}`` (q, k, v in and the output
    back; the backward moves their gradients). Per rank this falls as ``1/N``; the ring's does not."""
    N = world_size
    n = _share(s, N, "contiguous")
    if a % N:
        raise ValueError(f"N={N} does not divide the a={a} heads")
    one = 4 * (N - 1) * b * (a // N) * n * d * bytes_per_value
    return {"forward": one, "backward": one}
