"""The lecture notebooks as a learner meets them: JupyterLab in a real (headless) browser.

One JupyterLab server per run of this file, started the way ``make lab`` starts it (``make lab-serve``
with ``VENV`` = the environment running the tests, ``LAB_ROOT`` = a temporary folder holding copies of
START_HERE.ipynb and the lecture notebooks). For a notebook with a widget (``CASES``; ``make test`` drives
the first, ``COURSE_BROWSER=all`` every one) Debian's chromium, driven by Playwright:

1. opens START_HERE.ipynb (the page ``make lab`` lands on) and clicks the notebook's link there;
2. runs the whole notebook from the UI (menu Run > Run All Cells) and waits until no cell is queued
   or running and the kernel is idle (timeout ``RUN_TIMEOUT_S``, with the cells still pending named);
3. checks what the learner sees: no error output (a traceback, ``SomethingError: ...``), no kernel
   crash dialog, every cell that has a figure in the committed notebook shows a loaded ``<img>``;
4. moves each named slider of the widget with the keyboard (focus the slider handle, press an
   arrow key, as a learner using the keyboard does) and checks that the slider's readout and the
   widget's figure (the ``<img>`` data URL, i.e. the PNG the kernel sent back) change.

The notebooks are run in full from the UI (Run All Cells; the whole test on 2 shared, loaded cores: 01 in
22 s, 03 in 46 s, 08 in 55 s, in CI on 2026-12-04), so no cell subset is needed. The committed outputs are cleared first
(Edit > Clear Outputs of All Cells): the checks see only what this run drew. Screenshots (the page after the run; the widget cell before and after each slider
move) and the browser's console log go to build/browser-artifacts/ (git-ignored).

Skipped, with the reason, where /usr/bin/chromium, Playwright, JupyterLab or make is missing.
The server runs with its own Jupyter config/data/runtime/settings folders (so a learner's own
kernels or settings cannot change the result) and is always shut down: SIGTERM (the server shuts its
kernels down, and their clusters), then SIGKILL for any process of the server's tree still alive.

Add a notebook: append a ``WidgetCase`` to ``CASES`` (CONTRIBUTING.md, "Browser tests").
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "build" / "browser-artifacts"
VENV = Path(sys.prefix)  # the environment running this test: its jupyter serves the notebooks
RUN_TIMEOUT_S = 240      # a whole notebook from Run All Cells until the kernel is idle
SERVER_START_TIMEOUT_S = 90
FIGURE_TIMEOUT_S = 30    # one slider move until the redrawn figure is shown


@dataclass(frozen=True)
class WidgetCase:
    notebook: str          # file name in notebooks/
    widget_call: str       # text that only the widget's cell contains (the call that displays it)
    sliders: tuple         # the slider labels (ipywidgets ``description``) to move, in order
    key: str = "ArrowRight"


CASES = [
    WidgetCase("01_compute_and_memory.ipynb", "memory_calculator(",
               ("parameters (billions)", "micro-batch b", "layers L")),
    WidgetCase("03_collectives.ipynb", "ring_step_through(", ("step",)),
    WidgetCase("08_pipeline_parallel.ipynb", "pipeline_explorer(", ("ranks p", "micro-batches m")),
]


def _skip_reason() -> str | None:
    if not CHROMIUM.exists():
        return f"browser test skipped: {CHROMIUM} not found (apt install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "browser test skipped: playwright not installed (pip install playwright; the browser is " \
               f"{CHROMIUM}, nothing is downloaded)"
    if not (VENV / "bin" / "jupyter-lab").exists():
        return f"browser test skipped: JupyterLab not installed in {VENV} (pip install 'course-lib[lab]')"
    if shutil.which("make") is None:
        return "browser test skipped: make not found (the test starts JupyterLab with `make lab-serve`)"
    import ipywidgets
    if int(ipywidgets.__version__.split(".")[0]) < 8:
        return (f"browser test skipped: ipywidgets {ipywidgets.__version__} (Colab's 7.x) displays in Colab and "
                "the classic notebook; JupyterLab 4 renders ipywidgets 8 only (pip install 'course-lib[lab]')")
    return None


pytestmark = [pytest.mark.slow]
if _skip_reason():
    pytestmark.append(pytest.mark.skip(reason=_skip_reason()))


# --------------------------------------------------------------------------- the server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc (empty where there is no /proc)."""
    tree: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(d.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited


def _write_settings(settings_dir: Path) -> None:
    """JupyterLab user settings for the test: every cell stays in the DOM (no windowing, so cell i of
    the notebook is the i-th ``.jp-Cell``), and no news/update pop-up over the screenshots."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, value in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class LabServer:
    def __init__(self, base: Path):
        self.base = base
        self.root = base / "lab"
        (self.root / "notebooks").mkdir(parents=True)
        shutil.copy(REPO / "START_HERE.ipynb", self.root)
        for nb in NOTEBOOKS.glob("*.ipynb"):
            shutil.copy(nb, self.root / "notebooks")
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyter.log"
        self.runtime = base / "runtime"
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
            (base / sub).mkdir(exist_ok=True)
            env[var] = str(base / sub)
        _write_settings(base / "settings")
        flags = [
            "--no-browser", f"--port={self.port}", "--ServerApp.port_retries=0",
            "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={self.token}",
            # a safety net should this process be killed before its teardown: idle kernels are culled
            # after 15 min, and the server then stops itself after 15 min without kernels
            "--MappingKernelManager.cull_idle_timeout=900", "--MappingKernelManager.cull_interval=60",
            "--ServerApp.shutdown_no_activity_timeout=900",
        ]
        self.cmd = ["make", "--no-print-directory", "-C", str(REPO), "lab-serve", f"VENV={VENV}",
                    f"LAB_ROOT={self.root}", "LAB_FLAGS=" + " ".join(flags)]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.server_pid: int | None = None

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def api(self, path: str):
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.cmd)}` exited with {self.proc.returncode} before "
                                   f"JupyterLab answered; its log:\n{self.log_tail()}")
            for f in self.runtime.glob("jpserver-*.json"):
                try:
                    self.server_pid = json.loads(f.read_text())["pid"]
                except (ValueError, KeyError, OSError):
                    pass
            try:
                self.api("/api/status")
                return
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer on {self.url} within {SERVER_START_TIMEOUT_S} s; "
                           f"its log:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server (it shuts down its kernels), then SIGKILL whatever of its process
        tree is left; warns when something had to be killed."""
        tree = _descendants(self.proc.pid) | {self.proc.pid}
        if self.server_pid is not None and _alive(self.server_pid):
            os.kill(self.server_pid, signal.SIGTERM)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            tree |= {d for p in tree if _alive(p) for d in _descendants(p)}
            time.sleep(0.2)
        left = sorted(p for p in tree if _alive(p))
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        if left:
            warnings.warn(f"JupyterLab's process tree had not exited 30 s after SIGTERM; killed {left}")


@pytest.fixture(scope="module")
def lab():
    base = Path(tempfile.mkdtemp(prefix="course-browser-"))
    server = LabServer(base)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log_path, ARTIFACTS / "jupyter.log")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    console: list[str] = []
    pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.-]+", "_", request.node.name)
        try:
            pg.screenshot(path=ARTIFACTS / f"{name}-last.png")
        except Exception:  # noqa: BLE001 - the page may be gone; the test's own error says why
            pass
        (ARTIFACTS / f"{name}-console.log").write_text("\n".join(console) + "\n")
        context.close()


# --------------------------------------------------------------------------- the UI

def _cells_json(notebook: str) -> list[dict]:
    return json.loads((NOTEBOOKS / notebook).read_text())["cells"]


def _src(cell: dict) -> str:
    return "".join(cell["source"])


def open_from_start_here(page, lab: LabServer, notebook: str):
    """Land where ``make lab`` lands (START_HERE.ipynb) and click the notebook's link; returns the
    notebook's panel once its kernel is idle."""
    # the page `make lab`'s browser opens: `jupyter lab START_HERE.ipynb` opens /lab/tree/START_HERE.ipynb
    # (with --no-browser the server opens nothing, so the test goes there itself)
    page.goto(f"{lab.url}/lab/tree/START_HERE.ipynb?token={lab.token}")
    link = page.locator(f'.jp-RenderedMarkdown a[href*="notebooks/{notebook}"]').first
    try:
        link.wait_for(timeout=60_000)
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"START_HERE.ipynb, opened by `make lab`, shows no link to "
                             f"notebooks/{notebook}") from err
    link.click()
    panel = page.locator(f'.jp-NotebookPanel:has(.jp-Notebook):visible')
    tab = page.locator(f'.lm-TabBar-tab.lm-mod-current:has-text("{notebook}")')
    tab.wait_for(timeout=60_000)
    panel.locator(".jp-Cell").first.wait_for(timeout=60_000)
    wait_kernel_idle(page, 120)
    # click into the notebook, as a learner does: the Run menu acts on the notebook that has the focus,
    # which after the link click can still be START_HERE.ipynb
    panel.locator(".jp-Cell").first.click()
    return panel


def wait_kernel_idle(page, timeout_s: float) -> None:
    indicator = page.locator(".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator")
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        _check_no_dialog(page)
        status = indicator.get_attribute("data-status", timeout=10_000)
        if status == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"the notebook's kernel is not idle after {timeout_s} s (status {status!r})")


def _check_no_dialog(page) -> None:
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise AssertionError(f"JupyterLab shows a dialog: {dialog.first.inner_text()!r}")


def run_all_cells(page, panel, cells: list[dict]) -> float:
    """Menu Run > Run All Cells; wait until every code cell has an execution count and none is
    queued or running. Returns the seconds it took."""
    # The committed notebook carries its outputs and execution counts: clear them first (Edit > Clear
    # Outputs of All Cells), or the checks below would pass on the saved figures without a run.
    page.locator('.lm-MenuBar-item:has-text("Edit")').first.click()
    page.locator('.lm-Menu-item[data-command="editmenu:clear-all"]').click()
    page.wait_for_function(
        """() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output')""",
        timeout=30_000)
    t0 = time.monotonic()
    page.locator('.lm-MenuBar-item:has-text("Run")').first.click()
    # the menu item by its exact label ("Restart Kernel and Run All Cells…" contains the same words)
    page.locator(".lm-Menu-content .lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    prompts = panel.locator(".jp-Cell .jp-InputArea-prompt")
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    deadline = t0 + RUN_TIMEOUT_S
    while True:
        _check_no_dialog(page)
        texts = prompts.all_inner_texts()
        pending = [i for i, t in enumerate(texts) if "*" in t]
        if not pending and all(re.search(r"\[\d+\]", texts[i]) for i in code if i < len(texts)):
            break
        if not pending and _errors(panel) and time.monotonic() - t0 > 2:
            break  # an error stopped Run All: the cells after it stay unrun; reported by the checks
        if time.monotonic() > deadline:
            names = [f"cell {i}: {_src(cells[i]).splitlines()[0][:70]!r}" for i in pending[:5]]
            raise AssertionError(f"Run All Cells had not finished after {RUN_TIMEOUT_S} s; still "
                                 f"queued or running: {names}")
        time.sleep(0.5)
    wait_kernel_idle(page, 60)
    return time.monotonic() - t0


_ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt|Exit)\b.*:", re.M)


def _errors(panel) -> list[str]:
    """Texts of the error outputs shown: a traceback anywhere, or an ``XError: ...`` line on stderr."""
    out = []
    for o in panel.locator(".jp-OutputArea-output").all():
        mime = o.get_attribute("data-mime-type") or ""
        if not (mime.startswith("application/vnd.jupyter.std") or mime == "text/plain"):
            continue
        text = o.inner_text()
        if "Traceback" in text or (mime.endswith("stderr") and _ERROR_LINE.search(text)):
            out.append(text)
    return out


def check_outputs(panel, cells: list[dict]) -> int:
    """No error output; a loaded figure in every cell that has one in the committed notebook.
    Returns the number of figures seen."""
    errors = _errors(panel)
    assert not errors, "error output(s) after Run All Cells:\n\n" + "\n\n".join(e[-3000:] for e in errors)
    dom = panel.locator(".jp-Notebook .jp-Cell")
    assert dom.count() == len(cells), f"{dom.count()} cells in the page, {len(cells)} in the notebook"
    seen = 0
    for i, c in enumerate(cells):
        if not any("image/png" in o.get("data", {}) for o in c.get("outputs", [])):
            continue
        imgs = dom.nth(i).locator(".jp-OutputArea-output img")
        loaded = [im.evaluate("e => e.complete && e.naturalWidth > 0") for im in imgs.all()]
        assert any(loaded), (f"cell {i} ({_src(c).splitlines()[0][:60]!r}) shows no figure after the "
                             f"run ({len(loaded)} <img>, none loaded); the committed notebook has one")
        seen += sum(loaded)
    return seen


def _digest(src: str | None) -> str:
    if not src:
        return "none"
    data = src.split(",", 1)[-1]
    try:
        return hashlib.sha1(base64.b64decode(data)).hexdigest()[:12]
    except ValueError:
        return hashlib.sha1(src.encode()).hexdigest()[:12]


def move_slider(page, cell, label: str, key: str) -> tuple[str, str]:
    """Focus the handle of the slider labelled ``label`` in ``cell``, press ``key``; wait until the
    figure is redrawn. Returns the readout before and after."""
    slider = cell.locator(".widget-slider").filter(
        has=page.locator(f'.widget-label:text-is("{label}")'))
    assert slider.count() == 1, f"{slider.count()} sliders labelled {label!r} in the widget's cell"
    readout = slider.locator(".widget-readout")
    img = cell.locator(".jp-OutputArea-output img").first
    before_readout, before_img = readout.inner_text(), img.get_attribute("src")
    # The whole readout is visible: the element drawn at its right end is the readout itself (not the
    # figure next to it, nor nothing because a narrow column clipped it).
    visible = readout.evaluate(
        "e => { const r = e.getBoundingClientRect(); const hit = document.elementFromPoint(r.right - 2, "
        "(r.top + r.bottom) / 2); return r.width > 0 && hit !== null && (hit === e || e.contains(hit)); }")
    assert visible, f"slider {label!r}: its readout {before_readout!r} is cut off or covered on screen"
    handle = slider.locator(".noUi-handle")
    handle.focus()
    handle.press(key)
    deadline = time.monotonic() + FIGURE_TIMEOUT_S
    while True:
        after_readout = readout.inner_text()
        after_img = cell.locator(".jp-OutputArea-output img").first.get_attribute("src")
        if after_img and after_img != before_img and after_readout != before_readout:
            loaded = cell.locator(".jp-OutputArea-output img").first.evaluate(
                "e => e.complete && e.naturalWidth > 0")
            if loaded:
                break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"slider {label!r}: after pressing {key} the readout went {before_readout!r} -> "
                f"{after_readout!r} and the figure {_digest(before_img)} -> {_digest(after_img)} "
                f"within {FIGURE_TIMEOUT_S} s (both must change)")
        time.sleep(0.2)
    return before_readout, after_readout


# `make test` drives one notebook (the first case: the same JupyterLab, ipywidgets and kernel round trip
# as the others, in the quickest notebook, about 25 s); COURSE_BROWSER=all drives every case (about 2
# minutes more). The other widgets' logic is tested without a browser in tests/test_widgets.py, and their
# notebooks run under nbval in the same suite.
ALL_CASES = os.environ.get("COURSE_BROWSER", "") == "all"


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if ALL_CASES or k == 0 else pytest.mark.skip(
        reason=f"browser test of {c.notebook}: only with COURSE_BROWSER=all (make test drives {CASES[0].notebook})"))
    for k, c in enumerate(CASES)], ids=[c.notebook.split("_")[0] for c in CASES])
def test_notebook_in_jupyterlab(lab, page, case: WidgetCase):
    stem = case.notebook.removesuffix(".ipynb")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob(f"{stem}-*.png"):
        old.unlink()
    cells = _cells_json(case.notebook)
    widget_cells = [i for i, c in enumerate(cells)
                    if c["cell_type"] == "code" and case.widget_call in _src(c)]
    assert len(widget_cells) == 1, f"{case.notebook}: {len(widget_cells)} cells contain {case.widget_call!r}"

    panel = open_from_start_here(page, lab, case.notebook)
    seconds = run_all_cells(page, panel, cells)
    page.screenshot(path=ARTIFACTS / f"{stem}-1-after-run-all.png", full_page=True)
    figures = check_outputs(panel, cells)

    cell = panel.locator(".jp-Notebook .jp-Cell").nth(widget_cells[0])
    cell.scroll_into_view_if_needed()
    cell.screenshot(path=ARTIFACTS / f"{stem}-2-widget-before.png")
    moves = []
    for k, label in enumerate(case.sliders, start=1):
        before, after = move_slider(page, cell, label, case.key)
        moves.append(f"{label}: {before} -> {after}")
        slug = re.sub(r"\W+", "_", label).strip("_")
        cell.screenshot(path=ARTIFACTS / f"{stem}-3-widget-after-{k}-{slug}.png")
    assert not _errors(panel), "error output after moving the sliders:\n" + "\n".join(_errors(panel))
    print(f"{case.notebook}: Run All Cells {seconds:.0f} s, {figures} figures, {'; '.join(moves)}")
