"""Known-wrong solutions: the shortcuts of ``tests/known_wrong/NN_topic.py`` must score zero where listed.

A file of its own (not in test_grading.py) so that pytest-xdist's ``--dist loadfile`` runs these gradings
on one worker while the course's solutions and exercises are graded on the other.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import grade
from course_lib.grading.notebook import grade_id

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
COURSE_TIMEOUT = 300


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


KNOWN_WRONG = sorted((REPO / "tests" / "known_wrong").glob("[0-9][0-9]_*.py"))
# COURSE_NOTEBOOKS=06,07 grades only those notebooks' shortcuts (while writing a check); unset: all
ONLY = [n.strip() for n in os.environ.get("COURSE_NOTEBOOKS", "").split(",") if n.strip()]


def load_known_wrong(path: Path) -> list[dict]:
    """``CASES`` of one ``tests/known_wrong/NN_topic.py``, validated against its solution notebook."""
    import runpy
    cases = runpy.run_path(str(path))["CASES"]
    sol = nbformat.read(str(REPO / "solutions" / f"{path.stem}.ipynb"), as_version=4)
    code_ids = {c.id for c in sol.cells if c.cell_type == "code" and grade_id(c) is None}
    gids = {grade_id(c) for c in sol.cells if grade_id(c)}
    for case in cases:
        where = f"{path.name}: case {case.get('name')!r}"
        assert case.get("name") and case.get("cells") and case.get("zero"), f"{where}: needs name, cells, zero"
        assert set(case["cells"]) <= code_ids, f"{where}: unknown solution cell ids {set(case['cells']) - code_ids}"
        assert set(case["zero"]) <= gids, f"{where}: unknown grade ids {set(case['zero']) - gids}"
    return cases


def known_wrong_batches() -> list[tuple[str, list[dict]]]:
    """Cases grouped into as few gradings as possible: cases in one run replace disjoint cells and list
    disjoint grade ids (each case lists every check its cells make fail)."""
    batches: list[tuple[str, list[dict]]] = []
    for path in KNOWN_WRONG:
        if ONLY and not any(path.stem.startswith(n) for n in ONLY):
            continue
        mine: list[list[dict]] = []
        for case in load_known_wrong(path):
            for batch in mine:
                if all(not (set(case["cells"]) & set(c["cells"]) or set(case["zero"]) & set(c["zero"]))
                       for c in batch):
                    batch.append(case)
                    break
            else:
                mine.append([case])
        batches += [(path.stem, b) for b in mine]
    return batches


def known_wrong_submission(name: str, cases: list[dict]) -> nbformat.NotebookNode:
    """The generated exercise with the solution's code in every code cell, then the cases' cells replaced."""
    sol = nbformat.read(str(REPO / "solutions" / f"{name}.ipynb"), as_version=4)
    ex = nbformat.read(str(REPO / "exercises" / f"{name}.ipynb"), as_version=4)
    source = {c.id: c.source for c in sol.cells if c.cell_type == "code" and grade_id(c) is None}
    for case in cases:
        source.update(case["cells"])
    for cell in ex.cells:
        if cell.cell_type == "code" and grade_id(cell) is None and cell.id in source:
            cell.source = source[cell.id]
    return ex


@pytest.fixture(scope="session")
def known_wrong_grades(tmp_path_factory):
    root = tmp_path_factory.mktemp("known_wrong")
    batches = known_wrong_batches()
    paths = [write(known_wrong_submission(name, cases), root / f"{name}__{i}.ipynb")
             for i, (name, cases) in enumerate(batches)]
    # Each run stops after the last check its cases list (--only): the checks up to there are graded,
    # the rest of the notebook does not run.
    reports = grade(paths, REPO / "solutions", timeout=COURSE_TIMEOUT, jobs=2,
                    only=[checks_through(name, {g for c in cases for g in c["zero"]}) for name, cases in batches])
    return list(zip(batches, reports))


def checks_through(name: str, listed: set[str]) -> list[str]:
    """The grade ids of solution ``name`` in notebook order, up to and including the last of ``listed``."""
    sol = nbformat.read(str(REPO / "solutions" / f"{name}.ipynb"), as_version=4)
    gids = [grade_id(c) for c in sol.cells if grade_id(c)]
    last = max(gids.index(g) for g in listed)
    return gids[:last + 1]


def test_every_exercise_notebook_has_known_wrong_cases():
    have = {p.stem for p in KNOWN_WRONG}
    missing = [p.stem for p in SOLUTIONS if p.stem not in have]
    assert not missing, f"add tests/known_wrong/<notebook>.py with at least one shortcut for: {missing}"


def test_known_wrong_solutions_score_zero_where_listed(known_wrong_grades):
    """Each shortcut scores 0 on its listed checks; the other checks of the same run still pass."""
    problems = []
    for (name, cases), report in known_wrong_grades:
        assert report.error is None, report.error
        status = {e.grade_id: e for e in report.exercises}
        listed = {g for c in cases for g in c["zero"]}
        for case in cases:
            for gid in case["zero"]:
                e = status[gid]
                if e.points != 0 or e.status not in ("fail", "error"):
                    problems.append(f"{name}: {case['name']!r} scored {e.points} on {gid} ({e.status})")
        for gid, e in status.items():
            if gid not in listed and e.status != "pass":
                problems.append(f"{name}: {gid} should still pass next to {[c['name'] for c in cases]}, "
                                f"got {e.status}: {e.message}")
    assert not problems, "\n".join(problems)
