"""course_lib.widgets: progress bars and widgets leave readable static outputs in saved notebooks.

One tiny notebook is executed with nbclient (a real kernel, as ``nbconvert --execute`` does) for the
whole module; the tests read its saved outputs the way GitHub or an untrusted JupyterLab would.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

CELLS = {
    "progress": (
        "import time\n"
        "from course_lib.widgets import progress\n"
        "for step in progress(range(30), desc='training', unit='steps', min_interval=0.0):\n"
        "    time.sleep(0.01)"
    ),
    "progress_break": (
        "for i in progress(range(10), desc='search'):\n"
        "    if i == 3:\n"
        "        break"
    ),
    "calculator": (
        "from course_lib.widgets import memory_calculator\n"
        "calc = memory_calculator(n_params_billion=13.0, hidden=5120, n_layer=40, heads=40,\n"
        "                         dp_degree=8, zero_stage=3, recompute='selective')"
    ),
    "steps": (
        "from course_lib.widgets import ring_step_through, ring_step_label\n"
        "snaps = [('input', [[1, 2], [10, 20]], set()),\n"
        "         (ring_step_label('reduce-scatter', 0, 2), [[11, 2], [10, 22]], {(0, 0), (1, 1)}),\n"
        "         (ring_step_label('all-gather', 0, 2), [[11, 22], [11, 22]], {(0, 1), (1, 0)})]\n"
        "st = ring_step_through(snaps, chunk_bounds=[(0, 1), (1, 2)])"
    ),
    "pipeline": (
        "from course_lib.widgets import pipeline_explorer\n"
        "ex = pipeline_explorer(schedule='gpipe', p=4, m=4)"
    ),
}


@pytest.fixture(scope="module")
def executed():
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    for cid, src in CELLS.items():
        cell = nbformat.v4.new_code_cell(src)
        cell.id = cid.replace("_", "-")
        nb.cells.append(cell)
    NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(REPO)}}).execute()
    # what is committed is what a reader gets: go through the file format once
    return nbformat.reads(nbformat.writes(nb), as_version=4)


def _png_size(b64):
    import base64
    import struct

    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", raw[16:24])  # IHDR width, height


def _cell(nb, cid):
    return next(c for c in nb.cells if c.id == cid.replace("_", "-"))


def _widget_models(nb):
    return nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}) \
        .get("state", {})


def test_progress_saved_output_is_one_static_line(executed):
    outs = _cell(executed, "progress").outputs
    assert len(outs) == 1, outs
    (out,) = outs
    assert out.output_type == "display_data"
    assert set(out.data) == {"text/plain"}, f"widget-only or extra output left: {set(out.data)}"
    assert re.fullmatch(r"training: 30/30 steps in \d+\.\d s", out.data["text/plain"]), out.data
    assert "HBox" not in json.dumps(executed.cells[0].outputs)


def test_progress_stopped_early_says_so(executed):
    (out,) = _cell(executed, "progress_break").outputs
    assert set(out.data) == {"text/plain"}
    assert re.fullmatch(r"search: 3/10 it in \d+\.\d s \(stopped early\)", out.data["text/plain"])


def test_progress_leaves_no_widget_state(executed):
    assert WIDGET_MIME not in json.dumps([c.outputs for c in executed.cells[:2]])
    names = {m["model_name"] for m in _widget_models(executed).values()}
    assert not any("Progress" in name for name in names), names


def test_progress_plain_text_outside_jupyter():
    code = ("from course_lib.widgets import progress\n"
            "print(sum(progress([1, 2, 3], desc='adding', unit='numbers')))\n"
            "print(list(progress((i for i in range(4)), desc='generator')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["6", "[0,", "1,", "2,", "3]"]
    lines = r.stderr.strip().splitlines()
    assert re.fullmatch(r"adding: 3/3 numbers in \d+\.\d s", lines[0]), lines
    assert re.fullmatch(r"generator: 4 it in \d+\.\d s", lines[1]), lines


@pytest.mark.parametrize("kwargs, match", [
    (dict(desc=""), "desc must be a non-empty string"),
    (dict(desc=3), "desc must be a non-empty string"),
    (dict(desc="x", total=-1), "total must be a non-negative int"),
    (dict(desc="x", min_interval=-1), "min_interval must be >= 0"),
])
def test_progress_bad_arguments(kwargs, match):
    from course_lib.widgets import progress

    with pytest.raises(ValueError, match=match):
        progress(range(3), **kwargs)


# --------------------------------------------------------------------------- static fallbacks

@pytest.mark.parametrize("cid, text", [
    ("calculator", r"Memory calculator \(the live controls need a running kernel\): 13B parameters.*"
                   r"selected ZeRO-3: \d+\.\d GB -> fits in 80 GB"),
    ("steps", r"Step-through \(the slider needs a running kernel\), 3 states: input, "
              r"reduce-scatter 1/1, all-gather 1/1; shown: 'input'"),
    ("pipeline", r"Pipeline explorer \(the live controls need a running kernel\): gpipe, p=4, m=4, v=2: "
                 r"bubble 42\.9% \(theory 42\.9%\); micro-batches held at the peak per rank: \[4, 4, 4, 4\]"),
])
def test_widget_saved_output_has_static_fallback(executed, cid, text):
    outs = _cell(executed, cid).outputs
    assert len(outs) == 1, outs
    data = outs[0].data
    # the live widget (for a running kernel) ...
    assert WIDGET_MIME in data
    # ... and what GitHub / an untrusted notebook shows instead: a PNG and readable text
    w, h = _png_size(data["image/png"])
    assert w > 200 and h > 100, (w, h)
    plain = data["text/plain"]
    assert re.fullmatch(text, plain, flags=re.S), plain
    assert not re.search(r"\b(HBox|VBox|interactive|SelectionSlider|IntSlider)\(", plain), plain


def test_widget_state_saved_for_the_live_view(executed):
    # the widget view refers to a model whose state is stored, so a trusted reopen renders it
    models = _widget_models(executed)
    for cid in ("calculator", "steps", "pipeline"):
        ref = _cell(executed, cid).outputs[0].data[WIDGET_MIME]["model_id"]
        assert ref in models, f"{cid}: model {ref} not in saved widget state"


def _calc(**kw):
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.widgets import MemoryCalculator

    return MemoryCalculator(**kw)


def test_calculator_slider_holds_the_requested_value_exactly():
    calc = _calc(n_params_billion=13.0)
    slider = calc.controls["n_params_billion"]
    # a frontend moves a selection slider by index: the index must map back to exactly 13.0
    assert slider.options[slider.index][1] == 13.0 == calc.values()["n_params_billion"]
    calc.update(n_params_billion=12.345)  # not a listed size: added to the slider, held exactly
    assert slider.options[slider.index][1] == 12.345
    assert "12.345B parameters" in calc.static_text()
    assert sorted(v for _, v in slider.options) == [v for _, v in slider.options]
    slider.index = slider.index + 1  # a user moves the slider one notch: the next size, redrawn
    assert calc.values()["n_params_billion"] == 13.0
    assert calc.figure.axes[0].get_title().startswith("13B params")
    with pytest.raises(ValueError, match="n_params_billion must be a positive number"):
        calc.update(n_params_billion=-1)


def test_calculator_fallback_follows_the_state_when_displayed():
    calc = _calc(n_params_billion=7.0)
    before = calc._repr_mimebundle_()
    calc.update(zero_stage=3, dp_degree=64)
    after = calc._repr_mimebundle_()
    assert before["image/png"] != after["image/png"]
    assert "selected ZeRO-0" in before["text/plain"] and "selected ZeRO-3" in after["text/plain"]
    bars = calc.breakdowns()
    assert f"ZeRO-3 {sum(bars['ZeRO-3'].values()) / 1e9:.1f} GB" in after["text/plain"]


def test_step_through_labels_and_redraw():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.widgets import StepThrough, ring_step_label

    labels = ["input"] + [ring_step_label(p, k, 4) for p in ("reduce-scatter", "all-gather")
                          for k in range(3)]
    assert labels[1:4] == ["reduce-scatter 1/3", "reduce-scatter 2/3", "reduce-scatter 3/3"]
    assert labels[4:] == ["all-gather 1/3", "all-gather 2/3", "all-gather 3/3"]
    drawn = []
    st = StepThrough(labels, lambda i, ax: (drawn.append(i), ax.set_title(labels[i])))
    assert st.figure.axes[0].get_title() == "input" and drawn == [0]
    # the slider's label for state 3 is the state's own name (no separate number to disagree)
    st.slider.value = 3
    assert st.slider.label == "reduce-scatter 3/3" == st.figure.axes[0].get_title()
    assert st.show(6).axes[0].get_title() == "all-gather 3/3" and drawn == [0, 3, 6]
    assert "shown: 'all-gather 3/3'" in st.static_text()


@pytest.mark.parametrize("call, match", [
    (lambda W: W.StepThrough([], lambda i, ax: None), "labels is empty"),
    (lambda W: W.StepThrough(["a", "a"], lambda i, ax: None), "labels must be distinct"),
    (lambda W: W.StepThrough(["a", "b"], lambda i, ax: None, value=2), r"int in 0\.\.1"),
    (lambda W: W.ring_step_label("all-gather", 3, 4), r"step must be an int in 0\.\.2"),
    (lambda W: W.ring_step_label("all-gather", 0, 1), "world_size >= 2"),
])
def test_step_through_bad_input(call, match):
    import matplotlib
    matplotlib.use("Agg")
    from course_lib import widgets

    with pytest.raises(ValueError, match=match):
        call(widgets)


def test_ring_pictures_share_one_colour_scale_with_a_colour_bar():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib import viz
    from course_lib.widgets import ring_step_through

    snaps = [("input", [[1, 2], [10, 20]], set()),
             ("reduce-scatter 1/1", [[11, 2], [10, 22]], {(0, 0), (1, 1)}),
             ("all-gather 1/1", [[11, 22], [11, 22]], {(0, 1), (1, 0)})]
    st = ring_step_through(snaps, chunk_bounds=[(0, 1), (1, 2)], colorbar="value")
    heat, bar = st.figure.axes
    assert bar.get_ylabel() == "value"
    assert heat.images[0].get_clim() == (1.0, 22.0)  # min and max over all states, not this one
    assert len(ring_step_through(snaps, colorbar=None).figure.axes) == 1
    fig = viz.plot_ring_steps(snaps, [(0, 1), (1, 2)], ncols=3, colorbar="value")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 3 and {ax.images[0].get_clim() for ax in panels} == {(1.0, 22.0)}
    assert [ax.get_ylabel() for ax in fig.axes if not ax.images] == ["value"]


def test_pipeline_explorer_follows_its_controls():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib import pipeline as P
    from course_lib.widgets import PipelineExplorer

    ex = PipelineExplorer(schedule="1f1b", p=4, m=8)
    assert ex.result == {"bubble": pytest.approx(3 / 11), "theory": pytest.approx(3 / 11),
                         "peak_in_flight": [4, 3, 2, 1]}
    ex.controls["schedule"].value = "interleaved"          # a user picks another schedule: redrawn
    assert ex.result["bubble"] == pytest.approx(P.theoretical_bubble(4, 8, 2))
    assert "interleaved, p=4, m=8, v=2" in ex.figure.axes[0].get_title()
    assert ex.update(m=6) is None and ex.figure is None     # m not a multiple of p: said, not drawn
    assert "must be a multiple of 4" in ex.static_text()
    assert ex.update(schedule="zb-h1", m=8)["bubble"] == pytest.approx(3 / 27)
    assert ex.update(m=2)["theory"] is None and "n/a (m < p)" in ex.static_text()
    with pytest.raises(ValueError, match="unknown setting 'q'"):
        ex.update(q=1)


def test_pipeline_explorer_draws_a_measured_timeline_when_it_has_one():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib import pipeline as P
    from course_lib.widgets import PipelineExplorer

    fake = P.simulate(P.gpipe_schedule(2, 4), t_forward=0.01, t_backward=0.02)
    for row in fake:
        for e in row:
            e["clock"] = "perf_counter"   # shaped like Recorder events
    ex = PipelineExplorer(schedule="gpipe", p=2, m=4, measured={("gpipe", 2, 4): fake})
    assert len(ex.figure.axes) == 2 and "measured" in ex.figure.axes[1].get_title()
    ex.update(m=8)
    assert len(ex.figure.axes) == 1
