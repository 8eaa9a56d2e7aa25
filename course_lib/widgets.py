"""Interactive (ipywidgets) tools for the notebooks.

:func:`progress` -- a progress bar for notebook loops: a live bar in Jupyter, plain text elsewhere,
and one readable line of static text in the saved output once the loop ends (so a committed
notebook shows ``training: 200/200 steps in 3.1 s`` on GitHub, not ``HBox(children=...)``).

:class:`MemoryCalculator` (shown by :func:`memory_calculator`) -- training memory per device (parameters, gradients, optimizer states,
activations) for a choice of model size, batch, precision, optimizer, ZeRO stage and parallel
degrees, drawn as stacked bars for ZeRO stages 0-3 side by side. The numbers come from
:func:`course_lib.estimate.training_memory`; the picture from
:func:`course_lib.viz_memory.plot_memory_breakdown`.

:class:`StepThrough` (:func:`step_through`, :func:`ring_step_through`) -- a slider over the states of an
algorithm, one picture per state.

:class:`PipelineExplorer` (shown by :func:`pipeline_explorer`) -- a pipeline schedule's simulated
timeline and bubble for a choice of schedule, ranks and micro-batches (notebook 08).
"""

from __future__ import annotations

import base64
import io
import numbers
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import matplotlib.pyplot as plt

from course_lib import compat, estimate
from course_lib.viz_memory import plot_memory_breakdown

_POW2 = [2 ** i for i in range(0, 15)]

#: parameter counts (billions) on the calculator's slider: well-known model sizes (GPT-2 small
#: and medium, GPT-3 and Llama family sizes, Gopher 280B, PaLM 540B) and round values between them.
#: A value asked for that is not in the list is added to it, so the slider holds it exactly.
PARAM_SIZES_BILLION = (0.1, 0.124, 0.25, 0.355, 0.5, 0.75, 1.0, 1.3, 2.0, 2.7, 3.0, 5.0, 6.7, 7.0,
                       7.5, 8.0, 10.0, 13.0, 20.0, 30.0, 34.0, 40.0, 65.0, 70.0, 100.0, 175.0,
                       280.0, 405.0, 540.0, 1000.0)


def _figure_png(fig) -> str:
    """The figure as a base64 PNG string (what a notebook stores under ``image/png``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _StaticFallback:
    """Mixin: display ``self.widget`` with an ``image/png`` of ``self.figure`` and a readable
    ``text/plain`` (:meth:`static_text`) next to the widget view, for viewers without widgets."""

    widget = None
    figure = None

    def static_text(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = compat.widget_mimebundle(self.widget)
        bundle["text/plain"] = self.static_text()
        if self.figure is not None:
            bundle["image/png"] = _figure_png(self.figure)
        return bundle


class _ControlPanel(_StaticFallback):
    """Mixin for widgets with named ``controls``: read them, set several at once with one redraw, and
    redraw (``self._redraw()``) when a user moves one."""

    controls: dict = {}
    _hold = False

    def values(self) -> dict:
        """The current value of every control, by name."""
        return {k: c.value for k, c in self.controls.items()}

    def _set_and_redraw(self, values: dict, convert: Callable = lambda k, v: v):
        for k in values:
            if k not in self.controls:
                raise ValueError(f"unknown setting {k!r}; choose from {sorted(self.controls)}")
        # Setting a control fires _on_change; hold redraws until all are set.
        self._hold = True
        try:
            for k, v in values.items():
                self.controls[k].value = convert(k, v)
        finally:
            self._hold = False
        return self._redraw()

    def _on_change(self, _change) -> None:
        if not self._hold:
            self._redraw()


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


class MemoryCalculator(_ControlPanel):
    """An ipywidgets memory calculator.

    ``calc = MemoryCalculator(); display(calc)`` shows the controls and the figure (``display(calc)``
    also stores the static fallback: the figure as a PNG and :meth:`static_text`; ``calc.widget`` is
    the bare widget). Moving a control redraws; :meth:`update` can also be called directly (tests,
    later cells) with keyword arguments named like the controls; it returns the per-device
    breakdown of the selected ZeRO stage (bytes) and keeps the figure in ``self.figure``.

    The parameter count is a slider over :data:`PARAM_SIZES_BILLION` (plus any value asked for),
    so the value set is the value shown: a log slider would snap 13.0 to 10**1.1 = 12.6.
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
            "n_params_billion": W.SelectionSlider(
                options=_size_options(PARAM_SIZES_BILLION, n_params_billion),
                value=float(n_params_billion), description="parameters (billions)"),
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
        # The controls keep their width (the figure would otherwise squeeze them and cut the sliders'
        # readouts); the figure takes what is left.
        controls = W.VBox(list(self.controls.values()), layout=W.Layout(flex="0 0 auto", min_width="440px"))
        self.widget = W.HBox([controls, self.output])
        self.update()

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
        def convert(k, v):
            if k == "n_params_billion":   # a size not on the slider is added to it, so it is held exactly
                slider = self.controls[k]
                slider.options = _size_options([x for _, x in slider.options], v)
                v = float(v)
            return v

        return self._set_and_redraw(values, convert)

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

    def static_text(self) -> str:
        """A readable summary of the settings and the per-device totals of ZeRO stages 0-3."""
        v = self.values()
        head = (f"Memory calculator (the live controls need a running kernel): "
                f"{v['n_params_billion']:g}B parameters, b={v['micro_batch']}, s={v['seq']}, "
                f"h={v['hidden']}, L={v['n_layer']}, a={v['heads']}, {v['precision']} "
                f"{v['optimizer']}, N={v['dp_degree']}, t={v['tp']}, sequence parallel "
                f"{'on' if v['sequence_parallel'] else 'off'}, recompute={v['recompute']}")
        try:
            bars = self.breakdowns()
        except ValueError as err:
            return f"{head}\nInvalid settings: {err}"
        selected = f"ZeRO-{v['zero_stage']}"
        totals = ", ".join(f"{k} {sum(b.values()) / estimate.GB:.1f} GB" for k, b in bars.items())
        total = sum(bars[selected].values())
        fits = "fits" if total <= self.device_gb * estimate.GB else "does NOT fit"
        return (f"{head}\nper device: {totals}; selected {selected}: {total / estimate.GB:.1f} GB "
                f"-> {fits} in {self.device_gb:.0f} GB")


def _size_options(sizes, value) -> list:
    """Slider options ``(label, value)`` for the sizes, with ``value`` added if it is missing."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"n_params_billion must be a positive number of billions of parameters "
                         f"(e.g. 7.0 or 0.355), got {value!r}")
    values = sorted(set(float(x) for x in sizes) | {float(value)})
    return [(f"{x:g}", x) for x in values]


def memory_calculator(**defaults) -> MemoryCalculator:
    """Build a :class:`MemoryCalculator` and display it; returns it (its ``update`` is callable).

    The saved output holds the live widget and its static fallback (PNG + text), see the module
    docstring.
    """
    from IPython.display import display

    calc = MemoryCalculator(**defaults)
    display(calc)
    return calc


# --------------------------------------------------------------------------- step-through

class StepThrough(_StaticFallback):
    """A slider over named states that redraws one figure per state.

    ``labels[i]`` names state ``i`` (the slider shows the name, never a bare index, so "value 3"
    cannot read "step 2"); ``draw(i, ax)`` draws state ``i`` into a fresh Axes. ``value`` is the
    index shown first. ``display(st)`` shows the slider and the figure, and stores the static
    fallback (the first figure as a PNG, and :meth:`static_text`). :meth:`show` selects a state
    from code and returns the figure (``self.figure``).
    """

    def __init__(self, labels: Sequence[str], draw: Callable, value: int = 0,
                 description: str = "step", figsize: tuple = (6.0, 2.8), title: str = ""):
        import ipywidgets as W

        self.labels = [str(x) for x in labels]
        if not self.labels:
            raise ValueError("labels is empty: pass one name per state, e.g. ['input', "
                             "'reduce-scatter 1/3', ...]")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be distinct (the slider shows them): {self.labels}")
        if not callable(draw):
            raise TypeError(f"draw must be a function draw(index, ax), got {draw!r}")
        self._check_index(value)
        self.draw, self.figsize, self.title = draw, figsize, title
        self.slider = W.SelectionSlider(options=[(lab, i) for i, lab in enumerate(self.labels)],
                                        value=value, description=description,
                                        continuous_update=False,
                                        layout=W.Layout(width="520px"),
                                        style={"description_width": "60px"})
        self.output = W.Output()
        self.figure = None
        self.slider.observe(lambda change: self._redraw(), names="value")
        self.widget = W.VBox([self.slider, self.output])
        self._redraw()

    def _check_index(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(self.labels):
            raise ValueError(f"state index must be an int in 0..{len(self.labels) - 1} "
                             f"({len(self.labels)} states: {self.labels}), got {i!r}")
        return int(i)

    @property
    def index(self) -> int:
        """The index of the state shown."""
        return self.slider.value

    def show(self, i: int):
        """Select state ``i`` (as moving the slider would) and return its figure."""
        self.slider.value = self._check_index(i)  # redraws through the observer when it changes
        return self.figure

    def _redraw(self) -> None:
        from IPython.display import display

        i = self.slider.value
        fig, ax = plt.subplots(figsize=self.figsize)
        self.draw(i, ax)
        if self.title:
            fig.suptitle(self.title)
        fig.tight_layout()
        self.figure = fig
        with self.output:
            self.output.clear_output(wait=True)
            display(fig)
        plt.close(fig)

    def static_text(self) -> str:
        """A readable summary: the states and the one shown."""
        return (f"Step-through (the slider needs a running kernel), {len(self.labels)} states: "
                f"{', '.join(self.labels)}; shown: {self.labels[self.index]!r}")


def step_through(labels: Sequence[str], draw: Callable, value: int = 0, description: str = "step",
                 figsize: tuple = (6.0, 2.8), title: str = "") -> StepThrough:
    """Build a :class:`StepThrough` and display it (live slider + static fallback); returns it."""
    from IPython.display import display

    st = StepThrough(labels, draw, value=value, description=description, figsize=figsize,
                     title=title)
    display(st)
    return st


def ring_step_label(phase: str, step: int, world_size: int) -> str:
    """The name of one ring step: ``ring_step_label("reduce-scatter", 0, 4) == "reduce-scatter 1/3"``.

    ``step`` is the 0-based step index that ``course_lib.collectives.ring_all_reduce``'s
    ``step_hook(phase, step, flat)`` reports; each phase of a ring on ``N = world_size`` ranks has
    ``N - 1`` steps, named ``1/(N-1)`` ... ``(N-1)/(N-1)``.
    """
    N = int(world_size)
    if N < 2:
        raise ValueError(f"a ring needs world_size >= 2, got {world_size!r}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step < N - 1:
        raise ValueError(f"step must be an int in 0..{N - 2} (0-based, as step_hook reports it) "
                         f"for world_size={N}, got {step!r}")
    return f"{phase} {step + 1}/{N - 1}"


def ring_step_through(snapshots, chunk_bounds=None, value: int = 0, log: bool = False,
                      fmt: str = "{:g}", title: str = "",
                      colorbar: str | None = "value") -> StepThrough:
    """Display a :class:`StepThrough` over recorded ring snapshots; returns it.

    ``snapshots`` has the format of :func:`course_lib.viz.plot_ring_steps`: a list of
    ``(label, per_rank, received)`` with ``per_rank[r]`` rank r's flat buffer after that state and
    ``received`` the ``(rank, element)`` cells written in it (outlined in red). Name the states with
    :func:`ring_step_label` ("input", "reduce-scatter 1/3", ...). All states share one colour scale
    (the minimum and maximum over all snapshots), so colours compare across steps; ``colorbar``
    labels the colour bar drawn beside every state (``None``: no colour bar).
    """
    import numpy as np

    from course_lib import viz

    if not snapshots:
        raise ValueError("snapshots is empty: pass [(label, per_rank, received), ...]")
    values = np.concatenate([np.asarray(t, dtype=float).reshape(-1)
                             for _, per_rank, _ in snapshots for t in per_rank])
    lo, hi = float(values.min()), float(values.max())
    n_ranks = len(snapshots[0][1])
    width = len(np.asarray(snapshots[0][1][0]).reshape(-1))

    def draw(i, ax):
        label, per_rank, received = snapshots[i]
        viz.plot_rank_tensors(per_rank, ax=ax, title=f"{label} (red: received in this step)",
                              highlight=received, fmt=fmt, vmin=lo, vmax=hi,
                              chunk_bounds=chunk_bounds, log=log)
        if colorbar is not None:
            ax.figure.colorbar(ax.images[0], ax=ax, label=colorbar)

    return step_through([lab for lab, _, _ in snapshots], draw, value=value, title=title,
                        figsize=(0.6 * width + (3.2 if colorbar is not None else 2.0),
                                 0.45 * n_ranks + 1.2))


# --------------------------------------------------------------------------- pipeline explorer

class PipelineExplorer(_ControlPanel):
    """A pipeline schedule explorer: choose the schedule, the ranks ``p``, the micro-batches ``m`` (and
    ``v`` virtual stages per rank for the interleaved schedule); see its simulated timeline with the
    bubble it has and the bubble ``(p-1)/(v m + p-1)`` theory gives, and the micro-batches each rank
    holds at its peak. Time unit: a rank's forward of one micro-batch takes 1, its backward
    ``backward_ratio`` (split evenly into B and W for ZB-H1); with ``v`` stages per rank each stage
    takes ``1/v`` of that.

    ``measured`` (optional) maps ``(schedule, p, m)`` to per-rank events recorded around
    :func:`course_lib.pipeline.run_schedule`; when the settings match one of them, its timeline is
    drawn under the simulated one. :meth:`update` sets controls by name (``schedule``, ``p``, ``m``,
    ``v``) and returns ``{"bubble", "theory", "peak_in_flight"}`` of the simulated timeline (``None``
    with the reason shown when the settings are invalid; ``theory`` is ``None`` for ZB-H1 with
    ``m < p``, where no closed form is given).
    """

    def __init__(self, schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2,
                 backward_ratio: float = 2.0, measured: dict | None = None):
        import ipywidgets as W
        from course_lib import pipeline

        self._pipeline = pipeline
        self.backward_ratio = float(backward_ratio)
        self.measured = dict(measured or {})
        style, lay = {"description_width": "120px"}, W.Layout(width="360px")
        self.controls = {
            "schedule": W.Dropdown(options=list(pipeline.SCHEDULES), value=schedule, description="schedule"),
            "p": W.IntSlider(value=p, min=2, max=8, description="ranks p"),
            "m": W.IntSlider(value=m, min=1, max=32, description="micro-batches m"),
            "v": W.IntSlider(value=v, min=2, max=4, description="virtual stages v"),
        }
        for c in self.controls.values():
            c.style, c.layout = style, lay
            c.observe(self._on_change, names="value")
        self.output = W.Output()
        self.figure = None
        self.result = None
        self.message = ""
        controls = W.VBox(list(self.controls.values()), layout=W.Layout(flex="0 0 auto", min_width="380px"))
        self.widget = W.VBox([controls, self.output])
        self.update()

    def compute(self, **values) -> dict:
        """The simulated timeline of the given (or current) settings: ``{"events", "bubble",
        "theory", "peak_in_flight", "v"}``; raises ``ValueError`` for invalid settings."""
        P = self._pipeline
        s = {**self.values(), **values}
        v = s["v"] if s["schedule"] == "interleaved" else 1
        m = 1 if s["schedule"] == "naive" else s["m"]
        sched = P.make_schedule(s["schedule"], s["p"], m, v)
        events = P.simulate(sched, t_forward=1.0 / v, t_backward=self.backward_ratio / v)
        if s["schedule"] != "zb-h1":
            theory = P.theoretical_bubble(s["p"], m, v)
        elif m >= s["p"] and self.backward_ratio == 2.0:   # F = B = W: idle (p-1) units of 3m + p-1
            theory = (s["p"] - 1) / (3 * m + s["p"] - 1)
        else:
            theory = None                                  # no closed form: the simulation is the answer
        return {"events": events, "bubble": P.bubble_fraction(events), "theory": theory,
                "peak_in_flight": P.peak_in_flight(sched), "v": v, "m": m}

    def update(self, **values):
        """Set the given controls (if any), recompute and redraw; see the class docstring."""
        return self._set_and_redraw(values)

    def _redraw(self):
        from IPython.display import display
        from course_lib.viz import plot_pipeline

        s = self.values()
        try:
            res = self.compute()
        except ValueError as err:
            self.figure, self.result = None, None
            self.message = f"Invalid settings: {err}"
            with self.output:
                self.output.clear_output(wait=True)
                print(self.message)
            return None
        key = (s["schedule"], s["p"], res["m"])
        measured = self.measured.get(key)
        rows = 2 if measured is not None else 1
        width = min(16.0, 5.0 + 0.25 * len(res["events"][0]))
        fig, axes = plt.subplots(rows, 1, figsize=(width, (0.45 * s["p"] + 1.3) * rows), squeeze=False)
        plot_pipeline(res["events"], ax=axes[0][0], n_microbatches=res["m"],
                      title=(f"{s['schedule']}, p={s['p']}, m={res['m']}"
                             + (f", v={res['v']}" if res["v"] > 1 else "")
                             + f" (simulated): bubble {res['bubble']:.1%}, theory {_pct(res['theory'])}"),
                      xlabel="time (1 = a rank's forward of one micro-batch)")
        if measured is not None:
            plot_pipeline(measured, ax=axes[1][0], n_microbatches=res["m"])
        fig.tight_layout()
        self.figure = fig
        self.result = {k: res[k] for k in ("bubble", "theory", "peak_in_flight")}
        self.message = (f"bubble {res['bubble']:.1%} (theory {_pct(res['theory'])}); micro-batches held "
                        f"at the peak per rank: {res['peak_in_flight']}")
        with self.output:
            self.output.clear_output(wait=True)
            display(fig)
            print(self.message)
        plt.close(fig)
        return self.result

    def static_text(self) -> str:
        """The settings and what the simulation gives, readable without a kernel."""
        s = self.values()
        return (f"Pipeline explorer (the live controls need a running kernel): {s['schedule']}, p={s['p']}, "
                f"m={s['m']}, v={s['v']}: {self.message}")


def _pct(x) -> str:
    return "n/a (m < p)" if x is None else f"{x:.1%}"


def pipeline_explorer(**kwargs) -> PipelineExplorer:
    """Build a :class:`PipelineExplorer` and display it; returns it (its ``update`` is callable)."""
    from IPython.display import display

    ex = PipelineExplorer(**kwargs)
    display(ex)
    return ex
