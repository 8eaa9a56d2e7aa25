"""Hybrid parallelism (notebook 09): the mesh arithmetic and its process groups against torch's
``init_device_mesh`` (course_lib.mesh), DP x PP x TP training of the tiny GPT against one process
(course_lib.hybrid_gpt), the bytes each axis carries against the planner's formulas, the planner itself
and its calibration (course_lib.planner), and the torchrun demo (course_lib.demos.hybrid).

The arithmetic and the planner need no processes. One warm 4-rank cluster runs every 4-rank layout;
one 8-rank cluster runs the 2 x 2 x 2 mesh once (8 ranks on 2 cores are slow, so the model is tiny).
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib import hybrid_gpt, planner
from course_lib import mesh as M
from course_lib.launch import Cluster, RankError

TORCHRUN = Path(sys.executable).with_name("torchrun")


# --------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2), (3, 1, 2), (2, 3, 4), (1, 1, 1), (5,), (2, 6)])
def test_coordinates_and_groups_are_row_major_like_torch(shape):
    grid = torch.arange(math.prod(shape)).reshape(shape)   # what init_device_mesh lays out
    for r in range(math.prod(shape)):
        assert M.mesh_coords(r, shape) == tuple(int(i) for i in (grid == r).nonzero()[0])
    for axis in range(len(shape)):
        expect = sorted(sorted(v.tolist()) for v in grid.movedim(axis, -1).reshape(-1, shape[axis]))
        got = M.axis_groups(shape, axis)
        assert sorted(got) == expect
        assert sorted(itertools.chain(*got)) == list(range(math.prod(shape)))  # a partition


def test_mesh_object():
    m = M.Mesh({"dp": 2, "pp": 2, "tp": 2})
    assert m.coords(5) == {"dp": 1, "pp": 0, "tp": 1} and m.rank_of(dp=1, pp=0, tp=1) == 5
    assert m.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.group_of(6, "pp") == [4, 6] and m.degree("tp") == 2


@pytest.mark.parametrize("call, words", [
    (lambda: M.Mesh((2, 2, 2), world_size=4), "has 8 ranks but the world has 4: choose degrees whose product is 4"),
    (lambda: M.Mesh((2, 0, 2)), "pp degree must be an int >= 1"),
    (lambda: M.Mesh((2, 2)), "has 2 axes but names"),
    (lambda: M.Mesh((2, 2, 2), names=("dp", "dp", "tp")), "distinct"),
    (lambda: M.Mesh((2, 2, 2)).groups("ep"), "no axis 'ep'"),
    (lambda: M.mesh_coords(8, (2, 2, 2)), "rank must be an int in [0, 8)"),
    (lambda: M.Mesh((2, 2, 2)).rank_of(dp=0, pp=0), "give a coordinate for every axis"),
])
def test_bad_meshes_say_what_to_change(call, words):
    with pytest.raises(M.MeshError, match=None) as e:
        call()
    assert words in str(e.value)


def test_each_module_holds_only_its_own_part():
    """mesh: the arithmetic and CommMeter; hybrid_gpt: the model and its run; planner: the planner and its
    calibration; demos.hybrid: only the command line. No name is importable from a module it left."""
    from course_lib.demos import hybrid as demo
    for name in hybrid_gpt.__all__ + planner.__all__:
        assert not hasattr(M, name), f"course_lib.mesh.{name}"
    for name in planner.__all__:
        assert not hasattr(hybrid_gpt, name), f"course_lib.hybrid_gpt.{name}"
    for name in hybrid_gpt.__all__:
        assert not hasattr(demo, name), f"course_lib.demos.hybrid.{name}"


# --------------------------------------------------------------------------- the planner
def test_enumerated_layouts_are_exactly_the_valid_ones():
    spec = planner.ModelSpec("t", n_layer=12, hidden=768, heads=12, seq=1024, vocab=50257, global_batch=48)
    got = {(l.dp, l.tp, l.pp, l.micro_batch) for l in planner.enumerate_layouts(spec, 24)}
    brute = set()
    for dp, tp, pp in itertools.product(range(1, 25), repeat=3):
        if dp * tp * pp != 24 or 12 % tp or 768 % tp or 12 % pp or 48 % dp:
            continue
        for mb in range(1, 48 // dp + 1):
            if (48 // dp) % mb == 0:
                brute.add((dp, tp, pp, mb))
    assert got == brute and len(got) > 20
    for l in planner.enumerate_layouts(spec, 24):
        assert l.m * l.micro_batch * l.dp == 48


def test_layout_memory_uses_the_notebook_01_and_06_formulas():
    from course_lib.estimate import activation_bytes_per_layer, zero_model_state_bytes
    lay = planner.Layout(dp=4, tp=8, pp=4, micro_batch=1, m=16)
    mem = planner.layout_memory(planner.GPT3_175B, lay, zero_stage=1)
    states = zero_model_state_bytes(planner.GPT3_175B.n_params / 32, 1, 4)
    act = 96 / 4 * 4 * activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True,
                                                   recompute="selective")
    assert mem["optimizer_states"] == pytest.approx(states["optimizer_states"])
    assert mem["activations"] == pytest.approx(act)
    # Megatron's distributed optimizer: fp32 main gradients, 6 + 12/d bytes per parameter
    psi = planner.GPT3_175B.n_params / 32
    assert mem["parameters"] + mem["gradients"] + mem["optimizer_states"] == pytest.approx((6 + 12 / 4) * psi)
    assert mem["total"] == pytest.approx((6 + 12 / 4) * psi + act)
    paper = planner.layout_memory(planner.GPT3_175B, lay, zero_stage=1, grad_bytes=2)        # ZeRO's 2 + 2 + 12/d
    assert paper["total"] == pytest.approx(sum(states.values()) + act) == pytest.approx((4 + 12 / 4) * psi + act)
    with pytest.raises(ValueError, match="grad_bytes is 2"):
        planner.layout_memory(planner.GPT3_175B, lay, grad_bytes=3)
    # fewer micro-batches than stages: only m are in flight
    few = planner.layout_memory(planner.GPT3_175B, planner.Layout(dp=4, tp=8, pp=4, micro_batch=1, m=2))
    assert few["activations"] == pytest.approx(act / 2)


def test_gpt3_on_1024_a100s_rediscovers_tp_in_node_pp_and_dp_across():
    plans = planner.plan_layouts(planner.GPT3_175B, planner.dgx_a100_cluster(128))
    best = plans[0]
    assert best.fits and best.tp == 8 and best.pp > 1 and best.dp > 1
    assert best.axis_links == {"tp": "nvlink", "pp": "network", "dp": "network"}
    assert best.time["step"] == pytest.approx(sum(v for k, v in best.time.items() if k != "step"))
    # the same pp and micro-batch with tp = 16 crosses the node: slower
    by = {(l.dp, l.tp, l.pp, l.micro_batch): l for l in plans}
    over = by[(best.dp // 2, 16, best.pp, best.micro_batch)]
    assert over.axis_links["tp"] == "network" and over.time["step"] > 1.2 * best.time["step"]
    # no layout without model parallelism fits 80 GB
    assert not any(l.fits for l in plans if l.tp * l.pp == 1)
    days = best.time["step"] * 300e9 / (1536 * 2048) / 86400
    assert 20 < days < 40   # Narayanan et al. 2021 estimate 34 days at 140 TFLOP/s per GPU


def test_planner_bad_input():
    with pytest.raises(ValueError, match="n_layer must be a positive int"):
        planner.ModelSpec("x", 0, 64, 2, 16, 64, 8)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        planner.enumerate_layouts(planner.GPT3_175B, 0)
    with pytest.raises(ValueError, match="stage must be in"):
        planner.layout_traffic(planner.GPT3_175B, planner.Layout(1, 1, 2, 1, 4), stage=2)


def test_planner_learns_context_parallelism_opt_in():
    """cp is opt-in (default: the same layouts and numbers as before), divides the activations, adds
    the ring's bytes; at 128k tokens nothing fits Llama 3 405B on 16,384 H100s without it."""
    from course_lib.context_parallel import ring_attention_bytes
    from course_lib.estimate import activation_bytes_per_layer
    gpt3 = planner.GPT3_175B
    default, with_cp2 = planner.enumerate_layouts(gpt3, 64), planner.enumerate_layouts(gpt3, 64, cp=(1, 2))
    assert default and all(l.cp == 1 for l in default)
    assert len(with_cp2) > len(default) and any(l.cp == 2 for l in with_cp2)
    assert [str(l) for l in with_cp2 if l.cp == 1] == [str(l) for l in default]
    base = planner.Layout(dp=4, tp=8, pp=4, micro_batch=1, m=16)
    with_cp = planner.Layout(dp=2, tp=8, pp=4, micro_batch=1, m=32, cp=2)
    a, b = planner.layout_memory(gpt3, base), planner.layout_memory(gpt3, with_cp)
    act = 96 / 4 * 4 * activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=True,
                                                   recompute="selective")
    assert b["activations"] == pytest.approx(act / 2) and a["activations"] == pytest.approx(act)
    assert b["optimizer_states"] == pytest.approx(a["optimizer_states"])       # sharded over dp * cp = 4
    assert planner.layout_traffic(gpt3, base)["cp"] == 0 and planner.layout_step_time(
        gpt3, planner.dgx_a100_cluster(16), base)["cp"] == 0
    ring = ring_attention_bytes(1, 96 // 8, 2048, 128, 2, bytes_per_value=2)
    assert planner.layout_traffic(gpt3, with_cp)["cp"] == pytest.approx(32 * 24 * (ring["forward"] + ring["backward"]))
    t = planner.layout_step_time(gpt3, planner.dgx_a100_cluster(16), with_cp)
    assert t["cp"] > 0 and t["step"] == pytest.approx(sum(v for k, v in t.items() if k != "step"))
    with pytest.raises(ValueError, match="kv_heads must be 0"):
        planner.ModelSpec("x", 2, 64, 4, 16, 64, 8, kv_heads=3)
    with pytest.raises(ValueError, match="cp is a list of context-parallel degrees"):
        planner.enumerate_layouts(gpt3, 64, cp=(0,))
    llama, h100 = planner.LLAMA3_405B_128K, planner.h100_cluster(2048)
    assert not any(l.fits for l in planner.plan_layouts(llama, h100, micro_batches=(1,)))
    best = planner.plan_layouts(llama, h100, micro_batches=(1,), cp=(1, 2, 4, 8, 16, 32, 64))[0]
    assert best.fits and best.cp > 1 and best.tp == 8 and best.axis_links["cp"] == "network"


# --------------------------------------------------------------------------- real processes
def _groups_vs_device_mesh(rank, world_size, shape):
    pm = M.init_process_mesh(shape)
    ours = {a: pm.ranks(a) for a in M.AXES}
    import torch.distributed as dist
    ours_pg = {a: sorted(dist.get_process_group_ranks(pm.group(a))) for a in M.AXES}
    return ours, ours_pg, M.device_mesh_ranks(shape)


def _hybrid_case(rank, world_size, shape, steps, builtin=False, names=M.AXES):
    """Gradient shards after one step vs the single-process gradient; the loss curve; bytes per axis.
    ``names=M.CP_AXES``: a (dp, pp, cp, tp) shape."""
    import copy
    import torch.nn.functional as F
    from course_lib.hybrid_gpt import make_batches, make_model, train

    pm = M.init_process_mesh(shape, names)
    model = make_model()
    h = hybrid_gpt.HybridGPT(model, pm, builtin=builtin)
    (x, y), = make_batches(1)
    with M.CommMeter(h.comm_groups()) as meter:
        h.forward_backward(x, y, 4 if shape[0] < 8 and names == M.AXES else 2)
    full = copy.deepcopy(model)
    F.cross_entropy(full(x).flatten(0, 1), y.flatten()).backward()
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(grads.parameters(), full.parameters()):
            p.copy_(q.grad)
    err = max(float((p.grad - t).abs().max()) for p, t in zip(h.parameters(), h.local_tensors(grads)))
    if names == M.CP_AXES:
        dp, pp, cp, tp = shape
        out = train(rank, world_size, dp, pp, tp, steps, cp=cp)
    else:
        out = train(rank, world_size, *shape, steps)
    return {"err": err, "bytes": meter.totals(), "train": out}


@pytest.fixture(scope="module")
def cluster4():
    with Cluster(4, timeout=120) as c:
        yield c


@pytest.mark.parametrize("shape", [(1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1), (1, 4, 1)])
def test_process_groups_equal_init_device_mesh(cluster4, shape):
    for ours, ours_pg, theirs in cluster4.run(_groups_vs_device_mesh, shape):
        assert ours == ours_pg == theirs


def test_mesh_that_does_not_fit_the_world_fails_on_every_rank(cluster4):
    with pytest.raises(RankError) as e:
        cluster4.run(_groups_vs_device_mesh, (2, 2, 2))
    assert e.value.ranks == [0, 1, 2, 3]
    assert "has 8 ranks but the world has 4: choose degrees whose product is 4" in str(e.value)


def _expected_bytes(shape, micro):
    from course_lib.hybrid_gpt import DEFAULTS, make_model
    dp, pp, tp = shape
    n = sum(p.numel() for p in make_model().parameters())
    spec = planner.ModelSpec("tiny", DEFAULTS["layers"], DEFAULTS["hidden"], DEFAULTS["heads"], DEFAULTS["block"],
                       DEFAULTS["vocab"], DEFAULTS["batch"], n_params=n)
    lay = planner.Layout(dp, tp, pp, DEFAULTS["batch"] // dp // micro, micro)
    pred = planner.total_traffic(spec, lay, bytes_per_value=8, header_bytes=72)
    counts = hybrid_gpt.hybrid_param_count(DEFAULTS["layers"], DEFAULTS["hidden"], DEFAULTS["vocab"], DEFAULTS["block"], tp, pp)
    pred["dp"] *= counts["total"] / n   # the replicated copies travel too
    return pred


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 4)])
def test_hybrid_training_equals_one_process(cluster4, shape):
    from course_lib.hybrid_gpt import replica_losses, train_reference
    if shape[2] == 4:   # 2 heads: tp = 4 must be refused with what to change
        with pytest.raises(RankError, match=r"tp=4 must divide the number of heads \(2\)"):
            cluster4.run(_hybrid_case, shape, 3)
        return
    res = cluster4.run(_hybrid_case, shape, 3)
    assert max(r["err"] for r in res) < 1e-12
    losses = replica_losses([r["train"] for r in res])
    assert losses == pytest.approx(train_reference(3), abs=1e-10)
    pred = _expected_bytes(shape, 4)
    for axis in ("tp", "pp", "dp", "tied"):
        measured = sum(r["bytes"].get(axis, 0) for r in res)
        assert measured == pytest.approx(pred[axis], rel=1e-12), axis


def test_builtin_collectives_give_the_same_gradients(cluster4):
    res = cluster4.run(_hybrid_case, (2, 2, 1), 1, True)
    assert max(r["err"] for r in res) < 1e-12


def _overlap_case(rank, world_size, shape, micro):
    """Gradients with ``overlap_dp`` vs without (same model, same batch), and when each bucket was sent."""
    import torch.distributed as dist
    from course_lib.hybrid_gpt import make_batches, make_model

    class Spy(hybrid_gpt.HybridGPT):
        def _launch(self, i):
            launched.append((i, self._armed))      # armed = inside the pipeline's backward
            super()._launch(i)

    pm = M.init_process_mesh(shape)
    (x, y), = make_batches(1)
    grads = {}
    for overlap in (False, True):
        launched = []
        h = Spy(make_model(layers=4), pm, overlap_dp=overlap)
        h.forward_backward(x, y, micro)
        grads[overlap] = [p.grad.clone() for p in h.parameters()]
    err = max(float((a - b).abs().max()) for a, b in zip(grads[False], grads[True]))
    return {"err": err, "launched": launched, "buckets": len(h._buckets), "stage": h.stage,
            "bucket_sizes": [sum(p.numel() for p in b) for b in h._buckets], "dp_group": dist.get_world_size(h.grad_group)}


@pytest.mark.parametrize("shape, micro", [((4, 1, 1), 1), ((4, 1, 1), 4), ((2, 2, 1), 2), ((2, 1, 2), 2)])
def test_overlapped_gradient_all_reduce_equals_the_blocking_one(cluster4, shape, micro):
    """overlap_dp: one all-reduce per block, each launched from a gradient hook during the backward of
    the last micro-batch (in bucket order), and the same averaged gradients as one all-reduce after the
    pipeline. Launching a bucket before its last micro-batch would send a partial sum: the error test
    fails then."""
    res = cluster4.run(_overlap_case, shape, micro)
    assert max(r["err"] for r in res) < 1e-12
    for r in res:
        assert r["dp_group"] == shape[0]                          # the buckets go over the dp group
        assert r["buckets"] == 4 // shape[1]                     # one per block of the stage
        assert [i for i, _ in r["launched"]] == list(range(r["buckets"]))
        assert all(armed for _, armed in r["launched"])         # every bucket left during the backward
    one_stage = [r for r in res if shape[1] == 1][:1]
    for r in one_stage:                                          # the tied embedding joins block 0's bucket
        assert r["bucket_sizes"][-1] > r["bucket_sizes"][0]


def test_overlap_dp_must_be_a_bool():
    with pytest.raises(TypeError, match="overlap_dp must be True or False"):
        hybrid_gpt.HybridGPT.__init__(object.__new__(hybrid_gpt.HybridGPT), None, None, overlap_dp="yes")


@pytest.mark.parametrize("shape", [(2, 1, 2, 1), (1, 1, 2, 2)], ids=["dp2xcp2", "cp2xtp2"])
def test_context_parallel_training_equals_one_process(cluster4, shape):
    """Ring attention over the cp axis: gradients and the loss curve equal one process's, and the cp
    group carries exactly the planner's (context_parallel's) ring bytes."""
    from course_lib.hybrid_gpt import DEFAULTS, make_model, replica_losses, train_reference
    res = cluster4.run(_hybrid_case, shape, 3, names=M.CP_AXES)
    assert max(r["err"] for r in res) < 1e-12
    assert replica_losses([r["train"] for r in res]) == pytest.approx(train_reference(3), abs=1e-12)
    dp, pp, cp, tp = shape
    n = sum(p.numel() for p in make_model().parameters())
    spec = planner.ModelSpec("tiny", DEFAULTS["layers"], DEFAULTS["hidden"], DEFAULTS["heads"], DEFAULTS["block"],
                             DEFAULTS["vocab"], DEFAULTS["batch"], n_params=n)
    lay = planner.Layout(dp, tp, pp, DEFAULTS["batch"] // dp // 2, 2, cp=cp)
    assert sum(r["bytes"]["cp"] for r in res) == planner.total_traffic(spec, lay, bytes_per_value=8)["cp"] > 0
    assert all(r["bytes"]["dp_cp"] > 0 for r in res)


def _bad_hybrid(rank, world_size, what):
    from course_lib.hybrid_gpt import make_batches, make_model
    if what == "cp":                   # a 6-token sequence does not cut into the 2 cp = 4 zig-zag chunks
        pm = M.init_process_mesh((2, 1, 2, 1), M.CP_AXES)
    else:
        pm = M.init_process_mesh((1, 4, 1) if what == "stages" else (2, 1, 2))
    h = hybrid_gpt.HybridGPT(make_model(), pm)
    (x, y), = make_batches(1, batch=15 if what == "batch" else 16, block=6 if what == "cp" else 16)
    h.forward_backward(x, y, 3 if what == "micro" else 2)


@pytest.mark.parametrize("what, words", [
    ("stages", "pp=4 stages but the model has 2 blocks"),
    ("batch", "does not split into dp=2 equal shards"),
    ("micro", "3 micro-batches do not divide the batch of 8"),
    ("cp", "the sequence length s=6 does not split over N=2 ranks: the zig-zag layout cuts it into 2N = 4"),
])
def test_bad_hybrid_input_says_what_to_change(cluster4, what, words):
    with pytest.raises(RankError) as e:
        cluster4.run(_bad_hybrid, what)
    assert words in str(e.value)


def _calibrate(rank, world_size):
    alpha, bw = planner.measure_link(sizes=(64, 1 << 16), repeats=3)
    a = torch.randn(64, 64)
    rate = planner.measure_flops(lambda: a @ a, 2 * 64 ** 3, repeats=3)
    return alpha, bw, rate


def test_calibration_gives_positive_figures(cluster4):
    for alpha, bw, rate in cluster4.run(_calibrate):
        assert alpha >= 0 and bw > 0 and rate > 0


def test_2x2x2_mesh_on_8_ranks():
    from course_lib.hybrid_gpt import replica_losses, train_reference
    with Cluster(8, timeout=180) as c:
        groups = c.run(_groups_vs_device_mesh, (2, 2, 2))
        res = c.run(_hybrid_case, (2, 2, 2), 3)
    for ours, ours_pg, theirs in groups:
        assert ours == ours_pg == theirs
    assert max(r["err"] for r in res) < 1e-12
    assert replica_losses([r["train"] for r in res]) == pytest.approx(train_reference(3), abs=1e-10)
    pred = _expected_bytes((2, 2, 2), 4)
    for axis in ("tp", "pp", "dp", "tied"):
        assert sum(r["bytes"].get(axis, 0) for r in res) == pytest.approx(pred[axis], rel=1e-12), axis


def test_demo_under_torchrun_with_4_processes():
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun not found next to {sys.executable}")
    r = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=4", "-m", "course_lib.demos.hybrid",
                        "--tp", "2", "--pp", "2", "--steps", "3", "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "dp=1 pp=2 tp=2 on 4 processes (gloo" in r.stdout
    assert "max |loss difference|" in r.stdout and "(OK" in r.stdout, r.stdout
    assert len([l for l in r.stdout.splitlines() if l.startswith("step ")]) == 3


def test_demo_refuses_degrees_that_do_not_divide_the_world():
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun not found next to {sys.executable}")
    r = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "course_lib.demos.hybrid",
                        "--tp", "2", "--pp", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--tp 2 x --pp 2 must divide the 2 processes" in r.stdout + r.stderr


def test_plot_mesh_draws_every_rank_and_the_measured_bytes():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.viz import plot_mesh
    ax = plot_mesh(M.Mesh((2, 2, 2)), {"tp": 163840, "pp": 32840, "dp": 63872})
    texts = [t.get_text() for t in ax.texts]
    assert all(str(r) in texts for r in range(8))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(l.startswith("tp group") and "163.8 KB" in l for l in labels)
    assert any(l.startswith("dp group") and "63.9 KB" in l for l in labels)
    no_dp = plot_mesh(M.Mesh((1, 4, 2)))
    assert not any("dp group" in t.get_text() for t in no_dp.get_legend().get_texts())
    with pytest.raises(ValueError, match="plot_mesh draws meshes with axes"):
        plot_mesh(M.Mesh((2, 4), names=("dp", "tp")))
