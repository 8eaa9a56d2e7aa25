"""Plots of training-memory breakdowns (used by notebook 01 and :mod:`course_lib.widgets`)."""

from __future__ import annotations

import matplotlib.pyplot as plt

GB = 1e9

#: drawing order (bottom to top) and colours of the memory components
COMPONENTS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_states": "#55a868",
    "activations": "#c44e52",
}


def plot_memory_breakdown(breakdowns: dict, ax=None, device_bytes: float | None = None,
                          title: str = "Training memory per device", device_label: str = "GPU memory"):
    """Stacked bars of memory per component, one bar per configuration.

    ``breakdowns`` maps a bar label to a dict of bytes with keys among :data:`COMPONENTS`
    (``parameters``, ``gradients``, ``optimizer_states``, ``activations``), e.g. the output of
    :func:`course_lib.estimate.training_memory`. ``device_bytes`` draws a dashed line at the device
    capacity. Bars are in GB (1e9 bytes), with the total written on top. Returns the Axes.
    """
    if not breakdowns:
        raise ValueError("breakdowns is empty: pass {label: {component: bytes}}")
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(breakdowns) + 2), 4))
    labels = list(breakdowns)
    bottoms = [0.0] * len(labels)
    for comp, colour in COMPONENTS.items():
        heights = [breakdowns[k].get(comp, 0.0) / GB for k in labels]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=comp.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:.3g} GB", (i, total), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points", zorder=4,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.8))
    if device_bytes is not None:
        ax.axhline(device_bytes / GB, color="black", linestyle="--", linewidth=1,
                   label=f"{device_label} ({device_bytes / GB:.0f} GB)")
    ax.set_ylabel("memory per device (GB, 1e9 bytes)")
    ax.set_title(title)
    ax.set_ylim(0, max(bottoms + [device_bytes / GB if device_bytes else 0]) * 1.15)
    ax.legend(fontsize=8, loc="upper right")
    ax.tick_params(axis="x", labelsize=8)
    return ax
