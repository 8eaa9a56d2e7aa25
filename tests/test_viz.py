"""The layout drawings of course_lib.viz: plot_zero_layout / plot_zero_stages (ZeRO's shards) and
plot_tp_split (tensor-parallel blocks), on hand-written layout descriptions in the format of
``ZeRO.shard_layout()`` and ``ColumnParallelLinear/RowParallelLinear.shard_layout()``.

Each test reads the drawing back (the patches' gids and rectangles, the texts), so a drawing that put a
shard anywhere but where the description says fails. test_zero.py and test_tensor_parallel.py check that
the library's objects describe themselves correctly, and draw their real descriptions.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib import viz  # noqa: E402

UNITS = [("layers.0", 36), ("layers.1", 42), ("layers.2", 7)]   # TinyMLP(5, 6, 1, 3)
STATES = ("parameters", "gradients", "optimizer_states")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def zero_layout(stage, world, rank, units=UNITS):
    """What ZeRO.shard_layout() describes for a rank, by the rules of the ZeRO paper (FP32 Adam)."""
    sharded = {0: (), 1: ("optimizer_states",), 2: ("gradients", "optimizer_states"),
               3: ("parameters", "gradients", "optimizer_states")}[stage]
    out = []
    for name, numel in units:
        shard = -(-numel // world)
        padded = shard * world
        owned = (0, padded) if stage == 0 else (rank * shard, (rank + 1) * shard)
        u = {"name": name, "numel": numel, "padded": padded, "shard_size": shard, "owned": owned}
        for key in STATES:
            lo, hi = owned if key in sharded else (0, padded)
            copies = 2 if key == "optimizer_states" else 1
            u[key] = {"lo": lo, "hi": hi, "dtype": "float32", "copies": copies, "bytes": 4 * copies * (hi - lo)}
        out.append(u)
    return {"rank": rank, "world_size": world, "stage": stage, "units": out}


def patches(ax):
    return {p.get_gid(): p for p in ax.patches if p.get_gid()}


def check_zero_axes(ax, layouts):
    """Every held range, padding and outline is drawn where the layouts say, and nothing else."""
    got = patches(ax)
    units = layouts[0]["units"]
    starts = {u["name"]: got[f"rank{layouts[0]['rank']}:parameters:{u['name']}:full"].get_x() for u in units}
    assert [starts[u["name"]] for u in units] == sorted(starts.values())   # units left to right
    want = set()
    for d in layouts:
        r = d["rank"]
        for u in d["units"]:
            x0 = starts[u["name"]]
            for key in STATES:
                s, tag = u[key], f"rank{r}:{key}:{u['name']}"
                full = got[tag + ":full"]
                assert (full.get_x(), full.get_width()) == pytest.approx((x0, u["padded"]))
                want.add(tag + ":full")
                if min(s["hi"], u["numel"]) > s["lo"]:
                    p = got[tag]
                    assert (p.get_x(), p.get_width()) == pytest.approx((x0 + s["lo"], min(s["hi"], u["numel"]) - s["lo"]))
                    assert matplotlib.colors.same_color(p.get_facecolor()[:3], viz.RANK_COLORS[r])
                    want.add(tag)
                if s["hi"] > u["numel"]:
                    p = got[tag + ":padding"]
                    lo = max(s["lo"], u["numel"])
                    assert (p.get_x(), p.get_width()) == pytest.approx((x0 + lo, s["hi"] - lo))
                    assert p.get_hatch()
                    want.add(tag + ":padding")
                for part in (tag, tag + ":padding"):   # the held range and its padding on the bar's row
                    if part in got:
                        assert got[part].get_y() == pytest.approx(full.get_y())
    assert set(got) == want


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plot_zero_layout_draws_each_ranks_ranges_and_padding(stage):
    layouts = [zero_layout(stage, 4, r) for r in range(4)]
    ax = viz.plot_zero_layout(layouts)
    check_zero_axes(ax, layouts)
    texts = [t.get_text() for t in ax.texts]
    for d in layouts:   # each band is headed by the rank and the bytes it holds
        held = sum(u[k]["bytes"] for u in d["units"] for k in STATES)
        assert f"rank {d['rank']}: {held:,} B" in texts
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:3] == ["parameters (fp32)", "gradients (fp32)", "optimizer states (2 × fp32)"]
    assert len(labels) == 12
    assert ax.get_title().startswith(f"stage {stage}") and ax.get_title().endswith("N = 4")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["layers.0\n36", "layers.1\n42 + 2 pad", "layers.2\n7 + 1 pad"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:4] == [f"held by rank {r}" for r in range(4)] and "padding to a multiple of N" in legend


def test_plot_zero_layout_shows_the_shards_shrinking():
    """The area each rank's colour covers: 3 full bars at stage 0, then 2, 1, none (the rest 1/N)."""
    for stage in range(4):
        ax = viz.plot_zero_layout([zero_layout(stage, 4, r) for r in range(4)])
        got = patches(ax)
        full_bars = sum(1 for key in STATES
                        if got[f"rank1:{key}:layers.0"].get_width() == pytest.approx(36))
        assert full_bars == 3 - stage
        plt.close("all")


def test_plot_zero_layout_skips_ranks_outside_the_group_and_orders_by_rank():
    layouts = [zero_layout(2, 2, 1), zero_layout(2, 2, 0), None, None]   # a 2-rank subgroup of 4
    ax = viz.plot_zero_layout(layouts)
    check_zero_axes(ax, [layouts[1], layouts[0]])
    headers = [t.get_text() for t in ax.texts if t.get_text().startswith("rank")]
    assert [h.split(":")[0] for h in headers] == ["rank 0", "rank 1"]
    assert patches(ax)["rank0:parameters:layers.0"].get_y() < patches(ax)["rank1:parameters:layers.0"].get_y()
    assert ax.yaxis_inverted()   # rank 0 on top


def test_plot_zero_stages_draws_one_panel_per_stage():
    per_stage = [[zero_layout(s, 4, r) for r in range(4)] for s in range(4)]
    fig = viz.plot_zero_stages(per_stage)
    axes = fig.axes[:4]
    assert [" ".join(ax.get_title().split()[:2]) for ax in axes] == [f"stage {s}" for s in range(4)]
    for ax, layouts in zip(axes, per_stage):
        check_zero_axes(ax, layouts)
    assert [t.get_text() for t in axes[0].get_yticklabels()][:1] == ["parameters (fp32)"]
    assert all(t.get_text() == "" for ax in axes[1:] for t in ax.get_yticklabels())
    assert len(fig.legends) == 1 and fig.get_suptitle()


def test_plot_zero_layout_mixed_precision_labels():
    d = [zero_layout(1, 2, r) for r in range(2)]
    for layout in d:
        for u in layout["units"]:
            u["parameters"]["dtype"] = u["gradients"]["dtype"] = "bfloat16"
            u["optimizer_states"]["copies"] = 3
    labels = [t.get_text() for t in viz.plot_zero_layout(d).get_yticklabels()][:3]
    assert labels == ["parameters (bf16)", "gradients (bf16)", "optimizer states (3 × fp32)"]


def test_plot_zero_layout_bad_input():
    with pytest.raises(ValueError, match="no layouts"):
        viz.plot_zero_layout([None, None])
    with pytest.raises(ValueError, match="plot_zero_stages"):
        viz.plot_zero_layout([zero_layout(1, 2, 0), zero_layout(2, 2, 1)])
    other = zero_layout(1, 2, 1, units=[("a", 5)])
    with pytest.raises(ValueError, match="different units"):
        viz.plot_zero_layout([zero_layout(1, 2, 0), other])
    with pytest.raises(ValueError, match="no stages"):
        viz.plot_zero_stages([])


# ------------------------------------------------------------------ tensor parallelism
def tp_layouts(t=4, h=8, gather_output=False):
    """What ColumnParallelLinear(h, 4h) and RowParallelLinear(4h, h) describe on each of t ranks."""
    out = []
    for r in range(t):
        c = (r * 4 * h // t, (r + 1) * 4 * h // t)
        col = {"layer": "column", "rank": r, "tp": t, "full_shape": (4 * h, h), "rows": [c], "cols": [(0, h)],
               "bias": "split", "input": {"features": [(0, h)], "of": h, "state": "replicated", "before": None},
               "output": {"features": [c], "of": 4 * h, "state": "split",
                          "after": "all-gather" if gather_output else None}}
        row = {"layer": "row", "rank": r, "tp": t, "full_shape": (h, 4 * h), "rows": [(0, h)], "cols": [c],
               "bias": "replicated", "input": {"features": [c], "of": 4 * h, "state": "split", "before": None},
               "output": {"features": [(0, h)], "of": h, "state": "partial", "after": "all-reduce"}}
        out.append([col, row])
    return out


def weight_blocks(ax, name):
    """{rank: [(row_lo, row_hi, col_lo, col_hi)]} of the full weight W (out x in), read back from the
    drawing of W^T: x = output feature (row of W), y from the top = input feature (column of W)."""
    got = patches(ax)
    full = got[f"{name}:W:full"]
    x0, top = full.get_x(), full.get_y() + full.get_height()
    blocks = {}
    for p in ax.patches:
        gid = p.get_gid() or ""
        if gid.startswith(f"{name}:W:rank"):
            r = int(gid.rsplit("rank", 1)[1])
            x, y, w, hgt = p.get_x() - x0, p.get_y(), p.get_width(), p.get_height()
            blocks.setdefault(r, []).append((round(x), round(x + w), round(top - y - hgt), round(top - y)))
    return blocks, (round(full.get_width()), round(full.get_height()))


def check_tp_figure(fig, layouts, names):
    """The drawn weight blocks and activation slices are the ones the layouts describe."""
    ax = fig.axes[0]
    got = patches(ax)
    for i, name in enumerate(names):
        blocks, (w, hgt) = weight_blocks(ax, name)
        out_f, in_f = layouts[0][i]["full_shape"]
        assert (w, hgt) == (out_f, in_f)            # W^T: in x out
        for ls in layouts:
            L = ls[i]
            want = sorted((a, b, c, d) for a, b in L["rows"] for c, d in L["cols"])
            assert sorted(blocks[L["rank"]]) == want
            r = L["rank"]
            p = [q for g, q in got.items() if g == f"{name}:W:rank{r}"][0]
            assert matplotlib.colors.same_color(p.get_facecolor()[:3], viz.RANK_COLORS[r])
    return ax


def test_plot_tp_split_draws_each_ranks_blocks_and_activations():
    layouts = tp_layouts()
    fig = viz.plot_tp_split(layouts, names=["fc", "fc_proj"])
    ax = check_tp_figure(fig, layouts, ["fc", "fc_proj"])
    got = patches(ax)
    # fc: column parallel, rank r holds rows 8r..8r+8 of W (4h x h): a vertical stripe of W^T
    blocks, _ = weight_blocks(ax, "fc")
    assert blocks == {r: [(8 * r, 8 * (r + 1), 0, 8)] for r in range(4)}
    blocks, _ = weight_blocks(ax, "fc_proj")      # row parallel: columns of W, horizontal stripes of W^T
    assert blocks == {r: [(0, 8, 8 * r, 8 * (r + 1))] for r in range(4)}
    # X: replicated, a stack of 4 full cards; Y: one box split 4 ways; fc_proj's input is Y (not redrawn)
    assert [round(got[f"fc:input:rank{r}"].get_width()) for r in range(4)] == [8] * 4
    y0 = got["fc:output:full"].get_x()
    assert [(round(got[f"fc:output:rank{r}"].get_x() - y0), round(got[f"fc:output:rank{r}"].get_width()))
            for r in range(4)] == [(8 * r, 8) for r in range(4)]
    assert not any(g.startswith("fc_proj:input") for g in got)
    # the partial sums: 4 hatched cards, then the all-reduce's result on every rank
    assert all(got[f"fc_proj:output:rank{r}"].get_hatch() for r in range(4))
    assert all(not got[f"fc_proj:after:rank{r}"].get_hatch() for r in range(4))
    assert got["fc_proj:after:rank0"].get_x() > got["fc_proj:output:rank3"].get_x()
    texts = [t.get_text() for t in ax.texts]
    assert "all-reduce" in texts
    cuts = [t.get_text() for t in ax.texts if t.get_text().isdigit()]   # the blocks' bounds: fc above, fc_proj left
    assert sorted(cuts, key=int) == sorted(["0", "8", "16", "24", "32"] * 2, key=int)
    assert any(t.startswith("fc: column parallel") for t in texts)
    assert any(t.startswith("fc_proj: row parallel") for t in texts)
    assert "$Y$ (b·s, 32)\nrank r: (b·s, 8)" in texts
    assert any("$Z_r$" in t and "partial sum" in t for t in texts)
    assert [t.get_text() for t in ax.get_legend().get_texts()][:4] == [f"rank {r}" for r in range(4)]


def test_plot_tp_split_two_ranks_and_a_gathered_output():
    layouts = tp_layouts(t=2, gather_output=True)
    fig = viz.plot_tp_split([[ls[0]] for ls in layouts] + [None, None], names=["fc"])
    check_tp_figure(fig, [[ls[0]] for ls in layouts], ["fc"])
    ax = fig.axes[0]
    assert "all-gather" in [t.get_text() for t in ax.texts]
    assert {g for g in patches(ax) if g.startswith("fc:after")} == {"fc:after:rank0", "fc:after:rank1"}


def test_plot_tp_split_bad_input():
    with pytest.raises(ValueError, match="no layouts"):
        viz.plot_tp_split([None])
    layouts = tp_layouts()
    with pytest.raises(ValueError, match="same layers"):
        viz.plot_tp_split([layouts[0], layouts[1][:1]])
    with pytest.raises(ValueError, match="names has 1"):
        viz.plot_tp_split(layouts, names=["fc"])
    sp = tp_layouts()
    for ls in sp:
        ls[1]["output"]["after"] = "reduce-scatter"
    with pytest.raises(ValueError, match="sequence parallelism"):
        viz.plot_tp_split(sp)


# ------------------------------------------------------------------ ring attention's tiles
def ring_steps(s=8):
    """What context_parallel.ring_tiles describes for causal ring attention on 2 ranks, contiguous
    layout (rank 0 holds positions 0-3, rank 1 positions 4-7), spelled out by hand."""
    return [
        [{"step": 0, "src": 0, "tiles": [(0, 4, 0, 4)], "pairs": 16},
         {"step": 1, "src": 1, "tiles": [], "pairs": 0}],            # rank 1's keys are all in the future
        [{"step": 0, "src": 1, "tiles": [(4, 8, 4, 8)], "pairs": 16},
         {"step": 1, "src": 0, "tiles": [(4, 8, 0, 4)], "pairs": 16}],
    ]


def tiles_drawn(ax):
    """{(rank, step): [(q_lo, q_hi, k_lo, k_hi)]} read back from the rectangles (x = key, y = query)."""
    out = {}
    for p in ax.patches:
        gid = p.get_gid() or ""
        if ":step" in gid:
            r, i = int(gid.split(":")[0][4:]), int(gid.split(":")[1][4:])
            x, y, w, h = p.get_x(), p.get_y(), p.get_width(), p.get_height()
            out.setdefault((r, i), []).append((round(y), round(y + h), round(x), round(x + w)))
    return out


def test_plot_ring_tiles_draws_every_ranks_tiles_where_and_when_they_are_computed():
    steps = ring_steps()
    fig = viz.plot_ring_tiles(steps, 8)
    axes = fig.axes[:2]
    got = {}
    for ax in axes:
        got.update(tiles_drawn(ax))
    assert got == {(0, 0): [(0, 4, 0, 4)], (1, 0): [(4, 8, 4, 8)], (1, 1): [(4, 8, 0, 4)]}
    assert [ax.get_title() for ax in axes] == ["rank 0: 16 pairs", "rank 1: 32 pairs"]
    # one colour per step, the same on every rank
    colour = {}
    for ax in axes:
        for p in ax.patches:
            gid = p.get_gid() or ""
            if ":step" in gid:
                colour.setdefault(gid.split(":")[1], set()).add(tuple(p.get_facecolor()))
    assert all(len(c) == 1 for c in colour.values()) and colour["step0"] != colour["step1"]
    # the rank's own query rows in grey, queries run down (position 0 at the top), keys across
    assert {p.get_gid() for p in axes[1].patches if ":rows:" in (p.get_gid() or "")} == {"rank1:rows:4-8"}
    assert axes[0].yaxis_inverted() and axes[0].get_xlim() == (0, 8)
    assert axes[0].get_xlabel() == "key position" and axes[0].get_ylabel() == "query position"
    assert any(p.get_gid() == "rank0:masked" for p in axes[0].patches)          # causal: the future shaded
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["step 0 (own K/V)", "step 1"] and "key after query: masked" in legend


def test_plot_ring_tiles_on_given_axes_with_trace_events_and_no_mask():
    events = [[dict(d, kind="compute", name=f"ring_attention/step {d['step']}") for d in ranks]
              for ranks in ring_steps()]
    fig, axes = plt.subplots(2, 2, layout="constrained")
    viz.plot_ring_tiles(events, 8, axes=axes[1], causal=False, row_label="contiguous", legend=False)
    assert axes[1][0].get_ylabel() == "contiguous\nquery position"
    assert not any((p.get_gid() or "").endswith("masked") for p in axes[1][0].patches)
    assert tiles_drawn(axes[1][1]) == {(1, 0): [(4, 8, 4, 8)], (1, 1): [(4, 8, 0, 4)]}
    assert not fig.legends and not axes[0][0].patches


def test_plot_ring_tiles_bad_input():
    with pytest.raises(ValueError, match="no steps"):
        viz.plot_ring_tiles([None, None], 8)
    steps = ring_steps()
    steps[1][1]["pairs"] = 20
    with pytest.raises(ValueError, match="cover 16 .* pairs=20"):
        viz.plot_ring_tiles(steps, 8)
    steps = ring_steps()
    steps[1] = steps[1] + steps[1]                                   # forward and backward mixed
    with pytest.raises(ValueError, match="one entry per ring step"):
        viz.plot_ring_tiles(steps, 8)
    with pytest.raises(ValueError, match="one Axes per rank"):
        viz.plot_ring_tiles(ring_steps(), 8, axes=plt.subplots(1, 3)[1])


def test_plot_all_to_all_draws_one_band_per_pair_and_the_padding():
    from matplotlib.patches import Polygon

    rows = [[3, 5], [0, 7]]                                  # rank 1 sends nothing to rank 0
    fig, (a, b) = plt.subplots(1, 2)
    viz.plot_all_to_all(rows, ax=a)
    bands = [p for p in a.patches if isinstance(p, Polygon) and p.get_hatch() is None]
    assert len(bands) == 2 + 2 + 3                           # 2 senders, 2 receivers, 3 non-empty pairs
    assert "5 rows cross" in a.get_title()                  # 5 + 0 between ranks; 3 and 7 stay
    viz.plot_all_to_all(rows, ax=b, block=6)                 # fixed blocks of 6: padding hatched, 1 dropped
    assert sum(p.get_hatch() is not None for p in b.patches) == 3   # 3 pairs have fewer than 6 rows
    assert "1 dropped" in b.get_title()
    with pytest.raises(ValueError, match="square"):
        viz.plot_all_to_all([[1, 2]])
