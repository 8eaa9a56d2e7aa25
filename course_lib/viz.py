"""Plots used across the notebooks: per-rank timelines (from :mod:`course_lib.trace`) and others.

Every function draws on a matplotlib ``Axes`` (a new one when ``ax`` is ``None``) and returns it,
with a title, axis labels that carry units, and a legend.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["plot_timeline", "KIND_COLORS"]

# Fixed colours for the two conventional kinds, so compute/comm look the same in every notebook.
KIND_COLORS = {"compute": "tab:blue", "comm": "tab:orange"}
_EXTRA_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                 "tab:cyan", "tab:gray"]


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
    for e in all_events:  # any other kind gets the next free colour, in order of appearance
        if e["kind"] not in colors:
            colors[e["kind"]] = _EXTRA_COLORS[(len(colors) - 2) % len(_EXTRA_COLORS)]

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
