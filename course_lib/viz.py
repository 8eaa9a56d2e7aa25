"""Plots used across the notebooks: per-rank timelines (from :mod:`course_lib.trace`), the layouts of
sharded states (:func:`plot_zero_layout`, :func:`plot_zero_stages`, :func:`plot_tp_split`) and the tiles of
ring attention (:func:`plot_ring_tiles`), who sends what to whom in an all-to-all (:func:`plot_all_to_all`), drawn from the descriptions the library's own objects return, so a
drawing cannot disagree with the code, and others, and
:func:`show`, which prints the source of the library code a notebook discusses.

Every plotting function draws on a matplotlib ``Axes`` (a new one when ``ax`` is ``None``) and returns it
(those with several panels or a drawing of their own proportions: the ``Figure``),
with a title, axis labels that carry units, and a legend.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["show", "plot_timeline", "plot_pipeline", "plot_mesh", "plot_rank_tensors", "plot_ring_steps",
           "plot_zero_layout", "plot_zero_stages", "plot_tp_split", "plot_ring_tiles", "plot_all_to_all",
           "KIND_COLORS", "RANK_COLORS"]

# Fixed colours for the kinds of course_lib.trace's vocabulary, so that compute, communication and a
# pipeline's forwards and backwards look the same in every notebook whichever kind comes first.
KIND_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "forward": "tab:red", "backward": "tab:purple",
               "weight": "tab:brown"}
_EXTRA_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                 "tab:cyan", "tab:gray"]


def show(*objs, start: str | None = None, body: bool = True) -> None:
    """Print the source of a few short library functions or classes, one after another; with
    ``start``, each from its first line containing ``start`` (to skip a long docstring); with
    ``body=False``, only each one's signature and docstring, its body drawn as ``...`` (to state what
    a function does without printing the code an exercise asks for)."""
    import inspect

    parts = []
    for obj in objs:
        src = inspect.getsource(obj)
        if not body:
            src = _signature_and_doc(src)
        if start is not None:
            if start not in src:
                raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)}")
            src = src[src.index(start):]
        parts.append(src)
    print("\n".join(parts))


def _signature_and_doc(src: str) -> str:
    """The decorators, signature and docstring of one ``def`` or ``class`` in ``src``; the body ``...``."""
    import ast
    import textwrap

    node = ast.parse(textwrap.dedent(src)).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        raise ValueError("body=False needs the source of a function or a class")
    lines = src.splitlines()
    first = node.body[0]
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    end = first.end_lineno if has_doc else first.lineno - 1   # line numbers count from 1
    indent = lines[first.lineno - 1][:len(lines[first.lineno - 1]) - len(lines[first.lineno - 1].lstrip())]
    return "\n".join(lines[:end] + [indent + "..."]) + "\n"


def _new_ax(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt
        # constrained layout keeps the x label inside the figure when it is saved or shown
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def plot_timeline(events_per_rank: Sequence[Sequence[dict]], ax=None,
                  title: str = "Per-rank timeline (compute vs communication)",
                  label_events: bool = False, min_label_frac: float = 0.06, colors: dict | None = None):
    """Draw one horizontal row per rank with a bar per event, coloured by ``kind``.

    Args:
        events_per_rank: ``events_per_rank[r]`` is rank r's ``Recorder.events`` (list of dicts with
            ``kind, name, start, end``; start/end in seconds on the shared wall-clock scale, see
            :mod:`course_lib.trace`).
        ax: matplotlib Axes to draw on; a new figure when ``None``.
        title: the plot title.
        label_events: write each event's name inside its bar when the bar is wide enough
            (wider than ``min_label_frac`` of the time axis).
        colors: ``{kind: colour}`` for kinds outside :data:`KIND_COLORS` (or to override them), so two
            panels colour a kind alike whichever kind each meets first.

    Returns:
        The Axes. The x axis is milliseconds since the earliest start over all ranks; row r is
        labelled "rank r" (rank 0 at the top).
    """
    from matplotlib.patches import Patch

    n = len(events_per_rank)
    ax = _new_ax(ax, (10, 0.6 * max(n, 1) + 1.5))
    all_events = [e for evs in events_per_rank for e in evs]
    if not all_events:
        raise ValueError("plot_timeline got no events; record some with trace.Recorder "
                         "(span() or comm()) and pass each rank's rec.events")
    t0 = min(e["start"] for e in all_events)
    t_end = max(e["end"] for e in all_events)
    span_ms = max((t_end - t0) * 1e3, 1e-9)

    colors = dict(KIND_COLORS, **(colors or {}))
    extra = 0
    for e in all_events:  # any other kind gets the next colour no kind has, in order of appearance
        if e["kind"] not in colors:
            free = [c for c in _EXTRA_COLORS if c not in colors.values()]
            colors[e["kind"]] = free[0] if free else _EXTRA_COLORS[extra % len(_EXTRA_COLORS)]
            extra += 1

    height = 0.7
    for row, evs in enumerate(events_per_rank):
        y = n - 1 - row  # rank 0 on top, as a reader expects
        for e in evs:
            x = (e["start"] - t0) * 1e3
            w = max((e["end"] - e["start"]) * 1e3, span_ms * 1e-3)  # keep instant events visible
            ax.broken_barh([(x, w)], (y - height / 2, height), facecolors=colors[e["kind"]],
                           edgecolors="black", linewidth=0.3)
            if label_events and w > min_label_frac * span_ms:
                ax.text(x + w / 2, y, e["name"], ha="center", va="center", fontsize=7, clip_on=True)

    labels = []
    for row, evs in enumerate(events_per_rank):
        rank = evs[0]["rank"] if evs and "rank" in evs[0] else row
        labels.append(f"rank {rank}")
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels[::-1])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time since first event (ms)")
    ax.set_ylabel("rank")
    ax.set_title(title)
    kinds_seen = [k for k in colors if any(e["kind"] == k for e in all_events)]
    ax.legend(handles=[Patch(facecolor=colors[k], edgecolor="black", label=k) for k in kinds_seen],
              loc="upper right", fontsize=8)
    return ax


_PIPE_STYLE = {"forward": dict(alpha=1.0, hatch=None), "backward": dict(alpha=0.55, hatch="///"),
               "weight": dict(alpha=0.3, hatch="...")}


def plot_pipeline(events_per_rank: Sequence[Sequence[dict]], ax=None, title: str | None = None,
                  n_microbatches: int | None = None, show_stage: bool = False, xlabel: str | None = None):
    """The classic pipeline picture: one row per rank, one bar per action, the colour is the
    micro-batch, forwards solid, backwards hatched (``///``), weight-gradient halves dotted.

    Args:
        events_per_rank: per-rank events from :func:`course_lib.pipeline.simulate` (times in units of
            the schedule, ``clock="simulated"``) or a :class:`course_lib.trace.Recorder` around
            :func:`course_lib.pipeline.run_schedule` (wall-clock seconds, drawn in ms). Events of other
            kinds are ignored.
        title: the title; ``None`` writes the measured bubble fraction.
        n_microbatches: how many colours to use (default: as many as the micro-batches seen).
        show_stage: label bars ``3@s5`` (micro-batch 3 of stage 5), for ranks holding several stages.
        xlabel: the x label (default: "time (simulated units)" or "time since the first action (ms)").

    Returns:
        The Axes (x: time since the first action, y: rank 0 at the top).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from course_lib.pipeline import bubble_fraction

    rows = [[e for e in evs if e.get("kind") in _PIPE_STYLE] for evs in events_per_rank]
    flat = [e for row in rows for e in row]
    if not flat:
        raise ValueError("plot_pipeline got no forward/backward events: pass simulate()'s result or each "
                         "rank's Recorder.events from run_schedule()")
    simulated = flat[0].get("clock") == "simulated"
    scale = 1.0 if simulated else 1e3
    t0 = min(e["start"] for e in flat)
    span = (max(e["end"] for e in flat) - t0) * scale
    n = len(rows)
    ax = _new_ax(ax, (10, 0.55 * n + 1.6))
    m = n_microbatches or (max(e.get("microbatch", 0) for e in flat) + 1)
    cmap = plt.get_cmap("tab20" if m > 10 else "tab10")
    height = 0.76
    for row, evs in enumerate(rows):
        y = n - 1 - row
        for e in evs:
            x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
            mb = e.get("microbatch", 0)
            style = _PIPE_STYLE[e["kind"]]
            ax.broken_barh([(x, w)], (y - height / 2, height), facecolors=cmap(mb % cmap.N),
                           alpha=style["alpha"], hatch=style["hatch"], edgecolors="black", linewidth=0.4)
            label = f"{mb}@s{e.get('stage', 0)}" if show_stage else f"{mb}"
            if w > 0.022 * span * len(label):
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)][::-1])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, span * 1.005)
    ax.set_xlabel(xlabel or ("time (simulated units)" if simulated else "time since the first action (ms)"))
    if title is None:
        title = f"{'simulated' if simulated else 'measured'}: bubble {bubble_fraction(rows):.1%}"
    ax.set_title(title, fontsize=10)
    kinds = [k for k in _PIPE_STYLE if any(e["kind"] == k for e in flat)]
    names = {"forward": "forward", "backward": "backward", "weight": "weight gradient (W)"}
    if "weight" in kinds:
        names["backward"] = "input gradient (B)"
    handles = [Patch(facecolor="white", edgecolor="black", hatch=_PIPE_STYLE[k]["hatch"], label=names[k])
               for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="colour = micro-batch", title_fontsize=8, frameon=False)
    return ax


def plot_rank_tensors(tensors, ax=None, title: str = "", highlight=None, fmt: str = "{:g}",
                      cmap: str = "Blues", vmin=None, vmax=None, chunk_bounds=None,
                      log: bool = False):
    """Draw every rank's 1-D tensor as one row of annotated cells (rank 0 on top).

    Args:
        tensors: ``tensors[r]`` is rank r's 1-D tensor/array/list (rows may differ in length).
        highlight: optional set of ``(rank, index)`` cells to outline in red (e.g. just received).
        fmt: how each value is written in its cell.
        chunk_bounds: optional ``[(start, end), ...]``: vertical lines between chunks.
        log: logarithmic colour scale (positive values spanning decades, e.g. sums of 10**rank).

    Returns:
        The Axes (x: element index, y: rank).
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    rows = [np.asarray(t, dtype=float).reshape(-1) for t in tensors]
    width = max((len(r) for r in rows), default=0)
    ax = _new_ax(ax, (0.6 * max(width, 1) + 1.5, 0.45 * len(rows) + 1))
    grid = np.full((len(rows), max(width, 1)), np.nan)
    for i, r in enumerate(rows):
        grid[i, :len(r)] = r
    finite = grid[np.isfinite(grid)]
    lo = vmin if vmin is not None else (finite.min() if finite.size else 0.0)
    hi = vmax if vmax is not None else (finite.max() if finite.size else 1.0)
    if log:
        from matplotlib.colors import LogNorm
        norm = LogNorm(vmin=max(lo, 1e-12), vmax=max(hi, lo * 10, 1e-11))
        ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        mid = float(np.sqrt(norm.vmin * norm.vmax))
    else:
        ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
        mid = (lo + hi) / 2
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8,
                    color="white" if v > mid and hi > lo else "black")
    for (i, j) in (highlight or ()):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    for a, _ in (chunk_bounds or [])[1:]:
        ax.axvline(a - 0.5, color="black", linewidth=1.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {i}" for i in range(len(rows))])
    ax.set_xticks(range(width))
    ax.set_xlabel("element index")
    ax.set_title(title)
    return ax


def plot_ring_steps(snapshots, chunk_bounds, fig=None, ncols: int = 4, fmt: str = "{:g}", log: bool = False,
                    suptitle: str = "Ring all-reduce, step by step (recorded in a real run)",
                    colorbar: str | None = None):
    """One panel per ring step from recorded snapshots: rows = ranks, columns = elements.

    Args:
        snapshots: list of ``(label, per_rank, received)``: ``per_rank[r]`` is rank r's flat buffer
            after the step; ``received`` the set of ``(rank, element)`` cells written in that step
            (outlined in red). The first entry is usually the input (``received`` empty).
        chunk_bounds: the chunk boundaries, drawn as vertical lines.
        colorbar: when given, one colour bar with this label for all panels (they share one
            colour scale: the minimum and maximum over all snapshots).

    Returns:
        The Figure.
    """
    import math

    import matplotlib.pyplot as plt
    import numpy as np

    n = len(snapshots)
    nrows = math.ceil(n / ncols)
    n_ranks = len(snapshots[0][1])
    width = len(np.asarray(snapshots[0][1][0]).reshape(-1))
    if fig is None:
        fig = plt.figure(figsize=(ncols * (0.55 * width + 1.2), nrows * (0.42 * n_ranks + 1.1)),
                         layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    all_vals = np.concatenate([np.asarray(t, dtype=float).reshape(-1) for _, pr, _ in snapshots for t in pr])
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        label, per_rank, received = snapshots[k]
        plot_rank_tensors(per_rank, ax=ax, title=label, highlight=received, fmt=fmt,
                          vmin=all_vals.min(), vmax=all_vals.max(), chunk_bounds=chunk_bounds, log=log)
        if k % ncols:
            ax.set_yticklabels([])
    if colorbar is not None:
        fig.colorbar(axes.flat[0].images[0], ax=axes, label=colorbar, shrink=0.9)
    fig.suptitle(suptitle)
    return fig


AXIS_COLORS = {"tp": "tab:green", "pp": "tab:blue", "dp": "tab:red"}


def plot_mesh(mesh, bytes_per_axis: dict | None = None, ax=None, title: str | None = None,
              unit: str = "KB per rank per step", scale: float = 1e3):
    """Draw a ``(dp, pp, tp)`` :class:`course_lib.mesh.Mesh`: one panel per data-parallel replica, a box
    per rank (pipeline stages as rows, tensor-parallel ranks as columns) and the links each axis uses
    (tp: inside a row, pp: between rows, dp: between replicas). ``bytes_per_axis`` (``{axis: bytes}``,
    e.g. measured with :class:`course_lib.mesh.CommMeter`) is written into the legend as
    ``bytes / scale`` in ``unit``."""
    import matplotlib.patches as mpatches
    import numpy as np

    if tuple(mesh.names) != ("dp", "pp", "tp"):
        raise ValueError(f"plot_mesh draws meshes with axes ('dp', 'pp', 'tp'), got {mesh.names}")
    dp, pp, tp = mesh.shape
    ax = _new_ax(ax, (min(2.2 + 1.6 * dp * tp, 12), 1.4 + 1.0 * pp))
    gap = 1.0
    pos = {}
    for r in range(mesh.size):
        c = mesh.coords(r)
        pos[r] = (c["dp"] * (tp + gap) + c["tp"], -c["pp"])
    for d in range(dp):
        x0 = d * (tp + gap) - 0.45
        ax.add_patch(mpatches.FancyBboxPatch((x0, -pp + 0.5), tp - 0.1, pp, boxstyle="round,pad=0.05",
                                             fc="0.96", ec="0.7", zorder=0))
        ax.text(x0 + (tp - 0.1) / 2, -pp + 0.42, f"replica dp={d}", ha="center", va="top", fontsize=9)

    def label(axis, text):
        if bytes_per_axis and axis in bytes_per_axis:
            return f"{text}: {bytes_per_axis[axis] / scale:,.1f} {unit}"
        return text

    drawn = set()
    for axis, text, style in (("tp", "tp group (all-reduces in every layer)", "-"),
                              ("pp", "pp group (activations and gradients)", "-"),
                              ("dp", "dp group (gradient all-reduce)", "--")):
        if mesh.degree(axis) == 1:
            continue
        for g in mesh.groups(axis):
            for a, b in zip(g[:-1], g[1:]):
                (xa, ya), (xb, yb) = pos[a], pos[b]
                kw = dict(color=AXIS_COLORS[axis], lw=2.2, ls=style, zorder=1)
                if axis == "dp":   # arc over the panels, so it does not run through other boxes
                    xs = np.linspace(xa, xb, 30)
                    lift = 0.34 + 0.16 * mesh.coords(a)["tp"]   # different heights: crossings stay legible
                    ys = ya + 0.25 + lift * np.sin(np.linspace(0, np.pi, 30))
                    ax.plot(xs, ys, label=None if axis in drawn else label(axis, text), **kw)
                else:
                    ax.plot([xa, xb], [ya, yb], label=None if axis in drawn else label(axis, text), **kw)
                drawn.add(axis)
    for r, (x, y) in pos.items():
        c = mesh.coords(r)
        ax.add_patch(mpatches.FancyBboxPatch((x - 0.27, y - 0.25), 0.54, 0.5, boxstyle="round,pad=0.02",
                                             fc="white", ec="k", zorder=2))
        ax.text(x, y + 0.07, f"{r}", ha="center", va="center", fontsize=11, weight="bold", zorder=3)
        ax.text(x, y - 0.14, f"s{c['pp']} t{c['tp']}", ha="center", va="center", fontsize=7, color="0.35", zorder=3)
    ax.set_xlim(-0.8, dp * (tp + gap) - gap - 0.2)
    ax.set_ylim(-pp + 0.1, 1.3 if dp > 1 else 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"{mesh}: rank (stage s, tensor-parallel rank t)")
    if drawn:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=1, fontsize=8, frameon=False)
    return ax


# One colour per rank, the same in every layout drawing (rank r: RANK_COLORS[r % 10]).
RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
_ZERO_STATES = (("parameters", "parameters"), ("gradients", "gradients"),
                ("optimizer_states", "optimizer states"))
_ZERO_TITLES = {0: "stage 0 (DDP): nothing sharded", 1: "stage 1 $P_{os}$: optimizer states",
                2: "stage 2 $P_{os+g}$: + gradients", 3: "stage 3 $P_{os+g+p}$: + parameters"}
_ZERO_XLABEL = "each unit's flat vector (elements)"
_DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _rank_color(r: int) -> str:
    return RANK_COLORS[r % len(RANK_COLORS)]


def _zero_ranks(layouts) -> list:
    """The descriptions sorted by rank, ``None`` (ranks outside the group) dropped, checked."""
    rows = sorted((d for d in layouts if d is not None), key=lambda d: d["rank"])
    if not rows:
        raise ValueError("plot_zero_layout got no layouts: pass every rank's ZeRO.shard_layout(), "
                         "e.g. cluster.run(fn) where fn returns z.shard_layout()")
    if len({d["stage"] for d in rows}) > 1 or len({d["world_size"] for d in rows}) > 1:
        raise ValueError("plot_zero_layout draws one ZeRO configuration at a time; got stages "
                         f"{sorted({d['stage'] for d in rows})} and world sizes "
                         f"{sorted({d['world_size'] for d in rows})}: use plot_zero_stages for several")
    if len({tuple(u["name"] for u in d["units"]) for d in rows}) > 1:
        raise ValueError("the ranks' layouts name different units: they come from different models")
    return rows


def _zero_legend_handles(ranks):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    return ([Patch(facecolor=_rank_color(r), edgecolor="black", label=f"held by rank {r}") for r in ranks]
            + [Patch(facecolor="white", edgecolor="black", hatch="////", label="padding to a multiple of N"),
               Patch(facecolor="0.93", edgecolor="0.6", label="not on this rank"),
               Line2D([], [], color="0.45", linestyle=":", label="the N equal slices")])


def plot_zero_layout(layouts, ax=None, title: str | None = None, legend: bool = True,
                     state_labels: bool = True):
    """Where ZeRO's model states live: for every rank, which part of each unit's flat vector it keeps.

    Args:
        layouts: ``layouts[r]`` is rank r's :meth:`course_lib.zero.ZeRO.shard_layout` (``None`` for a
            rank outside the group is skipped), all from one stage.
        title: the title (default: what the stage shards).
        legend: draw the legend (rank colours, padding, not held) below the axes.
        state_labels: write the states' names and dtypes as y tick labels (off for the right panels
            of :func:`plot_zero_stages`).

    Returns:
        The Axes. One band per rank (rank 0 on top), headed by the rank and the bytes it holds; in it one
        bar per model state (parameters, gradients, optimizer states). The x axis runs along the units'
        padded flat vectors, side by side; grey is the whole vector, the rank's colour what it holds,
        hatched the padding it holds, dotted lines the ``N`` equal slices. Every bar is a patch whose
        gid is ``"rank{r}:{state}:{unit}"`` (``":padding"`` and ``":full"`` for the padding and the
        grey outline), so tests can read the drawing back.
    """
    from matplotlib.patches import Rectangle

    rows = _zero_ranks(layouts)
    units = rows[0]["units"]
    total = sum(u["padded"] for u in units)
    gap = max(1.0, 0.08 * total)
    x0, x = [], 0.0
    for u in units:
        x0.append(x)
        x += u["padded"] + gap
    width = x - gap
    pitch, bar = 4.4, 0.78                      # a band per rank: header line + 3 bars
    ax = _new_ax(ax, (max(5.0, 0.05 * width + 3), 0.9 * len(rows) * pitch / 3 + 1.5))

    for i, d in enumerate(rows):
        r, top = d["rank"], i * pitch
        held = sum(u[key]["bytes"] for u in d["units"] for key, _ in _ZERO_STATES)
        ax.text(0, top + 0.3, f"rank {r}: {held:,} B", color=_rank_color(r), fontsize=9,
                weight="bold", va="center", ha="left")
        for k, (key, _) in enumerate(_ZERO_STATES):
            y = top + 1.1 + k
            for u, xu in zip(d["units"], x0):
                s = u[key]
                tag = f"rank{r}:{key}:{u['name']}"
                ax.add_patch(Rectangle((xu, y - bar / 2), u["padded"], bar, facecolor="0.93", edgecolor="0.6",
                                       linewidth=0.6, gid=tag + ":full"))
                lo, hi = s["lo"], min(s["hi"], u["numel"])
                if hi > lo:
                    ax.add_patch(Rectangle((xu + lo, y - bar / 2), hi - lo, bar, facecolor=_rank_color(r),
                                           edgecolor="black", linewidth=0.6, gid=tag))
                plo = max(s["lo"], u["numel"])
                if s["hi"] > plo:
                    ax.add_patch(Rectangle((xu + plo, y - bar / 2), s["hi"] - plo, bar, facecolor="white",
                                           edgecolor=_rank_color(r), hatch="////", linewidth=0.8,
                                           gid=tag + ":padding"))
    for u, xu in zip(units, x0):                # the N slices of every unit
        for j in range(1, rows[0]["world_size"]):
            ax.axvline(xu + j * u["shard_size"], color="0.45", linestyle=":", linewidth=0.7, zorder=0)

    ax.set_xlim(-0.01 * width, width * 1.01)
    ax.set_ylim(len(rows) * pitch - 0.2, -0.2)  # rank 0 on top
    ax.set_xticks([xu + u["padded"] / 2 for u, xu in zip(units, x0)],
                  [f"{u['name']}\n{u['numel']}" + (f" + {u['padded'] - u['numel']} pad" if u["padded"] > u["numel"] else "")
                   for u in units], fontsize=8)
    ax.set_xlabel(_ZERO_XLABEL)
    ys = [i * pitch + 1.1 + k for i in range(len(rows)) for k in range(len(_ZERO_STATES))]
    if state_labels:
        names = []
        for key, name in _ZERO_STATES:
            s = units[0][key]
            dt = _DTYPE_SHORT.get(s["dtype"], s["dtype"])
            names.append(f"{name} ({dt})" if s["copies"] == 1 else f"{name} ({s['copies']} × {dt})")
        ax.set_yticks(ys, names * len(rows), fontsize=8)
    else:
        ax.set_yticks(ys, [])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    stage = rows[0]["stage"]
    ax.set_title(title if title is not None else f"{_ZERO_TITLES.get(stage, f'stage {stage}')}, "
                                                 f"N = {rows[0]['world_size']}", fontsize=10)
    if legend:
        ax.legend(handles=_zero_legend_handles([d["rank"] for d in rows]), loc="upper center",
                  bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=8, frameon=False)
    return ax


def plot_zero_stages(layouts_per_stage, fig=None,
                     suptitle: str = "Where each rank's model states live, ZeRO stage by stage"):
    """Small multiples of :func:`plot_zero_layout`: one panel per stage, side by side, one legend.

    Args:
        layouts_per_stage: ``layouts_per_stage[i]`` is the list of every rank's
            :meth:`course_lib.zero.ZeRO.shard_layout` for the i-th panel (e.g. stages 0, 1, 2, 3).
        fig: a matplotlib Figure to draw on (a new one when ``None``).

    Returns:
        The Figure (its first ``len(layouts_per_stage)`` axes are the panels, left to right).
    """
    import matplotlib.pyplot as plt

    n = len(layouts_per_stage)
    if n == 0:
        raise ValueError("plot_zero_stages got no stages: pass [layouts of stage 0, of stage 1, ...]")
    n_ranks = len(_zero_ranks(layouts_per_stage[0]))
    if fig is None:
        fig = plt.figure(figsize=(min(3.3 * n + 1.8, 15), 1.25 * n_ranks + 2.0), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    for k, (ax, layouts) in enumerate(zip(axes, layouts_per_stage)):
        plot_zero_layout(layouts, ax=ax, legend=False, state_labels=k == 0)
    ranks = [d["rank"] for d in _zero_ranks(layouts_per_stage[0])]
    fig.legend(handles=_zero_legend_handles(ranks), loc="outside lower center", ncol=len(ranks) + 3,
               fontsize=9, frameon=False)
    fig.suptitle(suptitle)
    return fig


def _tp_ranks(layouts) -> list:
    """``layouts[r]``: rank r's layer descriptions (one dict or a sequence of them), checked; sorted by rank."""
    rows = []
    for d in layouts:
        if d is None:
            continue
        rows.append([d] if isinstance(d, dict) else list(d))
    if not rows or not rows[0]:
        raise ValueError("plot_tp_split got no layouts: pass every rank's [layer.shard_layout(), ...], "
                         "e.g. what cluster.run returns when each rank returns [fc.shard_layout(), "
                         "fc_proj.shard_layout()]")
    rows.sort(key=lambda ls: ls[0]["rank"])
    if len({len(ls) for ls in rows}) > 1:
        raise ValueError("every rank must describe the same layers; got "
                         + ", ".join(f"rank {ls[0]['rank']}: {len(ls)}" for ls in rows))
    for i in range(len(rows[0])):
        kinds = {(ls[i]["layer"], tuple(ls[i]["full_shape"])) for ls in rows}
        if len(kinds) > 1:
            raise ValueError(f"layer {i} differs between the ranks: {sorted(kinds)}")
        states = {ls[i]["input"]["state"] for ls in rows} | {ls[i]["output"]["state"] for ls in rows}
        if "sequence" in states or any(ls[i]["output"]["after"] == "reduce-scatter" for ls in rows):
            raise ValueError("plot_tp_split draws tensor parallelism without sequence parallelism: "
                             "build the layers with sequence_parallel=False")
    return rows


def plot_tp_split(layouts, fig=None, names: Sequence[str] | None = None, tokens: str = "b·s",
                  title: str = "Tensor parallelism: where each rank's weights and activations live"):
    """The full weight matrices of tensor-parallel linear layers with each rank's block coloured, and
    the activations they read and write, drawn as a chain of matrix products ``Y = X Wᵀ``.

    Args:
        layouts: ``layouts[r]`` is the list of rank r's ``shard_layout()`` dicts of the layers, in the
            order they run (e.g. ``[fc.shard_layout(), fc_proj.shard_layout()]`` of a
            :class:`course_lib.tensor_parallel.ParallelMLP`); ``None`` entries (ranks outside the
            group) are skipped.
        fig: a matplotlib Figure to draw on (a new one, sized to the drawing, when ``None``).
        names: the layers' names (default ``layer 0``, ``layer 1``, ...).
        tokens: how to label the activations' leading dimension (the tokens, drawn at a fixed height).

    Returns:
        The Figure (one Axes, in feature units: an ``n × m`` matrix is drawn ``m`` wide and ``n`` high).

    Each layer is drawn as its product: ``Wᵀ`` (``in × out``, the textbook ``Y = X W``) above the output,
    the input to the left of the output (a layer's output is the next layer's input). A weight block or
    an activation slice in a rank's colour is what that rank holds. A stack of cards is an activation
    every rank holds in full: solid when the copies are equal (replicated), hatched when each is a partial
    sum, which the collective on the arrow completes. Patches carry gids ``"{name}:W:rank{r}"``,
    ``"{name}:input:rank{r}"``, ``"{name}:output:rank{r}"`` and ``"{name}:after:rank{r}"`` (rectangles
    in data coordinates), so tests can read the drawing back.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = _tp_ranks(layouts)
    ranks = [ls[0]["rank"] for ls in rows]
    n_layers = len(rows[0])
    names = list(names) if names is not None else [f"layer {i}" for i in range(n_layers)]
    if len(names) != n_layers:
        raise ValueError(f"names has {len(names)} entries for {n_layers} layers")
    dims = [d for L in rows[0] for d in L["full_shape"]]
    b = max(3.0, 0.75 * min(dims))             # the tokens' height
    gap = max(2.0, 0.15 * max(dims))
    deck = 0.12 * b                             # offset between the cards of a stack
    stack = (len(ranks) - 1) * deck
    letters = iter("XYZUVW" + "".join(f"A{i}" for i in range(2 * n_layers)))
    drawn = []                                  # every rectangle, for the limits

    new_fig = fig is None
    if new_fig:
        fig = plt.figure(layout="constrained")
    ax = fig.add_subplot()

    def box(x, y, w, h, gid, **kw):
        kw = {"edgecolor": "black", "linewidth": 0.7, **kw}
        ax.add_patch(Rectangle((x, y), w, h, gid=gid, **kw))
        drawn.append((x, y, w, h))

    def activation(x, width, state, per_rank, gid, label):
        """An activation (tokens, width) at x; per_rank[r]: the feature ranges rank r holds."""
        if state in ("replicated", "partial"):
            for k in reversed(range(len(ranks))):   # rank 0 in front, the others peek out behind
                r = ranks[k]
                box(x + k * deck, k * deck, width, b, f"{gid}:rank{r}", facecolor=_rank_color(r),
                    hatch="////" if state == "partial" else None)
        else:                                   # split: one box, each rank's features in its colour
            box(x, 0, width, b, f"{gid}:full", facecolor="0.93", edgecolor="0.6")
            for r in ranks:
                for lo, hi in per_rank[r]:
                    box(x + lo, 0, hi - lo, b, f"{gid}:rank{r}", facecolor=_rank_color(r))
        ax.text(x + width / 2, -0.3 * gap, label, ha="center", va="top", fontsize=9)

    def signature(width, state, per_rank):
        return width, state, tuple(tuple(map(tuple, per_rank[r])) for r in ranks)

    x, prev = 0.0, None
    for i, name in enumerate(names):
        Ls = {ls[i]["rank"]: ls[i] for ls in rows}
        L0 = Ls[ranks[0]]
        out_f, in_f = L0["full_shape"]
        inp = {r: Ls[r]["input"]["features"] for r in ranks}
        if prev is None or prev[1:] != signature(in_f, L0["input"]["state"], inp):   # not the last output
            a = next(letters)
            mine = sum(hi - lo for lo, hi in inp[ranks[0]])
            label = (f"${a}$ ({tokens}, {in_f})\n" + ("on every rank" if L0["input"]["state"] == "replicated"
                                                       else f"rank r: ({tokens}, {mine})"))
            activation(x, in_f, L0["input"]["state"], inp, f"{name}:input", label)
            x += in_f + stack + gap
        # the weight, transposed (in x out) above the output: x = output feature, y from the top = input feature
        top = b + stack + gap + in_f
        box(x, top - in_f, out_f, in_f, f"{name}:W:full", facecolor="0.93", edgecolor="0.6")
        for r in ranks:
            for rlo, rhi in Ls[r]["rows"]:
                for clo, chi in Ls[r]["cols"]:
                    box(x + rlo, top - chi, rhi - rlo, chi - clo, f"{name}:W:rank{r}", facecolor=_rank_color(r))
                    if min(rhi - rlo, chi - clo) >= 6:
                        ax.text(x + (rlo + rhi) / 2, top - (clo + chi) / 2, f"rank {r}", ha="center",
                                va="center", fontsize=8, color="white", weight="bold")
        # where the blocks start and end: above W^T for the output features, left of it for the input ones
        row_cuts = sorted({v for r in ranks for rng in Ls[r]["rows"] for v in rng})
        col_cuts = sorted({v for r in ranks for rng in Ls[r]["cols"] for v in rng})
        if len(row_cuts) > 2:
            for v in row_cuts:
                ax.text(x + v, top + 0.1 * gap, str(v), ha="center", va="bottom", fontsize=7, color="0.35")
        if len(col_cuts) > 2:
            for v in col_cuts:
                ax.text(x - 0.1 * gap, top - v, str(v), ha="right", va="center", fontsize=7, color="0.35")
        kind = L0["layer"]
        how = "columns: output features" if kind == "column" else "rows: input features"
        ax.text(x + out_f / 2, top + 0.45 * gap + (1.5 if len(row_cuts) > 2 else 0), f"{name}: {kind} parallel\n"
                f"$W^T$ {in_f} × {out_f}, split by {how}", ha="center", va="bottom", fontsize=9)
        # the output
        out = {r: Ls[r]["output"]["features"] for r in ranks}
        state = L0["output"]["state"]
        a = next(letters)
        mine = sum(hi - lo for lo, hi in out[ranks[0]])
        label = {"partial": f"${a}_r$ ({tokens}, {out_f}) on rank r:\nits partial sum",
                 "split": f"${a}$ ({tokens}, {out_f})\nrank r: ({tokens}, {mine})"}.get(
                     state, f"${a}$ ({tokens}, {out_f})\non every rank")
        activation(x, out_f, state, out, f"{name}:output", label)
        x += out_f + stack
        prev = (a, *signature(out_f, state, out))
        after = L0["output"]["after"]
        if after:
            length = max(2.5 * gap, 12)
            ax.annotate("", xy=(x + length - 0.15 * gap, b / 2), xytext=(x + 0.15 * gap, b / 2),
                        arrowprops=dict(arrowstyle="-|>", color="black", lw=1.3))
            ax.text(x + length / 2, b / 2 + 0.12 * b, after, ha="center", va="bottom", fontsize=9, weight="bold")
            x += length
            full = {r: [(0, out_f)] for r in ranks}
            what = (" + ".join(f"${a}_{r}$" for r in ranks) if len(ranks) <= 4 else rf"$\sum_r {a}_r$")
            activation(x, out_f, "replicated", full, f"{name}:after",
                       f"${a}$ = {what}\n({tokens}, {out_f}) on every rank" if state == "partial"
                       else f"${a}$ ({tokens}, {out_f})\non every rank")
            x += out_f + stack
            prev = (a, *signature(out_f, "replicated", full))
        x += gap

    x_lo = min(p[0] for p in drawn) - 1
    x_hi = max(p[0] + p[2] for p in drawn) + 1
    y_lo, y_hi = -0.3 * gap - 6, max(p[1] + p[3] for p in drawn) + 0.45 * gap + 6.5
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title + "\n(each product: the input on the left, $W^T$ above, the output below $W^T$)",
                 fontsize=11)
    handles = [Patch(facecolor=_rank_color(r), edgecolor="black", label=f"rank {r}") for r in ranks]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="////", label="partial sum")]
    ax.legend(handles=handles, loc="upper left", fontsize=8.5, frameon=False,
              title="stacked cards: one copy per rank", title_fontsize=8.5, alignment="left")
    if new_fig:                                 # size the figure to the drawing's proportions
        w = min(13.0, max(7.0, 0.16 * (x_hi - x_lo)))
        fig.set_size_inches(w, w * (y_hi - y_lo) / (x_hi - x_lo) + 0.6)
    return fig


def _ring_tile_ranks(steps_per_rank) -> list[tuple[int, list[dict]]]:
    """``[(rank, steps sorted by step)]`` of :func:`plot_ring_tiles`' input, checked."""
    rows = []
    for r, steps in enumerate(steps_per_rank):
        if steps is None:
            continue
        steps = sorted(steps, key=lambda d: d["step"])
        numbers = [d["step"] for d in steps]
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"rank {r} reports steps {numbers}: one entry per ring step (pass the forward's "
                             "'compute' events, e.g. those named 'ring_attention/step i', not the backward's too)")
        for d in steps:
            area = sum((q_hi - q_lo) * (k_hi - k_lo) for q_lo, q_hi, k_lo, k_hi in d["tiles"])
            if "pairs" in d and d["pairs"] != area:
                raise ValueError(f"rank {r}, step {d['step']}: the tiles cover {area} (query, key) pairs but the "
                                 f"step reports pairs={d['pairs']}: the tiles and the count come from different runs")
        rows.append((r, steps))
    if not rows:
        raise ValueError("plot_ring_tiles got no steps: pass every rank's list of steps, e.g. "
                         "[context_parallel.ring_tiles(s, N, r, causal=True) for r in range(N)]")
    return rows


def plot_ring_tiles(steps_per_rank, s: int, axes=None, causal: bool = True, row_label: str | None = None,
                    legend: bool = True,
                    title: str = "Ring attention: the (query, key) tiles each rank computes, by ring step"):
    """Which (query, key) pairs each rank of ring attention computes, and at which ring step: one
    ``s × s`` grid per rank (queries down, keys across), each computed tile filled with its step's colour.

    Args:
        steps_per_rank: ``steps_per_rank[r]`` is rank r's list of steps, each a dict with ``"step"`` and
            ``"tiles"`` (``[(q_lo, q_hi, k_lo, k_hi), ...]`` in sequence positions) and optionally
            ``"pairs"`` (checked against the tiles' area): what
            :func:`course_lib.context_parallel.ring_tiles` returns, or the forward's ``"compute"``
            trace events of :func:`course_lib.context_parallel.ring_attention`. ``None`` entries skipped.
        s: the sequence length.
        axes: one Axes per rank to draw on (a row of a larger figure); default: a new figure.
        causal: shade the pairs whose key comes after its query (masked: a tile that straddles the
            diagonal is computed whole, then masked) and draw the diagonal.
        row_label: written before "query position" on the first panel's y label (e.g. the layout).
        legend: add the steps' legend below the figure.

    Returns:
        The Figure. Light grey rows are the rank's own queries; each tile is a rectangle (gid
        ``"rank{r}:step{i}:q{q_lo}-{q_hi}:k{k_lo}-{k_hi}"``, in (key, query) data coordinates); each
        panel's title gives the rank and the pairs it computed, so tests can read the drawing back.
    """
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Polygon, Rectangle

    rows = _ring_tile_ranks(steps_per_rank)
    n_steps = max(len(steps) for _, steps in rows)
    cmap = matplotlib.colormaps["viridis"]
    colors = [cmap(0.85 * i / max(1, n_steps - 1)) for i in range(n_steps)]
    if axes is None:
        fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows) + 0.6, 3.5), layout="constrained",
                                 squeeze=False)
        axes = list(axes[0])
        fig.suptitle(title)
    axes = list(axes)
    if len(axes) != len(rows):
        raise ValueError(f"got {len(axes)} axes for {len(rows)} ranks: pass one Axes per rank")
    fig = axes[0].figure
    tick = max(1, s // (2 * len(rows)))
    for k, (ax, (r, steps)) in enumerate(zip(axes, rows)):
        mine = sorted({(q_lo, q_hi) for d in steps for q_lo, q_hi, _, _ in d["tiles"]})
        for q_lo, q_hi in mine:                     # this rank's queries: the rows it owns
            ax.add_patch(Rectangle((0, q_lo), s, q_hi - q_lo, facecolor="0.92", edgecolor="none",
                                   gid=f"rank{r}:rows:{q_lo}-{q_hi}", zorder=0))
        pairs = 0
        for d in steps:
            i = d["step"]
            for q_lo, q_hi, k_lo, k_hi in d["tiles"]:
                ax.add_patch(Rectangle((k_lo, q_lo), k_hi - k_lo, q_hi - q_lo, facecolor=colors[i % n_steps],
                                       edgecolor="white", linewidth=0.8, zorder=1,
                                       gid=f"rank{r}:step{i}:q{q_lo}-{q_hi}:k{k_lo}-{k_hi}"))
                pairs += (q_hi - q_lo) * (k_hi - k_lo)
        if causal:                                  # key > query: above the diagonal (queries run down)
            ax.add_patch(Polygon([(0, 0), (s, 0), (s, s)], closed=True, facecolor="none", edgecolor="0.55",
                                 hatch="////", linewidth=0, zorder=2, gid=f"rank{r}:masked"))
            ax.plot([0, s], [0, s], color="black", linewidth=0.8, zorder=3)
        ax.set_xlim(0, s)
        ax.set_ylim(s, 0)
        ax.set_aspect("equal")
        ax.set_xticks(range(0, s + 1, tick))
        ax.set_yticks(range(0, s + 1, tick))
        ax.tick_params(labelsize=7)
        ax.set_title(f"rank {r}: {pairs:,} pairs", fontsize=10)
        ax.set_xlabel("key position")
        if k == 0:
            ax.set_ylabel(f"{row_label}\nquery position" if row_label else "query position")
    if legend:
        handles = [Patch(facecolor=c, edgecolor="white", label=f"step {i}" + (" (own K/V)" if i == 0 else ""))
                   for i, c in enumerate(colors)]
        handles.append(Patch(facecolor="0.92", label="the rank's queries"))
        if causal:
            handles += [Patch(facecolor="white", edgecolor="0.55", hatch="////", label="key after query: masked"),
                        Line2D([], [], color="black", linewidth=0.8, label="key = query")]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8,
                   frameon=False)
    return fig


def plot_all_to_all(rows, ax=None, title: str | None = None, block: int | None = None,
                    unit: str = "token choices", min_label: int = 1):
    """Who sends how many rows to whom in one all-to-all: ``rows[i][j]`` rows go from rank ``i`` (left
    column) to rank ``j`` (right column), one band per pair, coloured by the sender; a rank's block to
    itself stays on the rank but is drawn too. ``rows`` is what the layers report (each rank's
    ``DroplessMoE.last["sent_rows"]``, in rank order), so the drawing is the exchange that ran.

    ``block``: a fixed-size exchange (``ExpertParallelMoE``: ``E/n * C`` slots per pair): each band is
    ``block`` rows tall whatever was sent, its empty slots hatched (padding, sent all the same) and rows
    beyond it marked as dropped. Returns the ``Axes``."""
    from matplotlib.patches import Patch, Polygon

    n = len(rows)
    if n == 0 or any(len(r) != n for r in rows):
        raise ValueError(f"rows must be a square list (rows[i][j]: rows from rank i to rank j); got {rows!r:.80}")
    ax = _new_ax(ax, (6, 4.5))
    size = [[block if block is not None else rows[i][j] for j in range(n)] for i in range(n)]
    gap = 0.08 * max(1, max(sum(r) for r in size))
    left, right, x0, x1 = [], [], 0.12, 0.88
    y = 0.0
    for i in range(n):                       # left: sender i's blocks for 0..n-1, top to bottom
        left.append([]); top = y
        for j in range(n):
            left[i].append((y, y + size[i][j])); y += size[i][j]
        ax.add_patch(Polygon([(0, top), (x0, top), (x0, y), (0, y)], closed=True, facecolor=_rank_color(i),
                             edgecolor="black"))
        real_i = sum(min(rows[i][j], size[i][j]) for j in range(n))
        pad_i = sum(size[i]) - real_i
        ax.text(-0.02, (top + y) / 2, f"rank {i}\nsends {real_i}" + (f"\n+ {pad_i} padding" if pad_i else ""),
                ha="right", va="center", fontsize=8)
        y += gap
    y_end = y
    y = 0.0
    for j in range(n):                       # right: receiver j's blocks from 0..n-1
        right.append([]); top = y
        for i in range(n):
            right[j].append((y, y + size[i][j])); y += size[i][j]
        ax.add_patch(Polygon([(x1, top), (1, top), (1, y), (x1, y)], closed=True, facecolor="0.92",
                             edgecolor="black"))
        ax.text(1.02, (top + y) / 2, f"rank {j}\nreceives {sum(min(rows[i][j], size[i][j]) for i in range(n))}", ha="left",
                va="center", fontsize=8)
        y += gap
    dropped = 0
    for i in range(n):
        for j in range(n):
            (a0, a1), (b0, b1) = left[i][j], right[j][i]
            real = min(rows[i][j], size[i][j])
            dropped += rows[i][j] - real
            band = lambda u, v, **kw: ax.add_patch(Polygon(
                [(x0, a0 + u), (x1, b0 + u), (x1, b0 + v), (x0, a0 + v)], closed=True, **kw))
            if real:
                band(0, real, facecolor=_rank_color(i), alpha=0.55 if i != j else 0.25, edgecolor="none")
            if size[i][j] > real:
                band(real, size[i][j], facecolor="white", hatch="////", edgecolor="0.5", linewidth=0.3)
            if rows[i][j] >= min_label and (a1 - a0) > 0.03 * y_end:
                ax.text(x0 + 0.06, (a0 + a1) / 2, f"{rows[i][j]}" + (" (stays)" if i == j else ""),
                        ha="left", va="center", fontsize=7)
    ax.set_xlim(-0.32, 1.32); ax.set_ylim(y_end, -gap / 2)
    ax.set_xticks([x0 / 2, (1 + x1) / 2], ["sender", "receiver"])
    ax.set_ylabel(f"{unit} (rows of h values)")
    handles = [Patch(facecolor=_rank_color(i), alpha=0.55, label=f"from rank {i}") for i in range(n)]
    if block is not None:
        handles.append(Patch(facecolor="white", hatch="////", edgecolor="0.5", label="padding (sent too)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, -0.02), frameon=False)
    total = sum(sum(r) for r in size) - sum(size[i][i] for i in range(n))
    ax.set_title(title or (f"all-to-all: {total} rows cross between ranks"
                           + (f", {dropped} dropped" if dropped else "")), fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return ax

