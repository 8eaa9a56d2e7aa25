"""Reading course notebooks: grading metadata and the solution / hidden-test markers.

The schema (see CONTRIBUTING.md, "Exercises"):

* notebook metadata ``{"course": {"notebook": "NN_topic"}}``;
* a check cell: ``{"course": {"grade_id": "<id unique in the notebook>", "points": <int > 0>}}``;
* optional, on a solution cell: ``{"course": {"exercise": "<grade_id>"}}`` names the exercise in the
  ``NotImplementedError`` stub (default: the grade id of the next check cell below it).

Markers are whole comment lines, at any indentation::

    ### BEGIN SOLUTION        ### BEGIN HIDDEN TESTS
    ...                       ...
    ### END SOLUTION          ### END HIDDEN TESTS
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import nbformat

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"

_MARKER_RE = re.compile(r"^(?P<indent>[ \t]*)(?P<marker>### (?:BEGIN|END) (?:SOLUTION|HIDDEN TESTS))[ \t]*$")
_GRADE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NOTEBOOK_NAME_RE = re.compile(r"^\d\d_[A-Za-z0-9_]+$")

HOW_TO_SUBMIT = "submit the .ipynb from Colab via File > Download > Download .ipynb"


class NotebookError(ValueError):
    """A notebook that cannot be built or graded; the message is one line saying what to do."""


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """Read ``path`` as an nbformat-4 notebook, or raise :class:`NotebookError` with a one-line fix."""
    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"{path}: no such file; pass the path of a .ipynb notebook")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise NotebookError(f"{path}: not a Jupyter notebook (cannot read it as UTF-8 text: "
                            f"{type(exc).__name__}); {HOW_TO_SUBMIT}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(f"{path}: not a Jupyter notebook (not JSON: {exc.msg} at line {exc.lineno}); "
                            f"{HOW_TO_SUBMIT}") from None
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        raise NotebookError(f"{path}: not a Jupyter notebook (JSON without 'cells'/'nbformat'); "
                            f"{HOW_TO_SUBMIT}")
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat raises several types for malformed notebooks
        raise NotebookError(f"{path}: not a readable Jupyter notebook ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); {HOW_TO_SUBMIT}") from None
    return nb


def course_meta(node: dict[str, Any]) -> dict[str, Any]:
    """The ``course`` dict of a cell's or notebook's metadata ({} when absent or not a dict)."""
    meta = node.get("metadata", {}) or {}
    course = meta.get("course", {})
    return course if isinstance(course, dict) else {}


def notebook_name(nb: nbformat.NotebookNode) -> str | None:
    """``metadata.course.notebook`` ("NN_topic") or None."""
    name = course_meta(nb).get("notebook")
    return name if isinstance(name, str) and name else None


def grade_id(cell: dict[str, Any]) -> str | None:
    """The grade id of a check cell, or None for any other cell."""
    if cell.get("cell_type") != "code":
        return None
    gid = course_meta(cell).get("grade_id")
    return gid if isinstance(gid, str) and gid else None


def check_cells(nb: nbformat.NotebookNode) -> list[tuple[int, nbformat.NotebookNode]]:
    """``[(index in nb.cells, cell)]`` of every check cell, in notebook order."""
    return [(i, c) for i, c in enumerate(nb.cells) if grade_id(c) is not None]


def source_of(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def find_regions(source: str, begin: str, end: str, where: str) -> list[tuple[int, int, str]]:
    """Line spans ``[(begin_line, end_line, indent)]`` of ``begin``/``end`` marker pairs in ``source``.

    Raises NotebookError for nesting, a missing END, or an END without BEGIN.
    """
    regions, open_at, open_indent = [], None, ""
    for n, line in enumerate(source.splitlines()):
        m = _MARKER_RE.match(line)
        if not m:
            continue
        marker = m.group("marker")
        if marker == begin:
            if open_at is not None:
                raise NotebookError(f"{where}: '{begin}' on line {n + 1} inside the region opened on line "
                                    f"{open_at + 1}; close it with '{end}' first")
            open_at, open_indent = n, m.group("indent")
        elif marker == end:
            if open_at is None:
                raise NotebookError(f"{where}: '{end}' on line {n + 1} without a '{begin}' above it")
            regions.append((open_at, n, open_indent))
            open_at = None
    if open_at is not None:
        raise NotebookError(f"{where}: '{begin}' on line {open_at + 1} is never closed; add '{end}'")
    return regions


def validate_source_notebook(nb: nbformat.NotebookNode, where: str) -> None:
    """Check a hand-written solutions notebook against the schema; raise NotebookError on the first problem."""
    name = notebook_name(nb)
    if name is None:
        raise NotebookError(f"{where}: notebook metadata lacks course.notebook; add "
                            '{"course": {"notebook": "NN_topic"}} to the notebook metadata')
    if not _NOTEBOOK_NAME_RE.match(name):
        raise NotebookError(f"{where}: course.notebook is {name!r}; use the form NN_topic, e.g. '00_setup'")
    seen: dict[str, int] = {}
    for i, cell in enumerate(nb.cells):
        cwhere = f"{where} cell {i}"
        meta = course_meta(cell)
        if "grade_id" in meta or "points" in meta:
            if cell.cell_type != "code":
                raise NotebookError(f"{cwhere}: a {cell.cell_type} cell has grading metadata; only code "
                                    "cells can be check cells")
            gid, points = meta.get("grade_id"), meta.get("points")
            if not isinstance(gid, str) or not _GRADE_ID_RE.match(gid):
                raise NotebookError(f"{cwhere}: grade_id {gid!r} is not a simple identifier; use letters, "
                                    "digits, '_', '-', '.'")
            if gid in seen:
                raise NotebookError(f"{cwhere}: grade_id {gid!r} is already used by cell {seen[gid]}; "
                                    "grade ids must be unique in a notebook")
            seen[gid] = i
            if isinstance(points, bool) or not isinstance(points, int) or points <= 0:
                raise NotebookError(f"{cwhere}: check cell {gid!r} has points={points!r}; give it a "
                                    "positive integer")
        src = source_of(cell)
        sol = find_regions(src, BEGIN_SOLUTION, END_SOLUTION, cwhere)
        hidden = find_regions(src, BEGIN_HIDDEN, END_HIDDEN, cwhere)
        if sol and (grade_id(cell) is not None or cell.cell_type != "code"):
            raise NotebookError(f"{cwhere}: '{BEGIN_SOLUTION}' in a check or non-code cell; put the "
                                "learner's code in its own code cell above the check cell")
        if hidden and grade_id(cell) is None:
            raise NotebookError(f"{cwhere}: '{BEGIN_HIDDEN}' outside a check cell; hidden tests are only "
                                "restored in cells that carry a grade_id")
        if cell.cell_type == "code":
            ex = meta.get("exercise")
            if ex is not None and not isinstance(ex, str):
                raise NotebookError(f"{cwhere}: course.exercise must be a string (a grade id), got {ex!r}")
    if not seen:
        raise NotebookError(f"{where}: no check cell; give at least one code cell the metadata "
                            '{"course": {"grade_id": "...", "points": N}}')
