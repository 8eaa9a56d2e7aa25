"""Tensor parallelism from scratch (course_lib.tensor_parallel) on one warm 4-rank gloo cluster.

Every layer is compared with the unsharded layer (outputs, input gradients, and each rank's gradient
shard against the matching slice of the full gradient) on 2 ranks (a subgroup) and 4 ranks, with the
course's ring and with the built-in collectives; the MLP and sequence-parallel layer norm with
DTensor's ``parallelize_module``; the collectives are counted with ``course_lib.trace``.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.launch import Cluster, RankError

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(WORLD, timeout=120) as c:
        yield c


def _group(world):
    import torch.distributed as dist
    return None if world == dist.get_world_size() else dist.new_group(list(range(world)))


def _block_case(rank, world_size, tp, sequence_parallel, builtin):
    """A models.Block vs its ParallelBlock; returns the largest errors (0 on ranks outside the group)."""
    import torch
    import torch.distributed as dist
    from course_lib import tensor_parallel as T, trace
    from course_lib.models import Block

    group = _group(tp)
    if rank >= tp:
        return None
    torch.manual_seed(0)
    block = Block(8, 4)
    x = torch.randn(2, 8, 8, requires_grad=True)
    ref = block(x)
    ref.pow(2).sum().backward()

    par = T.ParallelBlock.from_block(block, group, sequence_parallel=sequence_parallel, builtin=builtin)
    xp = x.detach().clone().requires_grad_(True)
    inp = T.scatter_to_sequence_parallel(xp, 1, group) if sequence_parallel else xp
    leaf = inp.detach().requires_grad_(True)         # the recorder sees the block's collectives only
    with trace.Recorder() as rec:
        out = par(leaf)
        out.pow(2).sum().backward()
    inp.backward(leaf.grad)                          # the input split's backward: an all-gather
    if sequence_parallel:
        T.all_reduce_sequence_parallel_grads(par, group)
        lo, hi = T.even_shard(8, rank, tp)
        ref_out = ref[:, lo:hi]
    else:
        ref_out = ref
    r = rank
    c = 8 // tp
    q_rows = torch.cat([torch.arange(j * 8 + r * c, j * 8 + (r + 1) * c) for j in range(3)])
    h = 32 // tp
    errs = {
        "out": (out - ref_out).abs().max().item(),
        "dx": (xp.grad - x.grad).abs().max().item(),
        "qkv.w": (par.attn.qkv.weight.grad - block.attn.qkv.weight.grad[q_rows]).abs().max().item(),
        "qkv.b": (par.attn.qkv.bias.grad - block.attn.qkv.bias.grad[q_rows]).abs().max().item(),
        "proj.w": (par.attn.proj.weight.grad - block.attn.proj.weight.grad[:, r * c:(r + 1) * c]).abs().max().item(),
        "proj.b": (par.attn.proj.bias.grad - block.attn.proj.bias.grad).abs().max().item(),
        "fc.w": (par.mlp.fc.weight.grad - block.fc.weight.grad[r * h:(r + 1) * h]).abs().max().item(),
        "fc_proj.w": (par.mlp.fc_proj.weight.grad - block.fc_proj.weight.grad[:, r * h:(r + 1) * h]).abs().max().item(),
        "ln1.w": (par.ln1.weight.grad - block.ln1.weight.grad).abs().max().item(),
        "ln2.b": (par.ln2.bias.grad - block.ln2.bias.grad).abs().max().item(),
    }
    assert {e["kind"] for e in rec.events} <= {"comm"}, "communication is of kind comm (course_lib.trace)"
    ops = {}                       # the collectives' spans ("all-reduce: g forward"), not the ring's transfers
    for e in rec.events:
        if ": " in e["name"]:
            op = e["name"].split(": ")[0]
            ops[op] = ops.get(op, 0) + 1
    sent = sum(e["bytes_sent"] for e in rec.events)
    return errs, ops, sent


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_parallel_block_equals_the_unsharded_block(cluster, tp, sequence_parallel):
    res = cluster.run(_block_case, tp, sequence_parallel, False)
    for rank, r in enumerate(res[:tp]):
        errs, ops, sent = r
        assert max(errs.values()) < 1e-5, f"rank {rank}: {errs}"
        # Ring traffic: 4 all-reduces (or 4 gather + 4 scatter) of b*s*h fp32 values, 2(t-1)/t each.
        n = 2 * 8 * 8 * 4
        if sequence_parallel:
            assert ops == {"all-gather": 4, "reduce-scatter": 4}, ops
        else:
            assert ops == {"all-reduce": 4}, ops
        assert sent == pytest.approx(4 * 2 * (tp - 1) / tp * n), (rank, sent)
    assert all(r is None for r in res[tp:])


def test_builtin_collectives_give_the_same_block(cluster):
    res = cluster.run(_block_case, 4, True, True)
    for errs, ops, sent in res:
        assert max(errs.values()) < 1e-5, errs
        assert sent == 0  # dist's collectives are not ours to count byte by byte; spans still are
        assert ops == {"all-gather": 4, "reduce-scatter": 4}


def _conjugates(rank, world_size):
    import torch
    from course_lib import tensor_parallel as T
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = T.copy_to_tensor_parallel(x)
    (y * (rank + 1)).sum().backward()
    f_out, f_grad = y.detach().clone(), x.grad.clone()
    x2 = torch.full((3,), float(rank + 1), requires_grad=True)
    z = T.reduce_from_tensor_parallel(x2)
    (z * (rank + 1)).sum().backward()
    return f_out.tolist(), f_grad.tolist(), z.detach().tolist(), x2.grad.tolist()


def test_conjugate_operators(cluster):
    """f: identity forward, gradient summed over ranks; g: sum forward, gradient passed through."""
    res = cluster.run(_conjugates)
    for rank, (f_out, f_grad, g_out, g_grad) in enumerate(res):
        assert f_out == [rank + 1.0] * 3
        assert f_grad == [10.0] * 3            # 1 + 2 + 3 + 4
        assert g_out == [10.0] * 3
        assert g_grad == [rank + 1.0] * 3


def _vocab_case(rank, world_size):
    import torch
    import torch.nn.functional as F
    from course_lib import tensor_parallel as T
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 5)
    ids = torch.randint(0, 12, (3, 4))
    ref = emb(ids)
    ref.sum().backward()
    pe = T.VocabParallelEmbedding.from_embedding(emb)
    out = pe(ids)
    out.sum().backward()
    lo, hi = T.even_shard(12, rank, world_size)
    logits = torch.randn(3, 4, 12, requires_grad=True)
    tgt = torch.randint(0, 12, (3, 4))
    F.cross_entropy(logits.reshape(-1, 12), tgt.reshape(-1)).backward()
    mine = logits.detach()[..., lo:hi].clone().requires_grad_(True)
    loss = T.vocab_parallel_cross_entropy(mine, tgt)
    loss.backward()
    ref_loss = F.cross_entropy(logits.detach().reshape(-1, 12), tgt.reshape(-1))
    return ((out - ref).abs().max().item(), (pe.weight.grad - emb.weight.grad[lo:hi]).abs().max().item(),
            abs(loss.item() - ref_loss.item()), (mine.grad - logits.grad[..., lo:hi]).abs().max().item())


def test_vocab_parallel_embedding_and_cross_entropy(cluster):
    for errs in cluster.run(_vocab_case):
        assert max(errs) < 1e-6, errs


def _vocab_ce_bf16_ignore_case(rank, world_size):
    """bf16 logits with padding targets (-100): the loss equals F.cross_entropy on the fp32 logits with
    ignore_index (so the softmax ran in fp32 and the padding counted for nothing), the gradient is bf16
    and zero on the padded tokens; a fresh VocabParallelEmbedding holds only its V/t rows."""
    import torch
    import torch.nn.functional as F
    from course_lib import tensor_parallel as T
    torch.manual_seed(0)
    V = 16
    lo, hi = T.even_shard(V, rank, world_size)
    logits = (torch.randn(2, 6, V) * 4).bfloat16()
    tgt = torch.randint(0, V, (2, 6))
    tgt[0, :3] = -100                                           # a padded prompt
    full = logits.float().requires_grad_(True)
    ref = F.cross_entropy(full.reshape(-1, V), tgt.reshape(-1), ignore_index=-100)
    ref.backward()
    mine = logits[..., lo:hi].clone().requires_grad_(True)
    loss = T.vocab_parallel_cross_entropy(mine, tgt)
    loss.backward()
    emb = T.VocabParallelEmbedding(V, 3)
    return dict(loss=abs(loss.item() - ref.item()), dtype=str(mine.grad.dtype), loss_dtype=str(loss.dtype),
                grad=(mine.grad.float() - full.grad[..., lo:hi]).abs().max().item(),
                padded=mine.grad[0, :3].abs().max().item(), rows=tuple(emb.weight.shape))


def test_vocab_parallel_cross_entropy_in_fp32_with_ignore_index(cluster):
    for r in cluster.run(_vocab_ce_bf16_ignore_case):
        assert r["loss"] < 1e-5 and r["loss_dtype"] == "torch.float32", r   # fp32 rounding of a loss ~4
        assert r["dtype"] == "torch.bfloat16" and r["grad"] < 1e-2 and r["padded"] == 0.0, r
        assert r["rows"] == (16 // 4, 3), r


def _dtensor_case(rank, world_size):
    """Our TP MLP and sequence-parallel layer norm vs DTensor's parallelize_module on the same weights."""
    import copy
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from course_lib import tensor_parallel as T

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.fc = nn.Linear(8, 32)
            self.fc_proj = nn.Linear(32, 8)

        def forward(self, x):
            return self.fc_proj(F.gelu(self.fc(self.ln(x))))

    torch.manual_seed(0)
    ref = MLP()
    x = torch.randn(2, 8, 8)
    mesh = init_device_mesh("cpu", (world_size,))
    dt = parallelize_module(copy.deepcopy(ref), mesh, {
        "ln": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "fc_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    lo, hi = T.even_shard(8, rank, world_size)
    x_local = x[:, lo:hi].clone()
    y_dt = dt(x_local)                                     # Shard(1) in, Shard(1) out
    y_dt = y_dt.to_local() if hasattr(y_dt, "to_local") else y_dt
    y_dt.pow(2).sum().backward()

    ln = copy.deepcopy(ref.ln)
    ln.weight._sequence_parallel = ln.bias._sequence_parallel = True
    mlp = T.ParallelMLP.from_linears(ref.fc, ref.fc_proj, sequence_parallel=True)
    y = mlp(ln(x_local))
    y.pow(2).sum().backward()
    T.all_reduce_sequence_parallel_grads(ln)
    g_dt = dt.fc.weight.grad.to_local()
    ln_dt = dt.ln.weight.grad.full_tensor()
    return ((y - y_dt).abs().max().item(), (mlp.fc.weight.grad - g_dt).abs().max().item(),
            (ln.weight.grad - ln_dt).abs().max().item())


def test_equal_to_dtensor_parallelize_module(cluster):
    for errs in cluster.run(_dtensor_case):
        assert max(errs) < 1e-5, errs


def _bad(rank, world_size, what):
    import torch
    from course_lib import tensor_parallel as T
    from course_lib.models import CausalSelfAttention
    if what == "hidden":
        T.ColumnParallelLinear(8, 6)
    elif what == "heads":
        T.ParallelSelfAttention.from_attention(CausalSelfAttention(12, 6))
    elif what == "vocab":
        T.VocabParallelEmbedding(10, 4)
    elif what == "row-input":
        T.RowParallelLinear(8, 4)(torch.zeros(2, 8))


@pytest.mark.parametrize("what, words", [
    ("hidden", "degree 4 does not divide the out_features (6)"),
    ("heads", "does not divide the number of attention heads (6)"),
    ("vocab", "does not divide the vocabulary size (10)"),
    ("row-input", "expects this rank's slice of 2 input features"),
])
def test_bad_sizes_say_what_to_change(cluster, what, words):
    with pytest.raises(RankError, match="rank 0") as e:
        cluster.run(_bad, what)
    assert words in str(e.value)
    assert "use a degree in" in str(e.value) or what == "row-input"


def test_needs_a_process_group():
    from course_lib import tensor_parallel as T
    with pytest.raises(RuntimeError, match="initialised process group"):
        T.ColumnParallelLinear(4, 4)


def test_cost_model():
    from course_lib import tensor_parallel as T
    b = T.tp_bytes_per_layer(1, 2048, 12288, 8)              # GPT-3 175B layer, bf16
    assert b["bytes_per_all_reduce"] == 2048 * 12288 * 2
    assert b["sent"] == pytest.approx(4 * 2 * 7 / 8 * 2048 * 12288 * 2)
    fast = T.tp_comm_seconds(1, 2048, 12288, 8, bandwidth=450e9)
    slow = T.tp_comm_seconds(1, 2048, 12288, 8, bandwidth=25e9)
    assert slow / fast == pytest.approx(18)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        T.tp_bytes_per_layer(1, 8, 8, 0)


def _init_per_shard(rank, world_size):
    import math
    import torch
    from course_lib import tensor_parallel as T
    g = torch.Generator().manual_seed(100 + rank)         # a different seed per rank
    col = T.ColumnParallelLinear(16, 64, generator=g)
    row = T.RowParallelLinear(64, 16, generator=g)
    return (tuple(col.weight.shape), tuple(row.weight.shape), col.weight.abs().max().item(),
            1 / math.sqrt(16), row.weight.abs().max().item(), 1 / math.sqrt(64), row.bias.abs().max().item(),
            col.weight[0, 0].item())


def test_layers_initialised_per_shard(cluster):
    res = cluster.run(_init_per_shard)
    for cw, rw, cmax, cb, rmax, rb, bias, _ in res:
        assert cw == (16, 16) and rw == (16, 16)
        assert 0.8 * cb < cmax <= cb and 0.8 * rb < rmax <= rb and bias == 0
    assert len({r[-1] for r in res}) == WORLD                 # the shards differ


def _layout_case(rank, world_size, tp):
    """Each layer's shard_layout() next to what the layer holds and computes, from numbered weights."""
    import torch
    from course_lib import tensor_parallel as T

    group = _group(tp)
    if rank >= tp:
        return None
    torch.manual_seed(0)
    h = 8

    def numbered(lin):   # W[i, j] = i * in + j: every entry says where it came from
        with torch.no_grad():
            lin.weight.copy_(torch.arange(lin.weight.numel(), dtype=torch.float32).view_as(lin.weight))
        return lin

    full = {"fc": numbered(torch.nn.Linear(h, 4 * h)), "fc_proj": numbered(torch.nn.Linear(4 * h, h)),
            "qkv": numbered(torch.nn.Linear(h, 3 * h))}
    full["gathered"], full["unsplit"] = full["fc"], full["fc_proj"]
    mlp = T.ParallelMLP.from_linears(full["fc"], full["fc_proj"], group)
    layers = {"fc": mlp.fc, "fc_proj": mlp.fc_proj,
              "qkv": T.ColumnParallelLinear.from_linear(full["qkv"], group, fused=3),
              "gathered": T.ColumnParallelLinear.from_linear(full["fc"], group, gather_output=True),
              "unsplit": T.RowParallelLinear.from_linear(full["fc_proj"], group, input_is_parallel=False)}
    out = {}
    for name, layer in layers.items():
        L = layer.shard_layout()
        W = full[name].weight.detach()
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in L["rows"]])
        cols = torch.cat([torch.arange(lo, hi) for lo, hi in L["cols"]])
        held = torch.equal(layer.weight.detach(), W[rows][:, cols])     # the block the layout names
        n_in = L["input"]["of"]
        x = torch.randn(2, 3, n_in)                                     # the full input, the same everywhere
        x_in = x[..., torch.cat([torch.arange(lo, hi) for lo, hi in L["input"]["features"]])]
        with torch.no_grad():
            y = layer(x_in)                         # after the layer's collective, if it has one
            ref = full[name](x)
            if L["output"]["after"] is None:        # this rank's output features, nothing else
                feats = torch.cat([torch.arange(lo, hi) for lo, hi in L["output"]["features"]])
                mine = torch.allclose(y, ref[..., feats], rtol=1e-5, atol=1e-2)
            else:                                   # the collective completed the whole output
                mine = torch.allclose(y, ref, rtol=1e-5, atol=1e-2)
        out[name] = dict(layout=L, held=held, computes=mine, out_width=y.shape[-1])
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_layout_names_the_block_each_rank_holds(cluster, tp):
    """shard_layout(): the weight block is exactly the rows/columns of the full weight the layer holds,
    the output features are the ones it computes (a column layer) or it is a partial sum (a row layer);
    the blocks of the t ranks tile each weight once; and a column layer's output slice is the next row
    layer's input slice on every rank, which is why the MLP needs no communication in between."""
    import pickle

    res = cluster.run(_layout_case, tp)
    assert all(o is None for o in res[tp:])
    res = res[:tp]
    for r, layers in enumerate(res):
        for name, o in layers.items():
            L = o["layout"]
            pickle.dumps(L)
            assert o["held"] and o["computes"], (tp, r, name)
            assert (L["rank"], L["tp"]) == (r, tp)
            width = sum(hi - lo for lo, hi in L["output"]["features"]) if L["output"]["after"] is None \
                else L["output"]["of"]
            assert o["out_width"] == (width if L["output"]["state"] != "partial" else L["output"]["of"])
        fc, proj = layers["fc"]["layout"], layers["fc_proj"]["layout"]
        k = 32 // tp
        assert fc["rows"] == [(r * k, (r + 1) * k)] and fc["cols"] == [(0, 8)]
        assert proj["rows"] == [(0, 8)] and proj["cols"] == [(r * k, (r + 1) * k)]
        assert (fc["input"]["state"], fc["output"]["state"], proj["input"]["state"], proj["output"]["state"]) \
            == ("replicated", "split", "split", "partial")
        assert proj["output"]["after"] == "all-reduce" and fc["output"]["after"] is None
        assert fc["output"]["features"] == proj["input"]["features"]      # Y_r feeds the row layer as it is
        q = 8 // tp                                                       # qkv: rank r's heads of Q, K and V
        assert layers["qkv"]["layout"]["rows"] == [(j * 8 + r * q, j * 8 + (r + 1) * q) for j in range(3)]
        assert layers["gathered"]["layout"]["output"]["after"] == "all-gather"
        assert layers["unsplit"]["layout"]["input"] == {"features": [(0, 32)], "of": 32, "state": "replicated",
                                                        "before": None}
    for name in res[0]:                                                   # the t blocks tile the weight once
        out_f, in_f = res[0][name]["layout"]["full_shape"]
        cover = torch.zeros(out_f, in_f, dtype=torch.int64)
        for layers in res:
            L = layers[name]["layout"]
            for a, b in L["rows"]:
                for c, d in L["cols"]:
                    cover[a:b, c:d] += 1
        assert bool((cover == 1).all()), name


def test_plot_tp_split_draws_the_layers_own_layouts(cluster):
    """The MLP drawn from the layouts its layers return: rank r's block of each weight is drawn at the
    rows and columns the layer holds (W^T: x = row of W, y from the top = column of W)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import viz

    res = cluster.run(_layout_case, WORLD)
    layouts = [[o["fc"]["layout"], o["fc_proj"]["layout"]] for o in res]
    fig = viz.plot_tp_split(layouts, names=["fc", "fc_proj"])
    try:
        ax = fig.axes[0]
        for i, name in enumerate(["fc", "fc_proj"]):
            full = next(p for p in ax.patches if p.get_gid() == f"{name}:W:full")
            x0, top = full.get_x(), full.get_y() + full.get_height()
            for r in range(WORLD):
                drawn = [(round(p.get_x() - x0), round(p.get_x() - x0 + p.get_width()),
                          round(top - p.get_y() - p.get_height()), round(top - p.get_y()))
                         for p in ax.patches if p.get_gid() == f"{name}:W:rank{r}"]
                L = layouts[r][i]
                assert drawn == [(a, b, c, d) for a, b in L["rows"] for c, d in L["cols"]]
    finally:
        plt.close(fig)
