"""A small pytest plugin, loaded next to nbval, that records what happened to every notebook cell.

Used by the grader as ``python -m pytest -p course_lib.grading.nbval_plugin --nbval-lax
--grading-results FILE ...``. After each cell it rewrites FILE (atomically) with one record per
executed code cell: its index among code cells, its ``grade_id`` (from cell metadata, so results never
depend on cell numbers), the outcome and the error's name and first line. Because the file is rewritten
after every cell, a run that is killed still leaves the results of the cells that finished.

It also makes a dead kernel fail fast: nbval waits for a reply from the kernel for the whole cell
timeout; the patched wait polls once a second and gives up as soon as the kernel process is gone.
"""

from __future__ import annotations

import json
import os
import re
import time
from queue import Empty

import pytest

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class KernelDied(RuntimeError):
    """The kernel process exited while a cell was running."""


def _patch_nbval_kernel() -> None:
    try:
        from nbval.kernel import RunningKernel
    except ImportError:  # nbval missing: pytest will complain about --nbval-lax itself
        return
    if getattr(RunningKernel, "_course_patched", False) or not hasattr(RunningKernel, "await_reply"):
        return

    def await_reply(self, msg_id, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                msg = self.get_message(stream="shell", timeout=step)
            except Empty:
                if not self.is_alive():
                    raise KernelDied("the kernel died while running this cell (it exited or was killed)")
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["content"]["status"] == "aborted":
                    raise RuntimeError("Kernel aborted execution request")
                return

    RunningKernel.await_reply = await_reply
    RunningKernel._course_patched = True


def pytest_addoption(parser):
    parser.getgroup("course grading").addoption(
        "--grading-results", action="store", default=None,
        help="write per-cell grading results (JSON) to this file")


def pytest_configure(config):
    _patch_nbval_kernel()
    config._grading_records = []


def _first_line(text: str) -> str:
    for line in _ANSI_RE.sub("", text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    parent = getattr(item, "parent", None)
    item._grading_timed_out_before = bool(getattr(parent, "timed_out", False))
    t0 = time.monotonic()
    yield
    item._grading_seconds = time.monotonic() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    cell = getattr(item, "cell", None)
    if cell is None or call.when not in ("setup", "call"):
        return
    if call.when == "setup" and call.excinfo is None:
        return
    meta = cell.get("metadata", {}).get("course", {})
    meta = meta if isinstance(meta, dict) else {}
    rec = {"cell": getattr(item, "cell_num", None), "grade_id": meta.get("grade_id"),
           "seconds": round(getattr(item, "_grading_seconds", 0.0), 3)}
    exc = call.excinfo
    if exc is None:
        rec.update(outcome="passed")
    elif exc.errisinstance(pytest.skip.Exception):
        rec.update(outcome="skipped")
    else:
        # The error the cell itself raised, from the outputs nbval collected.
        errors = [o for o in (getattr(item, "test_outputs", None) or []) if o.get("output_type") == "error"]
        timed_out_now = (not item._grading_timed_out_before
                         and bool(getattr(item.parent, "timed_out", False))) \
            if hasattr(item, "_grading_timed_out_before") else False
        text = str(exc.value)
        if call.when == "setup":  # e.g. the kernel could not be started
            outcome, ename, evalue = "not_run", type(exc.value).__name__, _first_line(text)
        elif exc.errisinstance(KernelDied):
            outcome, ename, evalue = "kernel_died", "KernelDied", text
        elif "Kernel dead on test start" in text:
            outcome, ename, evalue = "not_run", "KernelDead", "the kernel had died in an earlier cell"
        elif timed_out_now or text.startswith("Timeout of"):
            outcome, ename, evalue = "timeout", "Timeout", _first_line(text)
        elif errors:
            err = errors[-1]
            outcome, ename, evalue = "error", err.get("ename", ""), _first_line(err.get("evalue", ""))
            rec["detail"] = _ANSI_RE.sub("", err.get("evalue", ""))[:4000]  # e.g. a RankError's rank tracebacks
        else:
            outcome, ename, evalue = "error", type(exc.value).__name__, _first_line(text)
        rec.update(outcome=outcome, ename=ename, evalue=evalue)
    records = item.config._grading_records
    records.append(rec)
    path = item.config.getoption("--grading-results")
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(records, f)
        os.replace(tmp, path)
