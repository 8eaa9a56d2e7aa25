"""From-scratch collectives (course_lib.collectives) against torch.distributed on real gloo ranks.

One 4-rank cluster serves the whole module. Group sizes 1-4 come from explicit process groups
(``dist.new_group``) over it, which also exercises the group-rank -> global-rank mapping (the
3-rank group is ranks 1, 2, 3, so its group rank 0 is global rank 1).

Tolerances. The ring adds the N contributions in a different order than gloo, and each addition
rounds once in the tensor's dtype; two such sums of the same N terms differ by at most
(N-1) * eps * sum_i |x_i| (each rounding errs by <= eps/2 relative to a partial sum bounded by
sum_i |x_i|, in each of the two computations). ``op="avg"`` adds one division rounding: eps * |y|.
We check every element against that bound (times 1.01 for the bound's own rounding), and exactly
for float64 on integer-valued data, where no rounding happens at all.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import collectives as C
from course_lib import compat
from course_lib.launch import Cluster, RankError

WORLD = 4
# group name -> global ranks; built on every rank inside the workers
GROUPS = {"world": None, "pair": [0, 1], "triple": [1, 2, 3], "single": [2]}
LENGTHS = [0, 1, 2, 3, 5, 7, 10, 1000, 4099]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(WORLD, timeout=180) as c:
        yield c


# ------------------------------------------------------------------ worker helpers (by reference)
def _groups():
    """Create the GROUPS on every rank (new_group is collective over the world)."""
    import torch.distributed as dist

    out = {}
    for name, ranks in GROUPS.items():
        out[name] = None if ranks is None else dist.new_group(ranks)
    return out


def _members(name):
    ranks = GROUPS[name]
    return list(range(WORLD)) if ranks is None else ranks


def _data(seed, n, dtype, integer):
    g = torch.Generator().manual_seed(seed)
    if integer:
        return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _eps(dtype):
    return torch.finfo(dtype).eps


def _bound(xs_abs_sum, y, n_ranks, dtype, op):
    eps = _eps(dtype)
    b = (n_ranks - 1) * eps * xs_abs_sum
    if op == "avg":
        b = b / n_ranks + eps * y.abs()
    return 1.01 * b + 1e-30


def all_reduce_worker(rank, world_size, impl, pipeline_bytes):
    """For every group/length/dtype/op: ours vs dist.all_reduce on the same data; return failures."""
    import torch.distributed as dist

    groups = _groups()
    failures, checked = [], 0
    for gname, group in groups.items():
        members = _members(gname)
        if rank not in members:
            continue
        n_ranks = len(members)
        grank = members.index(rank)
        for n in LENGTHS:
            for dtype in DTYPES:
                for integer in (True, False):
                    if integer and dtype != torch.float64:
                        continue
                    for op in ("sum", "avg"):
                        x = _data(1000 * grank + n, n, dtype, integer)
                        ref = x.clone()
                        dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG,
                                        group=group)
                        y = x.clone()
                        if impl in ("ring", "ring-paired"):  # ring-paired: NCCL's code path, on gloo
                            out = C.ring_all_reduce(y, op, group=group, pipeline_bytes=pipeline_bytes,
                                                    transport=C.PairedP2P() if impl == "ring-paired" else None)
                        elif impl == "plain":
                            out = C.plain_ring_all_reduce(y, op, group=group)
                        else:  # the last rank of the group as root: not rank 0, not global 0
                            out = C.naive_all_reduce(y, op, group=group, root=n_ranks - 1)
                        checked += 1
                        if out is not y:
                            failures.append(f"{gname} n={n}: did not return the input tensor")
                        if integer:
                            if not torch.equal(y, ref):
                                failures.append(f"{gname} n={n} {dtype} {op} integer data: not exact")
                            continue
                        # sum_i |x_i| over the group's ranks, in float64 (exact enough for a bound)
                        abs_sum = x.double().abs()
                        dist.all_reduce(abs_sum, group=group)
                        err = (y.double() - ref.double()).abs()
                        bound = _bound(abs_sum, ref.double(), n_ranks, dtype, op)
                        if n and bool((err > bound).any()):
                            i = int((err - bound).argmax())
                            failures.append(f"{gname} n={n} {dtype} {op}: |ours-torch|={err[i]:.3g} "
                                            f"> bound {bound[i]:.3g} at {i}")
    return failures, checked


def shapes_worker(rank, world_size):
    """Multi-dimensional tensors are reduced in place (same storage, same shape)."""
    import torch.distributed as dist

    x = torch.arange(15, dtype=torch.float64).reshape(3, 5) * (rank + 1)
    ref = x.clone()
    dist.all_reduce(ref)
    ptr = x.data_ptr()
    C.ring_all_reduce(x)
    return x.shape == ref.shape, x.data_ptr() == ptr, torch.equal(x, ref)


def reduce_scatter_worker(rank, world_size, paired=False):
    import torch.distributed as dist

    groups = _groups()
    tp = C.PairedP2P() if paired else None  # paired: NCCL's code path, on gloo
    fails = []
    for gname, group in groups.items():
        members = _members(gname)
        if rank not in members:
            continue
        N, grank = len(members), members.index(rank)
        for dtype in (torch.float64, torch.float32):
            # tensor form, divisible: == dist.reduce_scatter_single
            x = _data(grank, 6 * N, dtype, integer=True)
            ours, ref = torch.empty(6, dtype=dtype), torch.empty(6, dtype=dtype)
            C.ring_reduce_scatter(ours, x, group=group, transport=tp)
            compat.reduce_scatter_single(ref, x.clone(), group=group)
            if not torch.equal(ours, ref):
                fails.append(f"{gname} tensor {dtype}")
            # list form, equal sizes: == dist.reduce_scatter, with avg
            xs = [_data(100 * grank + j, 4, dtype, integer=True) for j in range(N)]
            ours, ref = torch.empty(4, dtype=dtype), torch.empty(4, dtype=dtype)
            C.ring_reduce_scatter(ours, xs, op="avg", group=group, transport=tp)
            dist.reduce_scatter(ref, [t.clone() for t in xs], op=dist.ReduceOp.AVG, group=group)
            if not torch.allclose(ours, ref, rtol=4 * _eps(dtype), atol=0):
                fails.append(f"{gname} list avg {dtype}: {ours} vs {ref}")
            if any(not torch.equal(t, _data(100 * grank + j, 4, dtype, True)) for j, t in enumerate(xs)):
                fails.append(f"{gname}: the input list was modified")
        # uneven tensor form (torch has none): rank r gets chunk r (tensor_split) of the sum,
        # computed here from every rank's regenerated input.
        n = 3 * N + 2
        total = sum(_data(g, n, torch.float64, True) for g in range(N))
        want = torch.tensor_split(total, N)[grank]
        ours = torch.empty(want.numel(), dtype=torch.float64)
        C.ring_reduce_scatter(ours, _data(grank, n, torch.float64, True), group=group, pipeline_bytes=8,
                              transport=tp)
        if not torch.equal(ours, want):
            fails.append(f"{gname} uneven: {ours} vs {want}")
    return fails


def all_gather_worker(rank, world_size, paired=False):
    import torch.distributed as dist

    groups = _groups()
    tp = C.PairedP2P() if paired else None  # paired: NCCL's code path, on gloo
    fails = []
    for gname, group in groups.items():
        members = _members(gname)
        if rank not in members:
            continue
        N, grank = len(members), members.index(rank)
        for dtype in DTYPES:
            x = _data(grank, 5, dtype, integer=False)
            ours, ref = torch.empty(5 * N, dtype=dtype), torch.empty(5 * N, dtype=dtype)
            C.ring_all_gather(ours, x, group=group, transport=tp)
            compat.all_gather_single(ref, x, group=group)
            if not torch.equal(ours, ref):  # a copy, not a sum: bit-exact in every dtype
                fails.append(f"{gname} tensor {dtype}")
            ol, rl = [torch.empty(5, dtype=dtype) for _ in range(N)], [torch.empty(5, dtype=dtype) for _ in range(N)]
            C.ring_all_gather(ol, x, group=group, transport=tp)
            dist.all_gather(rl, x, group=group)
            if not all(torch.equal(a, b) for a, b in zip(ol, rl)):
                fails.append(f"{gname} list {dtype}")
        # uneven slots (gloo refuses these): rank g contributes g + 1 elements
        ol = [torch.empty(g + 1) for g in range(N)]
        C.ring_all_gather(ol, _data(grank, grank + 1, torch.float32, False), group=group, transport=tp)
        if not all(torch.equal(ol[g], _data(g, g + 1, torch.float32, False)) for g in range(N)):
            fails.append(f"{gname} uneven list")
        # uneven tensor form: tensor_split slots
        n = 2 * N + 1
        full = torch.cat([torch.tensor_split(_data(g, n, torch.float64, True), N)[g] for g in range(N)])
        out = torch.empty(n, dtype=torch.float64)
        mine = torch.tensor_split(_data(grank, n, torch.float64, True), N)[grank]
        C.ring_all_gather(out, mine, group=group, transport=tp)
        if not torch.equal(out, full):
            fails.append(f"{gname} uneven tensor")
    return fails


def all_to_all_worker(rank, world_size, paired=False):
    import torch.distributed as dist

    groups = _groups()
    tp = C.PairedP2P() if paired else None  # paired: NCCL's code path, on gloo
    fails = []
    for gname, group in groups.items():
        members = _members(gname)
        if rank not in members:
            continue
        N, g = len(members), members.index(rank)
        inp = [torch.full((3,), float(100 * g + j)) for j in range(N)]
        ours, ref = [torch.empty(3) for _ in range(N)], [torch.empty(3) for _ in range(N)]
        C.all_to_all(ours, inp, group=group, transport=tp)
        compat.all_to_all(ref, inp, group=group)
        if not all(torch.equal(a, b) for a, b in zip(ours, ref)):
            fails.append(f"{gname} equal sizes")
        # uneven (gloo refuses): rank g sends j + g + 1 elements to rank j
        inp = [torch.full((j + g + 1,), float(100 * g + j)) for j in range(N)]
        out = [torch.empty(g + j + 1) for j in range(N)]
        C.all_to_all(out, inp, group=group, transport=tp)
        if not all(torch.equal(out[j], torch.full((g + j + 1,), float(100 * j + g))) for j in range(N)):
            fails.append(f"{gname} uneven")
    return fails


def bytes_worker(rank, world_size, n, dtype):
    """Bytes recorded by trace for one ring and one naive all-reduce of n elements."""
    from course_lib import trace

    out = {}
    with trace.Recorder() as rec:
        C.ring_all_reduce(torch.ones(n, dtype=dtype))
    out["ring"] = rec.totals()
    out["ring_names"] = [e["name"] for e in rec.events]
    with trace.Recorder() as rec:
        C.naive_all_reduce(torch.ones(n, dtype=dtype), root=1)
    out["naive"] = rec.totals()
    return out


def hook_worker(rank, world_size, n):
    """Snapshot the flat buffer after each ring step; check the reduce-scatter invariant."""
    snaps = []
    x = torch.arange(n, dtype=torch.float64) * 10 ** rank
    C.ring_all_reduce(x, step_hook=lambda phase, step, flat: snaps.append((phase, step, flat.clone())),
                      pipeline_bytes=16)
    return [(p, s) for p, s, _ in snaps], snaps[world_size - 2][2], x


def bad_input_worker(rank, world_size):
    """Each bad call must raise before any message is sent (so no rank hangs); return messages."""
    import torch.distributed as dist

    cases = {
        "noncontiguous": lambda: C.ring_all_reduce(torch.ones(4, 4).t()),
        "unknown op": lambda: C.ring_all_reduce(torch.ones(4), op="max"),
        "avg int": lambda: C.ring_all_reduce(torch.ones(4, dtype=torch.int64), op="avg"),
        "not a tensor": lambda: C.ring_all_reduce([1.0, 2.0]),
        "naive root": lambda: C.naive_all_reduce(torch.ones(4), root=world_size),
        "rs list length": lambda: C.ring_reduce_scatter(torch.empty(2), [torch.ones(2)] * (world_size + 1)),
        "rs output size": lambda: C.ring_reduce_scatter(torch.empty(3), torch.ones(2 * world_size)),
        "ag output size": lambda: C.ring_all_gather(torch.empty(world_size), torch.ones(2)),
        "ag dtype": lambda: C.ring_all_gather([torch.empty(2)] * world_size, torch.ones(2, dtype=torch.float64)),
        "a2a list length": lambda: C.all_to_all([torch.empty(1)] * (world_size - 1), [torch.ones(1)] * world_size),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    dist.barrier()  # everyone got here: nothing was left half-sent
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("impl,pipeline_bytes", [("ring", 0), ("ring", 64), ("ring", 1 << 20),
                                                 ("ring-paired", 0), ("ring-paired", 64),
                                                 ("plain", 0), ("naive", 0)])
def test_all_reduce_matches_torch(cluster, impl, pipeline_bytes):
    results = cluster.run(all_reduce_worker, impl, pipeline_bytes)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    assert all(n > 0 for _, n in results)  # every rank took part in at least one group


def test_all_reduce_in_place_any_shape(cluster):
    for same_shape, same_storage, equal in cluster.run(shapes_worker):
        assert same_shape and same_storage and equal


@pytest.mark.parametrize("paired", [False, True], ids=["gloo", "nccl-path"])
def test_reduce_scatter_matches_torch(cluster, paired):
    fails = cluster.run(reduce_scatter_worker, paired)
    assert not any(fails), fails


@pytest.mark.parametrize("paired", [False, True], ids=["gloo", "nccl-path"])
def test_all_gather_matches_torch(cluster, paired):
    fails = cluster.run(all_gather_worker, paired)
    assert not any(fails), fails


@pytest.mark.parametrize("paired", [False, True], ids=["gloo", "nccl-path"])
def test_all_to_all_matches_torch(cluster, paired):
    fails = cluster.run(all_to_all_worker, paired)
    assert not any(fails), fails


@pytest.mark.parametrize("n,dtype", [(1000, torch.float32), (1003, torch.bfloat16)])
def test_bytes_are_measured(cluster, n, dtype):
    res = cluster.run(bytes_worker, n, dtype)
    item = torch.tensor([], dtype=dtype).element_size()
    bounds = C.chunk_bounds(n, WORLD)
    for r, out in enumerate(res):
        ring = out["ring"]
        # reduce-scatter sends every chunk but r, all-gather every chunk but r+1
        own, nxt = bounds[r], bounds[(r + 1) % WORLD]
        expect = (2 * n - (own[1] - own[0]) - (nxt[1] - nxt[0])) * item
        assert ring["bytes_sent"] == expect and ring["n_comm"] == 2 * (WORLD - 1), (r, ring, expect)
        assert sum(1 for s in out["ring_names"] if "reduce-scatter" in s) == WORLD - 1
        if n % WORLD == 0:
            assert ring["bytes_sent"] == C.ring_all_reduce_bytes(n * item, WORLD)
        naive = out["naive"]
        want = C.naive_all_reduce_bytes(n * item, WORLD)["root" if r == 1 else "other"]
        assert naive["bytes_sent"] == want and naive["bytes_recv"] == want, (r, naive)
    assert sum(o["ring"]["bytes_sent"] for o in res) == sum(o["ring"]["bytes_recv"] for o in res)


def test_step_hook_sees_reduce_scatter_then_all_gather(cluster):
    n = 10
    res = cluster.run(hook_worker, n)
    total = sum(torch.arange(n, dtype=torch.float64) * 10 ** r for r in range(WORLD))
    for r, (steps, after_rs, final) in enumerate(res):
        assert steps == [("reduce-scatter", s) for s in range(WORLD - 1)] + \
                        [("all-gather", s) for s in range(WORLD - 1)]
        lo, hi = C.chunk_bounds(n, WORLD)[r]
        assert torch.equal(after_rs[lo:hi], total[lo:hi]), "after reduce-scatter rank r owns chunk r"
        assert torch.equal(final, total)


def test_bad_inputs_raise_clear_errors(cluster):
    for out in cluster.run(bad_input_worker):
        missing = [k for k, v in out.items() if v is None]
        assert not missing, f"no error for: {missing}"
        assert "contiguous" in out["noncontiguous"]
        assert "'sum' or 'avg'" in out["unknown op"]
        assert "world_size" in out["rs list length"]
        assert "floating-point" in out["avg int"]


def test_no_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not initialised"):
        C.ring_all_reduce(torch.ones(3))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 10, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_bounds_are_tensor_split(n, world):
    want = [(int(c[0]), int(c[-1]) + 1) if c.numel() else None
            for c in torch.tensor_split(torch.arange(n), world)]
    got = C.chunk_bounds(n, world)
    assert [len(range(a, b)) for a, b in got] == [c.numel() for c in torch.tensor_split(torch.arange(n), world)]
    assert all(w is None or w == g for w, g in zip(want, got))
    assert got[0][0] == 0 and got[-1][1] == n


def test_rank_error_surfaces_from_a_bad_call(cluster):
    def bad(rank, world_size):
        C.ring_all_reduce(torch.ones(2, 2).t())

    with pytest.raises(RankError, match="contiguous"):
        cluster.run(bad)


class CountingTransport:
    """torch.distributed's isend/irecv, counting the messages and bytes that pass through it."""

    def __init__(self):
        self.sent, self.received, self.bytes_sent = 0, 0, 0

    def isend(self, tensor, dst, group=None, tag=0):
        import torch.distributed as dist
        self.sent += 1
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src, group=None, tag=0):
        import torch.distributed as dist
        self.received += 1
        return dist.irecv(tensor, src, group=group, tag=tag)


def transport_worker(rank, world_size, n):
    """Every collective's messages go through the transport passed to it, and only through it."""
    import torch.distributed as dist

    out = {}
    calls = {
        "plain": lambda t, x: C.plain_ring_all_reduce(x, transport=t),
        "ring": lambda t, x: C.ring_all_reduce(x, transport=t),
        "naive": lambda t, x: C.naive_all_reduce(x, transport=t),
        "reduce_scatter": lambda t, x: C.ring_reduce_scatter(torch.empty(n // world_size, dtype=x.dtype), x, transport=t),
        "all_gather": lambda t, x: C.ring_all_gather(torch.empty(n * world_size, dtype=x.dtype), x, transport=t),
        "all_to_all": lambda t, x: C.all_to_all(list(torch.empty(n, dtype=x.dtype).chunk(world_size)),
                                                list(x.chunk(world_size)), transport=t),
    }
    for name, call in calls.items():
        t = CountingTransport()
        x = _data(rank, n, torch.float64, integer=True)
        y = call(t, x.clone())
        out[name] = (t.sent, t.received, t.bytes_sent)
        if name in ("plain", "ring", "naive"):
            ref = x.clone()
            dist.all_reduce(ref)
            out[name] += (torch.equal(y, ref),)
    try:
        C.ring_all_reduce(torch.ones(4), transport=object())
        out["bad"] = None
    except TypeError as e:
        out["bad"] = str(e)
    return out


def test_collectives_send_through_the_given_transport(cluster):
    n = 8 * WORLD
    res = cluster.run(transport_worker, n)
    for r, out in enumerate(res):
        for name in ("plain", "ring"):
            sent, recv, nbytes, equal = out[name]
            assert equal, f"rank {r}: {name} with a transport differs from dist.all_reduce"
            assert sent == recv == 2 * (WORLD - 1) and nbytes == C.ring_all_reduce_bytes(8 * n, WORLD), out[name]
        sent, recv, nbytes, equal = out["naive"]
        assert equal and (sent, recv) == ((WORLD - 1, WORLD - 1) if r == 0 else (1, 1)), out["naive"]
        assert out["reduce_scatter"][:2] == (WORLD - 1, WORLD - 1)
        assert out["all_gather"][:2] == (WORLD - 1, WORLD - 1)
        assert out["all_to_all"][:2] == (WORLD - 1, WORLD - 1)
        assert out["bad"] and "isend" in out["bad"], out["bad"]
