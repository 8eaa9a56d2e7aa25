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
    assert not names & {"IntProgressModel", "HBoxModel", "LabelModel"}, names


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
