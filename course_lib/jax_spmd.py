"""JAX SPMD counterparts of the course's techniques (``shard_map`` on simulated devices).

Call :func:`course_lib.launch.jax_cpu_devices` before the first JAX operation of the process to get
several CPU devices. Sections:

* Collectives (notebook 03): a ring all-reduce written with ``jax.lax.ppermute`` (one neighbour
  exchange per step) inside ``shard_map``, equal to ``jax.lax.psum``.
* Mixture of experts (notebook 10): the classic MoE-layer exercise (:func:`moe_layer`) and the same layer
  expert-parallel with ``jax.lax.all_to_all`` (:func:`expert_parallel_moe`).
* Long context (notebook 15): ring attention (:func:`ring_attention`), the K/V blocks passed around
  the devices with ``jax.lax.ppermute`` while each device merges its partial results with the online
  softmax; :func:`ring_attention_sharded` runs it on a sequence split over a mesh axis.

Other notebooks add their sections below, each with its own header.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from course_lib.compat import shard_map

__all__ = ["shard_map", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "ring_all_reduce_sharded", "count_hlo_ops", "expert_fn", "moe_layer", "moe_dispatch_masks",
           "expert_parallel_moe", "ring_attention", "ring_attention_sharded"]


# ------------------------------------------------------------------------------------------
# Collectives (notebook 03)
# ------------------------------------------------------------------------------------------
def _shift_right(x, axis_name: str, n: int):
    """Every device sends ``x`` to its right neighbour (i -> i+1 mod n) and gets its left one's."""
    return jax.lax.ppermute(x, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def ring_reduce_scatter(chunks, axis_name: str):
    """Ring reduce-scatter inside ``shard_map``; ``chunks`` has shape ``(N, m)`` on every device.

    Step s (0 <= s < N-1): device i sends chunk (i - s - 1) mod N to device i+1 and adds the chunk
    it receives into chunk (i - s - 2) mod N, so after N-1 steps device i holds the sum over devices
    of chunk i (Patarasuk & Yuan 2009, Sec. 3; same indexing as ``course_lib.collectives``).

    Returns:
        ``(N, m)`` array whose row i is complete on device i (other rows hold partial sums).
    """
    n = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name)
    for s in range(n - 1):  # unrolled at trace time: N-1 collective-permutes
        send = jax.lax.dynamic_index_in_dim(chunks, (i - s - 1) % n, keepdims=False)
        recv = _shift_right(send, axis_name, n)
        dst = (i - s - 2) % n
        mine = jax.lax.dynamic_index_in_dim(chunks, dst, keepdims=False)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, mine + recv, dst, axis=0)
    return chunks


def ring_all_gather(chunks, axis_name: str):
    """Ring all-gather inside ``shard_map``: row i of ``chunks`` (shape ``(N, m)``) is valid on
    device i; after N-1 steps (send row (i - s) mod N, receive row (i - s - 1) mod N) every row is
    valid everywhere."""
    n = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name)
    for s in range(n - 1):
        send = jax.lax.dynamic_index_in_dim(chunks, (i - s) % n, keepdims=False)
        recv = _shift_right(send, axis_name, n)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, recv, (i - s - 1) % n, axis=0)
    return chunks


def ring_all_reduce(x, axis_name: str):
    """Sum of ``x`` over the devices of ``axis_name`` with 2(N-1) ``ppermute`` steps (== ``psum``).

    ``x`` is this device's 1-D block of any length: it is zero-padded to a multiple of N, cut into
    N chunks, reduce-scattered and all-gathered around the ring, then un-padded.
    """
    n = jax.lax.axis_size(axis_name)
    length = x.shape[0]
    m = -(-length // n)  # ceil: chunk length after padding
    chunks = jnp.pad(x, (0, m * n - length)).reshape(n, m)
    chunks = ring_all_gather(ring_reduce_scatter(chunks, axis_name), axis_name)
    return chunks.reshape(-1)[:length]


def ring_all_reduce_sharded(x, mesh: Mesh, axis_name: str = "i", use_psum: bool = False):
    """Apply :func:`ring_all_reduce` (or ``psum``) to the rows of ``x``.

    Args:
        x: shape ``(N, n)``: row d is device d's vector (N = the mesh axis size).
        mesh: a 1-D mesh whose axis is ``axis_name``.
        use_psum: use ``jax.lax.psum`` instead of the ring (the production collective).

    Returns:
        shape ``(N, n)``: every row is the sum of the rows of ``x``.
    """
    def body(block):  # block: (1, n), this device's row
        v = block[0]
        out = jax.lax.psum(v, axis_name) if use_psum else ring_all_reduce(v, axis_name)
        return out[None]

    f = shard_map(body, mesh, in_specs=P(axis_name, None), out_specs=P(axis_name, None))
    return jax.jit(f)(x)


def count_hlo_ops(fn, *args, ops=("collective-permute", "all-reduce")) -> dict:
    """Count collective instructions in the compiled (optimised) HLO of ``jax.jit(fn)(*args)``.

    Counts instruction definitions such as ``collective-permute(`` or ``collective-permute-start(``
    (async pairs are counted once).
    """
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    out = {}
    for op in ops:
        # "= f32[..] collective-permute(" or "collective-permute-start(" (async form)
        out[op] = len(re.findall(rf"\s{re.escape(op)}(?:-start)?\(", text))
    return out


# ------------------------------------------------------------------------------------------
# Mixture of experts (notebook 10): the classic MoE-layer exercise, then expert parallelism
# ------------------------------------------------------------------------------------------
def expert_fn(x, W1, b1, W2, b2):
    """One expert: a two-layer ReLU FFN, ``relu(x W1 + b1) W2 + b2``."""
    return jnp.maximum(0, x @ W1 + b1) @ W2 + b2


def moe_layer(x, gate_W, experts_params, top_k=2):
    """The classic MoE-layer exercise, completed: ``x`` ``(T, d)``, ``gate_W`` ``(d, E)``, ``experts_params`` a list
    of ``(W1, b1, W2, b2)``. Softmax router, top-k, the k probabilities renormalised, the chosen
    experts' outputs weighted and summed. Every expert runs on every token and a mask keeps the chosen
    ones (a common teaching simplification: E times the FLOPs of a real MoE, fine at this size).
    Returns ``(output (T, d), gate_probs (T, E))``."""
    probs = jax.nn.softmax(x @ gate_W, axis=-1)                           # (T, E)
    top_p, top_i = jax.lax.top_k(probs, top_k)                           # (T, k), best first
    top_p = top_p / top_p.sum(axis=-1, keepdims=True)
    outs = jnp.stack([expert_fn(x, *p) for p in experts_params], axis=1)   # (T, E, d)
    chosen = jnp.take_along_axis(outs, top_i[:, :, None], axis=1)         # (T, k, d)
    return (chosen * top_p[:, :, None]).sum(axis=1), probs


def moe_dispatch_masks(probs, top_k: int, capacity: int):
    """GShard's dense dispatch: ``dispatch (T, E, C)`` one-hot (token t goes to slot c of expert e)
    and ``combine (T, E, C)`` (the same, times the token's renormalised weight). Slots first come,
    first served, all first choices before the second ones; a choice beyond ``capacity`` is dropped."""
    T, E = probs.shape
    top_p, top_i = jax.lax.top_k(probs, top_k)
    top_p = top_p / top_p.sum(axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(top_i.T.reshape(-1), E, dtype=jnp.int32)     # (k T, E), choice-major
    pos = (jnp.cumsum(onehot, axis=0) - 1) * onehot                        # slot within its expert
    pos = pos.sum(axis=-1).reshape(top_k, T).T                             # (T, k)
    keep = pos < capacity
    slot = jax.nn.one_hot(jnp.where(keep, pos, capacity), capacity)        # (T, k, C); dropped -> zeros
    expert = jax.nn.one_hot(top_i, E)                                      # (T, k, E)
    dispatch = jnp.einsum("tke,tkc->tec", expert, slot)
    combine = jnp.einsum("tke,tkc,tk->tec", expert, slot, top_p)
    return dispatch, combine


def expert_parallel_moe(x, gate_W, W1, b1, W2, b2, mesh: Mesh, axis: str = "x", top_k: int = 2,
                        capacity: int | None = None):
    """The same MoE layer with experts split over the devices of ``mesh`` axis ``axis``, in ``shard_map``.

    ``x`` ``(T, d)`` is split by tokens, the stacked expert weights ``W1 (E, d, f)``, ``b1 (E, f)``,
    ``W2 (E, f, d)``, ``b2 (E, d)`` by experts (``E / n`` per device), the router replicated. On each
    device: route its tokens, build the ``(E, C, d)`` dispatch buffer with :func:`moe_dispatch_masks`,
    ``jax.lax.all_to_all`` it so that device j gets every device's tokens for its experts, run them,
    ``all_to_all`` back, combine. ``capacity``: slots per expert and device (default: all of a device's
    tokens, nothing drops)."""
    n = mesh.shape[axis]
    E = W1.shape[0]
    if E % n:
        raise ValueError(f"{E} experts do not split over {n} devices")

    def local(x, gate_W, W1, b1, W2, b2):
        t = x.shape[0]
        C = t if capacity is None else capacity
        dispatch, combine = moe_dispatch_masks(jax.nn.softmax(x @ gate_W, axis=-1), top_k, C)
        buf = jnp.einsum("tec,td->ecd", dispatch, x)                        # (E, C, d), expert-major
        buf = buf.reshape(n, E // n, C, x.shape[1])                          # block j -> device j
        buf = jax.lax.all_to_all(buf, axis, split_axis=0, concat_axis=0, tiled=True)   # (n src, E/n, C, d)
        h = jnp.maximum(0, jnp.einsum("secd,edf->secf", buf, W1) + b1[None, :, None, :])
        y = jnp.einsum("secf,efd->secd", h, W2) + b2[None, :, None, :]
        y = jax.lax.all_to_all(y, axis, split_axis=0, concat_axis=0, tiled=True)       # back: (n, E/n, C, d)
        return jnp.einsum("tec,ecd->td", combine, y.reshape(E, C, x.shape[1]))

    f = shard_map(local, mesh, in_specs=(P(axis), P(), P(axis), P(axis), P(axis), P(axis)), out_specs=P(axis))
    return f(x, gate_W, W1, b1, W2, b2)


# ------------------------------------------------------------------------------------------
# Long context (notebook 15): ring attention with ppermute
# ------------------------------------------------------------------------------------------
def ring_attention(q, k, v, axis_name: str, *, causal: bool = False):
    """Ring attention inside ``shard_map`` (Liu et al. 2023; ``course_lib.context_parallel``'s
    :func:`~course_lib.context_parallel.ring_attention` in PyTorch).

    ``q, k, v``: this device's contiguous share of the sequence, ``(b, a, n, d)``: device ``i`` holds
    positions ``[i n, (i+1) n)`` of ``s = N n``. Step ``t`` (``0 <= t < N``) attends the local queries
    to the K/V block of device ``(i - t) mod N`` and merges the result into the running
    ``(out, lse)`` with the online softmax; between steps one ``ppermute`` passes the K/V block to the
    right neighbour (``N - 1`` collective-permutes, no all-gather). ``causal``: a query sees the keys
    at positions ``<=`` its own in the full sequence. Returns ``(b, a, n, d)``, this device's rows of
    attention over the whole sequence. Differentiable: JAX transposes ``ppermute`` into the reverse
    permutation, so ``jax.grad`` runs the ring backwards.
    """
    n_dev = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name)
    n, d = q.shape[-2], q.shape[-1]
    q_pos = i * n + jnp.arange(n)
    kv = jnp.stack((k, v))
    out = lse = None
    for t in range(n_dev):                                   # unrolled at trace time
        src = (i - t) % n_dev
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, kv[0]) / jnp.sqrt(d).astype(q.dtype)
        if causal:                                           # finite: a block wholly in the future gets weight 0
            k_pos = src * n + jnp.arange(n)
            scores = jnp.where(k_pos[None, :] > q_pos[:, None], -1e30, scores)
        m = scores.max(-1, keepdims=True)
        p = jnp.exp(scores - m)
        l = p.sum(-1, keepdims=True)
        o, blk = jnp.einsum("bhqk,bhkd->bhqd", p, kv[1]) / l, (m + jnp.log(l))[..., 0]
        if out is None:                                      # step 0: my own block (every query sees itself)
            out, lse = o, blk
        else:                                                # the online-softmax merge
            new = jnp.logaddexp(lse, blk)
            out = jnp.exp(lse - new)[..., None] * out + jnp.exp(blk - new)[..., None] * o
            lse = new
        if t < n_dev - 1:
            kv = _shift_right(kv, axis_name, n_dev)          # independent of this step's compute: XLA may overlap them
    return out


def ring_attention_sharded(q, k, v, mesh: Mesh, axis_name: str = "i", *, causal: bool = False):
    """:func:`ring_attention` on full-sequence ``q, k, v`` ``(b, a, s, d)`` whose sequence axis is split
    over ``mesh``'s axis ``axis_name`` (``N`` must divide ``s``); returns the ``(b, a, s, d)`` output."""
    spec = P(None, None, axis_name, None)
    f = shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name, causal=causal), mesh,
                  in_specs=(spec, spec, spec), out_specs=spec)
    return jax.jit(f)(q, k, v)
