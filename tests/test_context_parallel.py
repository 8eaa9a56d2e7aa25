"""Long context (course_lib.context_parallel): blockwise attention in one process, ring attention and
DeepSpeed-Ulysses on one warm 4-rank gloo cluster.

Everything is compared with one process's ``F.scaled_dot_product_attention`` on the full sequence:
outputs and the gradients of q, k, v (float32, tolerance 1e-5: a few roundings of values of order 1).
The 2-rank cases run on the subgroup of global ranks [1, 3], whose group ranks are 0 and 1: code that
used a global rank where the group rank belongs would pick the wrong share (or a rank outside the
ring) and fail. The tests build each rank's share from positions they spell out themselves, not with
the module's layout helpers, so a wrong zig-zag assignment inside the ring cannot cancel out.
Bytes are counted twice: by the module's own ``trace`` records and, independently, at the dispatcher
(``course_lib.grading.guards.record_comm``); both must equal the formulas.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import context_parallel as C
from course_lib.launch import Cluster

WORLD = 4
TOL = 1e-5
# group size -> the global ranks of the group (None: the world)
MEMBERS = {2: [1, 3], 4: None}
B, A, S, D = 2, 4, 32, 8          # batch, heads, sequence, head dim of the distributed cases


@pytest.fixture(scope="module")
def cluster():
    with Cluster(WORLD, timeout=120) as c:
        yield c


def _qkv(b, a, s, d, seed=0, s_k=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, a, s, d, generator=g)
    k = torch.randn(b, a, s if s_k is None else s_k, d, generator=g)
    v = torch.randn(b, a, s if s_k is None else s_k, d, generator=g)
    return [t.requires_grad_(True) for t in (q, k, v)]


def _max_err(a, b):
    return (a - b).abs().max().item()


# ================================================================== one process

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s,block", [(37, 8), (64, 16), (16, 64)], ids=["s37-b8", "s64-b16", "s16-b64"])
def test_blockwise_attention_equals_sdpa_in_outputs_and_gradients(causal, s, block):
    q, k, v = _qkv(2, 3, s, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    out = C.blockwise_attention(q, k, v, causal=causal, block_size=block)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert _max_err(out, ref) < TOL
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _max_err(got, want) < TOL, f"d{name}"
    naive = C.naive_attention(q, k, v, causal=causal)            # the explicit softmax agrees too
    assert _max_err(naive, ref) < TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_blockwise_attention_with_fewer_queries_than_keys(causal):
    q, k, v = _qkv(1, 2, 12, 8, s_k=30)                          # SDPA's causal mask: top-left aligned
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    out = C.blockwise_attention(q, k, v, causal=causal, block_size=7, scale=0.3)
    assert _max_err(out, ref) < TOL
    g = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert _max_err(got, want) < TOL


def test_merge_of_two_key_blocks_is_attention_over_both():
    q, k, v = (t.detach() for t in _qkv(2, 2, 9, 8, s_k=29))
    ref = F.scaled_dot_product_attention(q, k, v)
    a = C.attend_block(q, k[..., :13, :], v[..., :13, :])
    b = C.attend_block(q, k[..., 13:, :], v[..., 13:, :])
    out, lse = C.merge(*a, *b)
    assert _max_err(out, ref) < TOL
    full_lse = torch.logsumexp(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    assert _max_err(lse, full_lse) < TOL
    out2, lse2 = C.merge(*b, *a)                                 # the order of the blocks does not matter
    assert _max_err(out2, out) < TOL and _max_err(lse2, lse) < TOL
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    same = C.merge(*empty, *a)                                   # an empty block changes nothing
    assert torch.allclose(same[0], a[0]) and torch.allclose(same[1], a[1])
    both_empty = C.merge(*empty, *empty)
    assert torch.equal(both_empty[0], empty[0]) and torch.isneginf(both_empty[1]).all()


def test_attend_block_masks_by_position():
    q, k, v = (t.detach() for t in _qkv(1, 1, 4, 8, s_k=6))
    out, lse = C.attend_block(q, k, v, causal=True, q_offset=8, k_offset=10)   # queries 8..11, keys 10..15
    assert torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :]))     # queries 8, 9 see nothing
    assert torch.isneginf(lse[..., :2]).all()
    for row, visible in ((2, 1), (3, 2)):                        # query 10 sees key 10, query 11 keys 10, 11
        scores = q[0, 0, row] @ k[0, 0, :visible].T / 8 ** 0.5
        want = torch.softmax(scores, -1) @ v[0, 0, :visible]
        assert _max_err(out[0, 0, row], want) < TOL
        assert abs(lse[0, 0, row].item() - torch.logsumexp(scores, -1).item()) < TOL
    unmasked = C.attend_block(q, k, v, causal=True, q_offset=20, k_offset=10)  # every key in the past
    assert _max_err(unmasked[0], C.attend_block(q, k, v)[0]) == 0


def test_saved_bytes_grow_as_s_squared_for_naive_attention_and_as_s_for_blockwise():
    b, a, d = 1, 2, 8
    measured = {}
    for s in (32, 64):
        q, k, v = _qkv(b, a, s, d)
        measured[s] = (C.attention_saved_bytes(C.naive_attention, q, k, v),
                       C.attention_saved_bytes(C.blockwise_attention, q, k, v, block_size=16),
                       C.attention_saved_bytes(C.blockwise_attention, q, k, v, causal=True, block_size=16))
        naive, blockwise, blockwise_causal = measured[s]
        assert naive == b * a * s * s * 4                       # the (s, s) probabilities, fp32
        assert blockwise == blockwise_causal == b * a * s * (d + 1) * 4   # the output and the lse
    assert measured[64][0] == 4 * measured[32][0] and measured[64][1] == 2 * measured[32][1]


def test_layouts_give_each_rank_the_positions_the_docstring_promises():
    assert C.sequence_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert C.sequence_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert C.sequence_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    assert C.sequence_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.arange(2 * 3 * 16 * 2.0).view(2, 3, 16, 2)
    for layout in C.LAYOUTS:
        shares = [C.shard_sequence(x, 4, r, layout=layout) for r in range(4)]
        for r, sh in enumerate(shares):
            assert torch.equal(sh, x[:, :, C.sequence_positions(16, 4, r, layout)])
        assert torch.equal(C.unshard_sequence(shares, layout=layout), x)
        pos = torch.cat([C.sequence_positions(16, 4, r, layout) for r in range(4)])
        assert sorted(pos.tolist()) == list(range(16))


def test_ring_work_shows_the_causal_imbalance_and_zigzag_removes_it():
    n = 8                                                          # tokens per rank
    assert C.ring_work(4 * n, 4, causal=False) == [4 * n * n] * 4
    assert C.ring_work(4 * n, 4, causal=False, layout="zigzag") == [4 * n * n] * 4
    contiguous = C.ring_work(4 * n, 4, causal=True)
    zigzag = C.ring_work(4 * n, 4, causal=True, layout="zigzag")
    assert contiguous == [n * n, 2 * n * n, 3 * n * n, 4 * n * n]   # rank 3 does 4x rank 0's work
    assert zigzag == [9 * (n // 2) ** 2] * 4                        # (2N + 1)(n/2)^2 everywhere
    assert max(zigzag) < max(contiguous)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_tiles_cover_each_needed_pair_once_and_add_up_to_ring_work(layout, causal):
    s, N = 32, 4
    for r in range(N):
        steps = C.ring_tiles(s, N, r, causal=causal, layout=layout)
        assert [d["step"] for d in steps] == list(range(N))
        assert [d["src"] for d in steps] == [(r - i) % N for i in range(N)]
        mine = set(_positions(s, N, r, layout).tolist())
        covered = []
        for d in steps:
            theirs = set(_positions(s, N, d["src"], layout).tolist())
            area = 0
            for q_lo, q_hi, k_lo, k_hi in d["tiles"]:
                assert set(range(q_lo, q_hi)) <= mine and set(range(k_lo, k_hi)) <= theirs
                covered += [(qp, kp) for qp in range(q_lo, q_hi) for kp in range(k_lo, k_hi)]
                area += (q_hi - q_lo) * (k_hi - k_lo)
            assert area == d["pairs"]
        assert len(covered) == len(set(covered))                     # no pair computed twice
        needed = {(qp, kp) for qp in mine for kp in range(s) if not causal or kp <= qp}
        assert needed <= set(covered)                                # every visible key of every query
        assert sum(d["pairs"] for d in steps) == C.ring_work(s, N, causal=causal, layout=layout)[r]
    with pytest.raises(ValueError, match="rank 4 is not in a group of 4"):
        C.ring_tiles(s, N, 4, causal=True)


def test_bad_input_gives_clear_errors():
    q, k, v = _qkv(1, 2, 8, 8)
    with pytest.raises(ValueError, match="same shape"):
        C.blockwise_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="batch, heads and head dim"):
        C.blockwise_attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match=r"\(b, a, s, d\)"):
        C.blockwise_attention(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="floating-point"):
        C.naive_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="block_size"):
        C.blockwise_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="one shape"):           # checked before any message is posted
        C.ring_attention(q, k[..., :4, :], v[..., :4, :])
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4 \\(e.g. s=32\\)"):
        C.shard_sequence(torch.zeros(1, 1, 30, 2), 4, 0)
    with pytest.raises(ValueError, match="2N = 8 equal chunks.*s=40"):
        C.shard_sequence(torch.zeros(1, 1, 36, 2), 4, 0, layout="zigzag")
    with pytest.raises(ValueError, match="unknown layout"):
        C.sequence_positions(8, 2, 0, "striped")


# ================================================================== on the ranks

def _group(world):
    import torch.distributed as dist
    members = MEMBERS[world]
    return (None if members is None else dist.new_group(members)), members or list(range(WORLD))


def _positions(s, n_ranks, r, layout):
    """Rank r's positions, spelled out here (not with the module's helpers)."""
    n = s // n_ranks
    if layout == "contiguous":
        return torch.arange(r * n, (r + 1) * n)
    c = n // 2
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n_ranks - 1 - r) * c, (2 * n_ranks - r) * c)])


def _reference(causal, seed=0):
    """Full-sequence attention in one process: inputs, upstream gradient, output, input gradients."""
    q, k, v = _qkv(B, A, S, D, seed)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, (q, k, v), g)
    return (q.detach(), k.detach(), v.detach()), g, out.detach(), grads


def _run_distributed(attention, causal, pos):
    """Run ``attention`` on this rank's share; errors against the reference and the bytes sent."""
    from course_lib import trace
    from course_lib.grading.guards import record_comm

    (q, k, v), g, ref, ref_grads = _reference(causal)
    mine = [t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
    with trace.Recorder() as rec_f, record_comm() as comm_f:
        out = attention(*mine)
    with trace.Recorder() as rec_b, record_comm() as comm_b:
        out.backward(g[:, :, pos])
    errs = {"out": _max_err(out, ref[:, :, pos])}
    errs.update({f"d{n}": _max_err(t.grad, want[:, :, pos]) for n, t, want in zip("qkv", mine, ref_grads)})
    sent = {"trace": (rec_f.totals()["bytes_sent"], rec_b.totals()["bytes_sent"]),
            "recv": (rec_f.totals()["bytes_recv"], rec_b.totals()["bytes_recv"]),
            "dispatcher": (comm_f.sent_bytes, comm_b.sent_bytes)}
    pairs = ([e["pairs"] for e in rec_f.events if e["kind"] == "compute"],
             [e["pairs"] for e in rec_b.events if e["kind"] == "compute"],
             [(e.get("step"), e.get("tiles")) for e in rec_f.events if e["kind"] == "compute"])
    return errs, sent, pairs, out


def _ring_case(rank, world_size, world, layout, causal, paired):
    import torch.distributed as dist
    from course_lib import collectives
    from course_lib import context_parallel as C

    grp, members = _group(world)
    if rank not in members:
        return None
    r = dist.get_rank(grp)
    transport = collectives.PairedP2P() if paired else None
    def attention(q, k, v):
        return C.ring_attention(q, k, v, grp, causal=causal, layout=layout, transport=transport)

    errs, sent, pairs, out = _run_distributed(attention, causal, _positions(S, world, r, layout))
    full = C.gather_sequence(out, grp, layout=layout)
    errs["gathered"] = _max_err(full, _reference(causal)[2])
    return r, errs, sent, pairs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4], ids=["ranks[1,3]", "4ranks"])
def test_ring_attention_equals_one_process_attention(cluster, world, layout, causal):
    res = [x for x in cluster.run(_ring_case, world, layout, causal, False) if x is not None]
    assert len(res) == world
    want_bytes = C.ring_attention_bytes(B, A, S, D, world)
    work = C.ring_work(S, world, causal=causal, layout=layout)
    for r, errs, sent, pairs in res:
        assert max(errs.values()) < TOL, f"group rank {r}: {errs}"
        for how, got in sent.items():      # forward: N-1 K/V blocks; backward: K/V and dK/dV, N-1 each
            assert got == (want_bytes["forward"], want_bytes["backward"]), (r, how, got, want_bytes)
        fwd, bwd, tiles = pairs
        assert len(fwd) == len(bwd) == world                     # one compute step per ring step
        assert sum(fwd) == sum(bwd) == work[r], (r, fwd, bwd, work)
        described = C.ring_tiles(S, world, r, causal=causal, layout=layout)
        assert tiles == [(d["step"], d["tiles"]) for d in described]    # the trace shows what ring_tiles says


def test_ring_attention_with_ncclstyle_paired_messages(cluster):
    res = cluster.run(_ring_case, 4, "zigzag", True, True)
    for r, errs, sent, pairs in res:
        assert max(errs.values()) < TOL, f"group rank {r}: {errs}"
        assert sent["dispatcher"] == tuple(C.ring_attention_bytes(B, A, S, D, 4).values())


def _ulysses_case(rank, world_size, world, causal, custom_attn, builtin):
    import torch.distributed as dist
    from course_lib import context_parallel as C

    grp, members = _group(world)
    if rank not in members:
        return None
    r = dist.get_rank(grp)
    def blockwise(q, k, v, is_causal):
        return C.blockwise_attention(q, k, v, causal=is_causal, block_size=8)

    def attention(q, k, v):
        return C.ulysses_attention(q, k, v, grp, causal=causal, attn=blockwise if custom_attn else None,
                                   builtin=builtin)

    errs, sent, _, _ = _run_distributed(attention, causal, _positions(S, world, r, "contiguous"))
    return r, errs, sent


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world", [2, 4], ids=["ranks[1,3]", "4ranks"])
def test_ulysses_attention_equals_one_process_attention(cluster, world, causal):
    res = [x for x in cluster.run(_ulysses_case, world, causal, False, False) if x is not None]
    assert len(res) == world
    want = C.ulysses_bytes(B, A, S, D, world)
    ring = C.ring_attention_bytes(B, A, S, D, world)
    assert ring["forward"] == world // 2 * want["forward"]       # the ring sends N/2 x Ulysses' bytes
    for r, errs, sent in res:
        assert max(errs.values()) < TOL, f"group rank {r}: {errs}"
        for how in ("trace", "recv", "dispatcher"):
            assert sent[how] == (want["forward"], want["backward"]), (r, how, sent[how], want)


def test_ulysses_with_another_attention_and_torchs_all_to_all(cluster):
    res = cluster.run(_ulysses_case, 4, True, True, True)
    for r, errs, sent in res:
        assert max(errs.values()) < TOL, f"group rank {r}: {errs}"


def _bad_input_case(rank, world_size):
    import torch
    from course_lib import context_parallel as C

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    q6 = torch.randn(1, 6, 4, 8)                                 # 6 heads on 4 ranks
    q5 = torch.randn(1, 4, 5, 8)                                 # 5 tokens per rank: odd, no zig-zag
    return {"heads": error(lambda: C.ulysses_attention(q6, q6, q6)),
            "zigzag": error(lambda: C.ring_attention(q5, q5, q5, layout="zigzag")),
            "layout": error(lambda: C.ring_attention(q5, q5, q5, layout="striped")),
            "then": C.ring_attention(q5, q5, q5).shape}          # nothing was left in flight


def test_bad_input_on_the_ranks_fails_everywhere_before_any_message(cluster):
    for res in cluster.run(_bad_input_case):
        assert "ValueError" in res["heads"] and "N must divide a" in res["heads"]
        assert "group of size in [1, 2, 3, 6]" in res["heads"]
        assert "2N = 8 equal chunks" in res["zigzag"]
        assert "unknown layout" in res["layout"]
        assert tuple(res["then"]) == (1, 4, 5, 8)


def _torch_cp_case(rank, world_size):
    """torch's context_parallel vs ring_attention, non-causal, forward and backward: what runs on
    gloo/CPU, with SDPA held to its math backend (the CPU flash kernel's op has no CP rule: DTensor
    spends 45-105 s here propagating shardings through its decomposition, and its backward fails)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from course_lib import context_parallel as C

    warnings.filterwarnings("ignore")
    (q, k, v), g, _, _ = _reference(False)
    mesh = init_device_mesh("cpu", (world_size,))
    qs, ks, vs, gs = q.clone(), k.clone(), v.clone(), g.clone()
    with sdpa_kernel(SDPBackend.MATH), context_parallel(mesh, buffers=[qs, ks, vs, gs], buffer_seq_dims=[2] * 4,
                                                        no_restore_buffers={qs, ks, vs, gs}):
        for t in (qs, ks, vs):
            t.requires_grad_(True)
        theirs = F.scaled_dot_product_attention(qs, ks, vs)
        theirs.backward(gs)
    assert theirs.shape == (B, A, S // world_size, D), (
        f"torch's context_parallel returned a local output of shape {tuple(theirs.shape)}, not this rank's "
        "sequence share: on the math backend DTensor places the output by its cost model (module docstring)")
    pos = _positions(S, world_size, rank, "zigzag")
    mine = [t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
    ours = C.ring_attention(*mine, layout="zigzag")
    ours.backward(g[:, :, pos])
    errs = {"out": _max_err(ours, theirs)}
    errs.update({f"d{n}": _max_err(a.grad, b.grad) for n, a, b in zip("qkv", mine, (qs, ks, vs))})
    return torch.equal(qs.detach(), C.shard_sequence(q, world_size, rank, layout="zigzag")), errs


def test_ring_attention_matches_torchs_context_parallel(cluster):
    for same_layout, errs in cluster.run(_torch_cp_case):
        assert same_layout, "torch's head-tail load balancer is shard_sequence's zig-zag layout"
        assert max(errs.values()) < TOL, errs


# --------------------------------------------------------------------------- JAX
def test_jax_ring_attention_with_ppermute_equals_full_attention():
    """course_lib.jax_spmd.ring_attention in shard_map on 4 simulated devices: causal output and
    gradients equal to full attention, and the forward passes K/V with N - 1 = 3 ppermutes, no gather."""
    import subprocess
    import sys
    code = r'''
from course_lib.launch import jax_cpu_devices
devs = jax_cpu_devices(4)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from course_lib import jax_spmd as J
mesh, spec = Mesh(np.array(devs), ("i",)), P(None, None, "i", None)
rng = np.random.default_rng(0)
q, k, v, g = (jnp.asarray(rng.normal(size=(1, 2, 16, 4)), jnp.float32) for _ in range(4))
def full(q, k, v):
    s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), jnp.einsum("bhqd,bhkd->bhqk", q, k) / 2.0, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
ring = J.shard_map(lambda q, k, v: J.ring_attention(q, k, v, "i", causal=True), mesh, in_specs=(spec,) * 3, out_specs=spec)
def both(q, k, v):
    grads = [jax.grad(lambda *a: (f(*a) * g).sum(), (0, 1, 2))(q, k, v) for f in (ring, full)]
    return ring(q, k, v), full(q, k, v), grads
o1, o2, (g1, g2) = jax.jit(both)(q, k, v)
err = max([float(jnp.abs(o1 - o2).max())] + [float(jnp.abs(a - b).max()) for a, b in zip(g1, g2)])
text = str(jax.make_jaxpr(ring)(q, k, v))
print(err, text.count("ppermute"), text.count("all_gather"), text.count("psum"))
'''
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    err, permutes, gathers, sums = out.stdout.split()
    assert float(err) < 1e-5
    assert (int(permutes), int(gathers), int(sums)) == (3, 0, 0)
