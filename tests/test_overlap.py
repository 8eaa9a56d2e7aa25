"""course_lib.overlap (notebook 16): decomposed collective matmuls equal the plain layers and the single
process, send what the formula says, and overlap on an emulated link; the MoE micro-batch overlap; the
timeline arithmetic; the planner's overlap model; the GPU probe's error path."""

from __future__ import annotations

import time

import pytest
import torch

from course_lib import overlap as O
from course_lib import planner
from course_lib.launch import Cluster


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4) as c:
        yield c


def _group(rank, world_size, layout):
    import torch.distributed as dist
    made = [None if g is None else dist.new_group(g) for g in layout]   # every rank creates every group
    i = next(i for i, g in enumerate(layout) if g is None or rank in g)
    return made[i], layout[i] or list(range(world_size))


def _layers(rank, world_size, layout, paired):
    """Every layer of the module on this rank's group: max |error| vs one process, and the p2p sent."""
    import torch
    from course_lib import collectives
    from course_lib import overlap as O
    from course_lib.grading.guards import record_p2p
    group, members = _group(rank, world_size, layout)
    t, me = len(members), members.index(rank)
    transport = collectives.PairedP2P() if paired else None
    torch.manual_seed(0)
    rows, h, f = 3, 5, 2                               # n = 3t rows, h features, f columns per rank
    X, W = torch.randn(rows * t, h), torch.randn(h, f * t)
    x, w = X[me * rows:(me + 1) * rows], W[:, me * f:(me + 1) * f]
    with record_p2p() as rec:
        ag = O.all_gather_matmul(x, w, group, transport=transport)
    out = {"ag": (ag - X @ w).abs().max().item(), "ag_shape": tuple(ag.shape),
           "ag_sends": [(m.peer, m.nbytes) for m in rec.messages if m.kind == "send"],
           "ag_plain": (O.all_gather_then_matmul(x, w, group) - X @ w).abs().max().item()}
    X2, W2 = torch.randn(rows * t, f * t), torch.randn(f * t, h)
    x2, w2 = X2[:, me * f:(me + 1) * f], W2[me * f:(me + 1) * f]
    want = (X2 @ W2)[me * rows:(me + 1) * rows]
    with record_p2p() as rec:
        rs = O.matmul_reduce_scatter(x2, w2, group, transport=transport)
    out.update(rs=(rs - want).abs().max().item(), rs_plain=(O.matmul_then_reduce_scatter(x2, w2, group) - want).abs().max().item(),
               rs_sends=[(m.peer, m.nbytes) for m in rec.messages if m.kind == "send"])
    # the toy expert-parallel layer: overlapped == sequential == one process
    xs = [torch.randn(2 * t, h) for _ in range(2)]
    Wp, We = torch.randn(h, h), torch.randn(t, h, h)               # We[j]: the expert of group rank j
    seq = O.expert_parallel_microbatches(xs, Wp, We[me], group, overlap=False, transport=transport)
    ovl = O.expert_parallel_microbatches(xs, Wp, We[me], group, overlap=True, transport=transport)
    # rank me's output block j = (x_me @ Wp)[block j] @ We[j]
    ref = [torch.cat([(x @ Wp).chunk(t)[j] @ We[j] for j in range(t)]) for x in xs]
    out["moe"] = max(max((a - b).abs().max().item(), (c - b).abs().max().item())
                     for a, c, b in zip(seq, ovl, ref))
    return dict(out, t=t, me=me)


@pytest.mark.parametrize("layout,paired", [([None], False), ([[1, 3], [0, 2]], False), ([None], True)])
def test_decomposed_layers_equal_the_plain_ones_and_send_t_minus_1_chunks(cluster, layout, paired):
    for d in cluster.run(_layers, layout, paired):
        t, me = d["t"], d["me"]
        assert d["ag"] < 1e-5 and d["ag_plain"] < 1e-5 and d["ag_shape"] == (3 * t, 2), d
        assert d["rs"] < 1e-5 and d["rs_plain"] < 1e-5, d
        right = (me + 1) % t
        assert d["ag_sends"] == [(right, 3 * 5 * 4)] * (t - 1), d["ag_sends"]      # n/t x h floats, t - 1 times
        assert d["rs_sends"] == [(right, 3 * 5 * 4)] * (t - 1), d["rs_sends"]      # n/t x h partial sums
        assert d["moe"] < 1e-4, d


def _timed(rank, world_size, link_bw, seconds):
    import torch
    import torch.distributed as dist
    from course_lib import overlap as O, trace
    from course_lib.netem import AsyncPacedTransport, Link
    tr, mm = AsyncPacedTransport(Link(link_bw)), O.PacedMatmul(seconds / 32, per_row=True)
    x, w = torch.randn(8, 32), torch.randn(32, 8)
    out = {}
    x2, w2 = torch.randn(32, 8), torch.randn(8, 32)        # chunks of 8 rows: partial sums of 8 x 32 floats
    for fn, a, b in ((O.all_gather_then_matmul, x, w), (O.all_gather_matmul, x, w),
                     (O.matmul_then_reduce_scatter, x2, w2), (O.matmul_reduce_scatter, x2, w2)):
        dist.barrier()
        with trace.Recorder() as rec:
            fn(a, b, transport=tr, mm=mm)
        out[fn.__name__] = O.overlap_stats(rec.events)
    xs, wp, we = [torch.randn(8, 32) for _ in range(2)], torch.randn(32, 32), torch.randn(32, 32)
    for overlap in (False, True):                            # the MoE layer: all-to-alls of 3 x 2 x 32 floats
        dist.barrier()
        with trace.Recorder() as rec:
            O.expert_parallel_microbatches(xs, wp, we, overlap=overlap, transport=tr, mm=O.PacedMatmul(seconds / 4))
        out[f"moe overlap={overlap}"] = O.overlap_stats(rec.events)
    return out


def test_the_collective_matmul_hides_the_emulated_link(cluster):
    # a hop (8 x 32 floats) takes 20 ms on the link, a chunk's product 25 ms: the plain layer waits for
    # 3 hops, the decomposed one for almost none (emulated link and compute, so the cores do not matter)
    # the same for matmul + reduce-scatter (its partial sums travel while the next chunk multiplies) and for
    # the MoE layer's all-to-alls behind the other micro-batch (a layer that waits for each hop fails here)
    for d in cluster.run(_timed, 1024 / 0.020, 0.100):
        for plain_name, ours_name in (("all_gather_then_matmul", "all_gather_matmul"),
                                      ("matmul_then_reduce_scatter", "matmul_reduce_scatter"),
                                      ("moe overlap=False", "moe overlap=True")):
            plain, ours = d[plain_name], d[ours_name]
            assert plain["exposed"] > 0.030, (plain_name, plain)
            assert ours["exposed"] < 0.6 * plain["exposed"] and ours["hidden"] > 0.02, (ours_name, plain, ours)


def test_overlap_stats_counts_hidden_and_exposed_time():
    ev = [dict(kind="compute", start=0.0, end=2.0), dict(kind="compute", start=1.0, end=3.0),
          dict(kind="comm", start=2.5, end=4.0), dict(kind="comm", start=5.0, end=6.0)]
    s = O.overlap_stats(ev)
    assert s["compute"] == pytest.approx(3.0) and s["comm"] == pytest.approx(2.5)
    assert s["hidden"] == pytest.approx(0.5) and s["exposed"] == pytest.approx(2.0)
    assert s["span"] == pytest.approx(6.0) and s["hidden_fraction"] == pytest.approx(0.2)
    pieces = [(e["kind"], e["start"], e["end"]) for e in O.split_comm(ev)]
    assert pieces == [("hidden comm", 2.5, 3.0), ("exposed comm", 3.0, 4.0), ("exposed comm", 5.0, 6.0)]
    with pytest.raises(ValueError, match="no compute or comm"):
        O.overlap_stats([])


def test_overlapped_step_time_builds_on_the_planners_breakdown():
    lay = planner.Layout(dp=4, tp=2, pp=2, micro_batch=1, m=4)
    br = {"compute": 4.0, "tp": 2.0, "pp": 0.3, "bubble": 1.5, "dp": 1.0}
    br["step"] = sum(br.values())
    none = O.overlapped_step_time(br, lay, hide=())
    assert none["step"] == pytest.approx(br["step"]) and none["hidden"] == pytest.approx(0.0)
    both = O.overlapped_step_time(br, lay)
    # slots: max(1.0, 0.5) = 1.0 -> 4 + bubble 1; dp 1.0 - 2/3 of a 1 s backward exposed
    assert both["step"] == pytest.approx(4.0 + 1.0 + 0.3 + 1 / 3)
    assert both["hidden"] == pytest.approx(br["step"] - both["step"])
    with pytest.raises(ValueError, match="hide may name"):
        O.overlapped_step_time(br, lay, hide=("pp",))
    with pytest.raises(ValueError, match="buckets must be an int >= 1"):
        O.overlapped_step_time(br, lay, buckets=0)
    with pytest.raises(ValueError, match="bucket_latency is seconds"):
        O.overlapped_step_time(br, lay, buckets=2, bucket_latency=-1.0)


def test_overlap_keeps_the_context_parallel_ring_exposed():
    """A layout with cp > 1: hiding nothing gives the planner's step back, cp included (in its own term and
    in every bubble slot); hiding tp and dp never touches the cp time."""
    gpt3, h100 = planner.GPT3_175B, planner.h100_cluster(16)
    plans = [l for l in planner.plan_layouts(gpt3, h100, cp=(1, 2)) if l.cp == 2 and l.pp > 1]
    assert plans
    for lay in plans[:5]:
        br = lay.time
        assert br["cp"] > 0
        none = O.overlapped_step_time(br, lay, hide=())
        assert none["step"] == pytest.approx(br["step"]) and none["hidden"] == pytest.approx(0.0, abs=1e-12)
        assert none["cp"] == br["cp"] and none["bubble"] == pytest.approx(br["bubble"])
        both = O.overlapped_step_time(br, lay)
        assert both["cp"] == br["cp"] and both["step"] <= br["step"]


def test_overlap_of_dp_in_buckets_always_exposes_the_last_bucket():
    """k buckets, bucket j ready at j/k of the last micro-batch's backward B, sent one after another."""
    lay = planner.Layout(dp=4, tp=1, pp=1, micro_batch=1, m=1)
    br = {"compute": 6.0, "tp": 0.0, "pp": 0.0, "bubble": 0.0, "dp": 4.0}      # B = 2/3 of 6 s = 4 s
    br["step"] = sum(br.values())
    # 4 buckets of 1 s, ready at 1, 2, 3, 4 s: done at 2, 3, 4, 5 s -> 1 s exposed (the last bucket)
    assert O.overlapped_step_time(br, lay, hide=("dp",), buckets=4)["dp"] == pytest.approx(1.0)
    # one bucket is ready only at the end: nothing hidden
    assert O.overlapped_step_time(br, lay, hide=("dp",), buckets=1)["dp"] == pytest.approx(4.0)
    # many small buckets approach the streaming bound max(0, dp - B) ...
    assert O.overlapped_step_time(br, lay, hide=("dp",), buckets=1000)["dp"] == pytest.approx(0.0, abs=0.01)
    assert O.overlapped_step_time(br, lay, hide=("dp",))["dp"] == pytest.approx(0.0)
    # ... unless every all-reduce pays a latency: 4 buckets of (4 - 0.4) / 4 + 0.4 = 1.3 s, ready at 1..4 s
    assert O.overlapped_step_time(br, lay, hide=("dp",), buckets=4, bucket_latency=0.4)["dp"] == pytest.approx(
        1 + 4 * 1.3 - 4)
    slow = dict(br, dp=12.0, step=18.0)                                         # comm outlasts the backward
    assert O.overlapped_step_time(slow, lay, hide=("dp",), buckets=4)["dp"] == pytest.approx(1 + 12 - 4)
    with pytest.raises(ValueError, match="lacks"):
        O.overlapped_step_time({"compute": 1.0}, lay)


def test_the_bad_inputs_say_what_to_fix():
    with pytest.raises(ValueError, match="2-D"):
        O.all_gather_matmul(torch.ones(3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="seconds"):
        O.PacedMatmul(-1)
    mm = O.PacedMatmul(0.01)
    t0 = time.perf_counter()
    assert torch.equal(mm(torch.eye(2), torch.ones(2, 2)), torch.ones(2, 2))
    assert time.perf_counter() - t0 >= 0.01


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the message on a machine without a GPU")
def test_the_gpu_probe_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        O.gpu_overlap_slowdown(n=64, copy_bytes=1 << 10)
    with pytest.raises(ValueError, match="repeats"):
        O.gpu_overlap_slowdown(repeats=0)
