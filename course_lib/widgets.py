"""Interactive (ipywidgets) tools for the notebooks.

:func:`progress` -- a progress bar for notebook loops: a live bar in Jupyter, plain text elsewhere,
and one readable line of static text in the saved output once the loop ends (so a committed
notebook shows ``training: 200/200 steps in 3.1 s`` on GitHub, not ``HBox(children=...)``).

:class:`MemoryCalculator` -- training memory per device (parameters, gradients, optimizer states,
activations) for a choice of model size, batch, precision, optimizer, ZeRO stage and parallel
degrees, drawn as stacked bars for ZeRO stages 0-3 side by side. The numbers come from
:func:`course_lib.estimate.training_memory`; the picture from
:func:`course_lib.viz_memory.plot_memory_breakdown`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

import matplotlib.pyplot as plt

from course_lib import estimate
from course_lib.viz_memory import plot_memory_breakdown

_POW2 = [2 ** i for i in range(0, 15)]


def _in_jupyter_kernel() -> bool:
    """True when running inside an IPython kernel (Jupyter, Colab, nbclient), not a terminal."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _progress_text(desc: str, n: int, total: int | None, unit: str, elapsed: float,
                   done: bool) -> str:
    count = f"{n}/{total}" if total is not None else f"{n}"
    if done:
        return f"{desc}: {count} {unit} in {elapsed:.1f} s"
    return f"{desc}: {count} {unit} ({elapsed:.1f} s)"


def progress(iterable: Iterable, desc: str, total: int | None = None, *, unit: str = "it",
             min_interval: float = 0.1) -> Iterator:
    """Iterate over ``iterable`` showing a progress bar; yields the items unchanged.

    ``for step in progress(range(200), desc="training", unit="steps"): ...``

    - In a Jupyter kernel (JupyterLab, Colab, VS Code, nbclient/nbconvert): a live HTML
      ``<progress>`` bar with the count and elapsed time, updated through a display handle; when
      the loop ends (or stops early, by ``break`` or an exception) that output is replaced by one
      line of ``text/plain`` such as ``training: 200/200 steps in 3.1 s``. The saved notebook
      holds only that line: it renders on GitHub and in an untrusted notebook, and no widget model
      (or widget state) is involved.
    - Elsewhere (a script, a terminal): the line is redrawn in place on a terminal's stderr and
      printed once, finished, to stderr.

    ``total`` defaults to ``len(iterable)`` when it has one (otherwise the count is shown without a
    total). Redraws happen at most every ``min_interval`` seconds, so a fast loop is not slowed down
    by display messages.
    """
    if not isinstance(desc, str) or not desc:
        raise ValueError(f"desc must be a non-empty string naming the loop (e.g. desc='training'), "
                         f"got {desc!r}")
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if total is not None and (not isinstance(total, int) or total < 0):
        raise ValueError(f"total must be a non-negative int (the number of items), got {total!r}")
    if min_interval < 0:
        raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval!r}")
    return _progress_iter(iterable, desc, total, unit, min_interval)


def _progress_iter(iterable, desc, total, unit, min_interval):
    t0 = time.perf_counter()
    n = 0
    view = _ProgressView(desc, total, unit)
    last = t0
    try:
        for item in iterable:
            yield item
            n += 1
            now = time.perf_counter()
            if now - last >= min_interval:
                view.show(n, now - t0)
                last = now
    finally:
        view.finish(n, time.perf_counter() - t0, complete=total is None or n >= total)


class _ProgressView:
    """Where a :func:`progress` loop is drawn: a Jupyter display handle, or a text stream."""

    def __init__(self, desc: str, total: int | None, unit: str):
        self.desc, self.total, self.unit = desc, total, unit
        self.handle = None
        self.stream = sys.stderr
        self.live_stream = False
        if _in_jupyter_kernel():
            from IPython.display import display

            self.handle = display(self._bundle(0, 0.0), raw=True, display_id=True)
        else:
            self.live_stream = bool(getattr(self.stream, "isatty", lambda: False)())

    def _bundle(self, n: int, elapsed: float) -> dict:
        import html

        text = _progress_text(self.desc, n, self.total, self.unit, elapsed, done=False)
        if self.total:  # an HTML <progress> bar; no widget model, so nothing is left in the notebook
            bar = f'<progress value="{min(n, self.total)}" max="{self.total}" style="width:240px"></progress>'
        else:  # unknown length (or empty): an indeterminate bar
            bar = '<progress style="width:240px"></progress>'
        return {"text/html": f"{bar} <code>{html.escape(text)}</code>", "text/plain": text}

    def show(self, n: int, elapsed: float) -> None:
        if self.handle is not None:
            self.handle.update(self._bundle(n, elapsed), raw=True)
        elif self.live_stream:
            self.stream.write("\r" + _progress_text(self.desc, n, self.total, self.unit, elapsed,
                                                     done=False))
            self.stream.flush()

    def finish(self, n: int, elapsed: float, complete: bool) -> None:
        text = _progress_text(self.desc, n, self.total, self.unit, elapsed, done=True)
        if not complete:
            text += " (stopped early)"
        if self.handle is not None:
            # replace the live bar by the static line: this is what the saved notebook keeps
            self.handle.update({"text/plain": text}, raw=True)
        else:
            self.stream.write(("\r" if self.live_stream else "") + text + "\n")
            self.stream.flush()


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
