"""Plots used across the notebooks: per-rank timelines (from :mod:`course_lib.trace`) and others, and
:func:`show`, which prints the source of the library code a notebook discusses.

Every plotting function draws on a matplotlib ``Axes`` (a new one when ``ax`` is ``None``) and returns it,
with a title, axis labels that carry units, and a legend.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["show", "plot_timeline", "plot_pipeline", "plot_mesh", "plot_rank_tensors", "plot_ring_steps", "KIND_COLORS"]

# Fixed colours for the kinds of course_lib.trace's vocabulary, so that compute, communication and a
# pipeline's forwards and backwards look the same in every notebook whichever kind comes first.
KIND_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "forward": "tab:red", "backward": "tab:purple",
               "weight": "tab:brown"}
_EXTRA_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                 "tab:cyan", "tab:gray"]


def show(*objs, start: str | None = None) -> None:
    """Print the source of a few short library functions or classes, one after another; with
    ``start``, each from its first line containing ``start`` (to skip a long docstring)."""
    import inspect

    parts = []
    for obj in objs:
        src = inspect.getsource(obj)
        if start is not None:
            if start not in src:
                raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)}")
            src = src[src.index(start):]
        parts.append(src)
    print("\n".join(parts))


def _new_ax(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt
        # constrained layout keeps the x label inside the figure when it is saved or shown
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def plot_timeline(events_per_rank: Sequence[Sequence[dict]], ax=None,
                  title: str = "Per-rank timeline (compute vs communication)",
                  label_events: bool = False, min_label_frac: float = 0.06):
    """Draw one horizontal row per rank with a bar per event, coloured by ``kind``.

    Args:
        events_per_rank: ``events_per_rank[r]`` is rank r's ``Recorder.events`` (list of dicts with
            ``kind, name, start, end``; start/end in seconds on the shared wall-clock scale, see
            :mod:`course_lib.trace`).
        ax: matplotlib Axes to draw on; a new figure when ``None``.
        title: the plot title.
        label_events: write each event's name inside its bar when the bar is wide enough
            (wider than ``min_label_frac`` of the time axis).

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

    colors = dict(KIND_COLORS)
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
