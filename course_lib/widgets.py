"""Interactive (ipywidgets) tools for the notebooks.

:class:`MemoryCalculator` -- training memory per device (parameters, gradients, optimizer states,
activations) for a choice of model size, batch, precision, optimizer, ZeRO stage and parallel
degrees, drawn as stacked bars for ZeRO stages 0-3 side by side. The numbers come from
:func:`course_lib.estimate.training_memory`; the picture from
:func:`course_lib.viz_memory.plot_memory_breakdown`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from course_lib import estimate
from course_lib.viz_memory import plot_memory_breakdown

_POW2 = [2 ** i for i in range(0, 15)]


class MemoryCalculator:
    """An ipywidgets memory calculator.

    ``calc = MemoryCalculator(); display(calc.widget)`` shows the controls and the figure. Moving a
    control calls :meth:`update`, which can also be called directly (tests, static notebooks) with
    keyword arguments named like the controls; it returns the per-device breakdown of the selected
    ZeRO stage (bytes) and keeps the figure in ``self.figure``.
    """

    def __init__(self, n_params_billion: float = 7.0, micro_batch: int = 1, seq: int = 4096,
                 hidden: int = 4096, n_layer: int = 32, heads: int = 32, precision: str = "mixed",
                 optimizer: str = "adam", zero_stage: int = 0, dp_degree: int = 8, tp: int = 1,
                 sequence_parallel: bool = False, recompute: str = "none",
                 device_gb: float = 80.0):
        import ipywidgets as W

        style = {"description_width": "150px"}
        lay = W.Layout(width="420px")
        self.device_gb = device_gb
        self.controls = {
            "n_params_billion": W.FloatLogSlider(value=n_params_billion, base=10, min=-1, max=3,
                                                 step=0.05, description="parameters (billions)"),
            "micro_batch": W.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch b"),
            "seq": W.Dropdown(options=_POW2[6:], value=seq, description="sequence s"),
            "hidden": W.Dropdown(options=[256 * i for i in range(1, 81)], value=hidden,
                                 description="hidden size h"),
            "n_layer": W.IntSlider(value=n_layer, min=1, max=128, description="layers L"),
            "heads": W.Dropdown(options=[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 96, 128],
                                value=heads, description="heads a"),
            "precision": W.Dropdown(options=list(estimate.PRECISIONS), value=precision,
                                    description="precision"),
            "optimizer": W.Dropdown(options=list(estimate.OPTIMIZERS), value=optimizer,
                                    description="optimizer"),
            "zero_stage": W.Dropdown(options=[0, 1, 2, 3], value=zero_stage, description="ZeRO stage"),
            "dp_degree": W.Dropdown(options=_POW2[:13], value=dp_degree,
                                    description="data-parallel N"),
            "tp": W.Dropdown(options=[1, 2, 4, 8], value=tp, description="tensor-parallel t"),
            "sequence_parallel": W.Checkbox(value=sequence_parallel, description="sequence parallel"),
            "recompute": W.Dropdown(options=list(estimate.RECOMPUTE), value=recompute,
                                    description="recompute"),
        }
        for c in self.controls.values():
            c.style, c.layout = style, lay
        self.output = W.Output()
        self.figure = None
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        self.widget = W.HBox([W.VBox(list(self.controls.values())), self.output])
        self.update()

    def values(self) -> dict:
        """The current value of every control, by name."""
        return {k: c.value for k, c in self.controls.items()}

    def breakdowns(self, **values) -> dict:
        """Per-device breakdown (bytes) for ZeRO stages 0-3 at the given (or current) settings."""
        v = {**self.values(), **values}
        kw = dict(n_params=v["n_params_billion"] * 1e9, n_layer=v["n_layer"], seq=v["seq"],
                  micro_batch=v["micro_batch"], hidden=v["hidden"], heads=v["heads"],
                  precision=v["precision"], optimizer=v["optimizer"], dp_degree=v["dp_degree"],
                  tp=v["tp"], sequence_parallel=v["sequence_parallel"], recompute=v["recompute"])
        return {f"ZeRO-{s}": estimate.training_memory(zero_stage=s, **kw) for s in range(4)}

    def update(self, **values):
        """Set the given controls (if any), recompute and redraw; return the selected breakdown.

        Returns ``None`` (and shows the reason in place of the figure) when the settings are
        invalid, e.g. a tensor-parallel degree that does not divide the heads.
        """
        for k, v in values.items():
            if k not in self.controls:
                raise ValueError(f"unknown setting {k!r}; choose from {sorted(self.controls)}")
        # Setting a control fires _on_change; hold redraws until all are set.
        self._hold = True
        try:
            for k, v in values.items():
                self.controls[k].value = v
        finally:
            self._hold = False
        return self._redraw()

    def _redraw(self):
        from IPython.display import display

        v = self.values()
        try:
            bars = self.breakdowns()
        except ValueError as err:
            self.figure = None
            with self.output:
                self.output.clear_output(wait=True)
                print(f"Invalid settings: {err}")
            return None
        selected = f"ZeRO-{v['zero_stage']}"
        labels = {k: (f"{k}\n(selected)" if k == selected else k) for k in bars}
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        plot_memory_breakdown({labels[k]: b for k, b in bars.items()}, ax=ax,
                              device_bytes=self.device_gb * estimate.GB,
                              title=(f"{v['n_params_billion']:.3g}B params, {v['precision']} "
                                     f"{v['optimizer']}, N={v['dp_degree']}, t={v['tp']}"))
        fig.tight_layout()
        self.figure = fig
        total = sum(bars[selected].values())
        with self.output:
            self.output.clear_output(wait=True)
            display(fig)
            fits = "fits" if total <= self.device_gb * estimate.GB else "does NOT fit"
            print(f"{selected}: {total / estimate.GB:.1f} GB per device -> {fits} in "
                  f"{self.device_gb:.0f} GB")
        plt.close(fig)
        return bars[selected]

    def _on_change(self, _change) -> None:
        # a control changed: redraw, unless update() is setting several controls at once
        if not getattr(self, "_hold", False):
            self._redraw()


def memory_calculator(**defaults) -> MemoryCalculator:
    """Build a :class:`MemoryCalculator` and display it; returns it (its ``update`` is callable)."""
    from IPython.display import display

    calc = MemoryCalculator(**defaults)
    display(calc.widget)
    return calc
