"""Known-wrong solutions: the shortcuts of ``tests/known_wrong/NN_topic.py`` must score zero where listed.

A file of its own (not in test_grading.py) so that pytest-xdist's ``--dist loadfile`` runs these runs on
one worker while the course's exercises are graded on the other. The first pass of every run is the
solution itself, so this file also proves that every solution scores full marks.

All the cases of one notebook run in one kernel, one after another, the way a learner re-runs a check
after changing their code (the kernel start, the imports and the cluster start are most of a grading's
time, and 120 cases in their own gradings took 8.5 minutes of the suite). The notebook run is built from
the solution (whose check cells are what the grader restores into every submission) and executed by the
grader's own runner (``run_nbval``: pytest, nbval and the grader's plugin, the check cells' guards):

1. the solution's cells up to its last check, checks included (each must pass): the set-up (imports,
   cluster) and whatever a check cell defines that a later one uses;
2. for each case: the cells from the first one the case replaces to the last check it lists, with the
   case's sources; each listed check must fail (assertion or error), any other check in that span must
   pass; then the span's code cells again with the solution's sources (the checks not re-run). The first
   case of every notebook is its untouched exercise (the generated ``exercises/NN.ipynb``'s code cells):
   every check must fail, so an untouched exercise scores zero (its stub cells may raise);
3. every cell from the first case's span to the end with the solution's sources, checks included: every
   check must pass again, so a case that leaves the kernel, a module or the cluster broken (which could
   make a later case fail for the wrong reason) shows up here.

A case that must not share a kernel (one that leaves it in a state the solution cannot recover from, or
kills it) sets ``"own_kernel": True`` and runs alone, without step 3.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from course_lib.grading.grade import run_nbval
from course_lib.grading.notebook import grade_id

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
COURSE_TIMEOUT = 300

KNOWN_WRONG = sorted((REPO / "tests" / "known_wrong").glob("[0-9][0-9]_*.py"))
# COURSE_NOTEBOOKS=06,07 runs only those notebooks' shortcuts (while writing a check); unset: all
ONLY = [n.strip() for n in os.environ.get("COURSE_NOTEBOOKS", "").split(",") if n.strip()]


def solution(name: str) -> nbformat.NotebookNode:
    return nbformat.read(str(REPO / "solutions" / f"{name}.ipynb"), as_version=4)


def load_known_wrong(path: Path) -> list[dict]:
    """``CASES`` of one ``tests/known_wrong/NN_topic.py``, validated against its solution notebook."""
    import runpy
    cases = runpy.run_path(str(path))["CASES"]
    sol = solution(path.stem)
    code_ids = {c.id for c in sol.cells if c.cell_type == "code" and grade_id(c) is None}
    gids = {grade_id(c) for c in sol.cells if grade_id(c)}
    for case in cases:
        where = f"{path.name}: case {case.get('name')!r}"
        assert case.get("name") and case.get("cells") and case.get("zero"), f"{where}: needs name, cells, zero"
        assert set(case["cells"]) <= code_ids, f"{where}: unknown solution cell ids {set(case['cells']) - code_ids}"
        assert set(case["zero"]) <= gids, f"{where}: unknown grade ids {set(case['zero']) - gids}"
        assert set(case) <= {"name", "cells", "zero", "own_kernel"}, f"{where}: unknown keys {set(case)}"
    return cases


def untouched_exercise_case(name: str) -> dict:
    """The generated exercise as a case: its code cells that differ from the solution's (the stubs), every
    check listed. (tests/test_grading.py also grades two untouched exercises with the grader itself.)"""
    sol = {c.id: c for c in solution(name).cells}
    ex = nbformat.read(str(REPO / "exercises" / f"{name}.ipynb"), as_version=4)
    cells = {c.id: c.source for c in ex.cells if c.cell_type == "code" and not grade_id(c)
             and c.id in sol and c.source != sol[c.id].source}
    assert cells, f"exercises/{name}.ipynb has no stub: run `python -m course_lib.grading build`"
    gids = [grade_id(c) for c in ex.cells if grade_id(c)]
    return {"name": "the untouched exercise", "cells": cells, "zero": gids, "stubs": True}


def known_wrong_runs() -> list[tuple[str, list[dict]]]:
    """(notebook, cases) per kernel: one run per notebook (its untouched exercise first), plus one per
    ``own_kernel`` case."""
    runs = []
    for path in KNOWN_WRONG:
        if ONLY and not any(path.stem.startswith(n) for n in ONLY):
            continue
        cases = load_known_wrong(path)
        shared = [untouched_exercise_case(path.stem)] + [c for c in cases if not c.get("own_kernel")]
        runs += [(path.stem, shared)] if shared else []
        runs += [(path.stem, [c]) for c in cases if c.get("own_kernel")]
    return runs


def _cell(cell, tag: str, source: str | None = None) -> nbformat.NotebookNode:
    new = copy.deepcopy(cell)
    new.id = f"{tag}-{cell.id}"[:64]
    if source is not None:
        new.source = source
    new.outputs, new.execution_count = [], None
    return new


def known_wrong_notebook(name: str, cases: list[dict]) -> tuple[nbformat.NotebookNode, list[tuple]]:
    """The notebook run for ``cases`` (see the module docstring) and, per code cell in run order, what
    its outcome must be: ``(case name or None, grade id, "fail" | "pass")``, None for a code cell (must
    run without error) or ``"any"`` for an exercise's stub cell (may raise)."""
    sol = solution(name)
    code = [c for c in sol.cells if c.cell_type == "code"]
    checks = [k for k, c in enumerate(code) if grade_id(c)]
    where = {c.id: k for k, c in enumerate(code)}
    nb = copy.deepcopy(sol)
    nb.cells, expect = [], []

    def add(cell, tag, source=None, want=None):
        nb.cells.append(_cell(cell, tag, source))
        expect.append(want)

    for k in range(checks[-1] + 1):                   # 1. the solution up to its last check: all pass
        gid = grade_id(code[k])
        add(code[k], "setup", None, None if gid is None else ("solution", gid, "pass"))
    starts = []
    for i, case in enumerate(cases):                  # 2. each case, then the solution's code back
        start = min(where[cid] for cid in case["cells"])
        end = max([where[cid] for cid in case["cells"]]
                  + [k for k in checks if grade_id(code[k]) in case["zero"]])
        starts.append(start)
        early = [grade_id(code[k]) for k in checks if k < start and grade_id(code[k]) in case["zero"]]
        assert not early, f"{name}: case {case['name']!r} lists {early}, which run before the cells it replaces"
        for k in range(start, end + 1):
            gid = grade_id(code[k])
            want = (("any" if case.get("stubs") else None) if gid is None
                    else (case["name"], gid, "fail" if gid in case["zero"] else "pass"))
            add(code[k], f"case{i}", case["cells"].get(code[k].id), want)
        for k in range(start, end + 1):
            if not grade_id(code[k]):
                add(code[k], f"undo{i}")
    if len(cases) == 1 and cases[0].get("own_kernel"):
        return nb, expect                             # alone in its kernel: no later case to protect
    for k in range(min(starts), len(code)):           # 3. the solution again, every check passes
        gid = grade_id(code[k])
        add(code[k], "after", None, None if gid is None else (None, gid, "pass"))
    return nb, expect


def run_known_wrong(name: str, cases: list[dict]) -> list[tuple[str, str]]:
    """Problems found in one run, each ``(kind, message)``: kind ``"solution"`` for the solution's own first
    pass (a check that fails there fails the solution), ``"case"`` for everything after it."""
    nb, expect = known_wrong_notebook(name, cases)
    workdir = Path(tempfile.mkdtemp(prefix="course-known-wrong-"))
    try:
        records, output, code = run_nbval(nb, COURSE_TIMEOUT, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    by_cell = {r["cell"]: r for r in records}
    problems = []
    for n, want in enumerate(expect):
        rec = by_cell.get(n, {"outcome": "not_run", "ename": "", "evalue": "the run stopped before it"})
        got = rec["outcome"]
        what = f"{rec.get('ename', '')}: {rec.get('evalue', '')}"
        kind = "solution" if nb.cells[n].id.startswith("setup-") else "case"
        if want == "any":
            continue
        if want is None:
            if got not in ("passed", "skipped"):
                problems.append((kind, f"{name}: code cell {n} ({nb.cells[n].id}) {got}: {what}"))
            continue
        case, gid, should = want
        if case == "solution":
            label = f"{gid}, with the solution (a fresh kernel, every cell in order)"
        elif case:
            label = f"{case!r} on {gid}"
        else:
            label = f"{gid}, run with the solution again after every case"
        if should == "fail" and got != "error":
            problems.append((kind, f"{name}: {label}: the check {'passed' if got == 'passed' else got} "
                                   "(it must fail: an assertion or an error)" + ("" if got == "passed" else f": {what}")))
        elif should == "pass" and got != "passed":
            problems.append((kind, f"{name}: {label}: must pass, {got}: {what}"))
    if code is None:
        problems.append(("case", f"{name}: the run overran its overall time budget"))
    return problems


@pytest.fixture(scope="session")
def known_wrong_problems() -> dict[str, list[tuple[str, str]]]:
    """``{notebook: [(kind, message)]}`` over all its runs (empty lists: nothing wrong)."""
    runs = known_wrong_runs()
    with ThreadPoolExecutor(max_workers=2) as pool:   # each run is its own pytest process and kernel
        found = list(pool.map(lambda r: run_known_wrong(*r), runs))
    out: dict[str, list[tuple[str, str]]] = {}
    for (name, _), problems in zip(runs, found):
        out.setdefault(name, []).extend(problems)
    return out


def test_every_exercise_notebook_has_known_wrong_cases():
    have = {p.stem for p in KNOWN_WRONG}
    missing = [p.stem for p in SOLUTIONS if p.stem not in have]
    assert not missing, f"add tests/known_wrong/<notebook>.py with at least one shortcut for: {missing}"


def test_a_case_run_fails_where_the_case_should_and_restores_the_solution():
    """The run's plan, without running it: a case's span, the undo, the final re-check."""
    name = "13_scaling_laws"
    case = load_known_wrong(REPO / "tests" / "known_wrong" / f"{name}.py")[0]
    nb, expect = known_wrong_notebook(name, [case])
    ids = [c.id for c in nb.cells]
    assert any(i.startswith("case0-") for i in ids) and any(i.startswith("undo0-") for i in ids)
    assert {w[1] for w in expect if w and w[0] and w[2] == "fail"} == set(case["zero"])
    after = [w[1] for w in expect if w and w[0] is None]
    assert after[-1] == [grade_id(c) for c in solution(name).cells if grade_id(c)][-1]
    assert len(set(ids)) == len(ids)
    # The untouched exercise: its stub cells may raise, every check must fail.
    stub = untouched_exercise_case(name)
    nb, expect = known_wrong_notebook(name, [stub])
    in_case = [w for c, w in zip(nb.cells, expect) if c.id.startswith("case0-")]
    assert "any" in in_case and all(w[2] == "fail" for w in in_case if isinstance(w, tuple))
    assert {w[1] for w in in_case if isinstance(w, tuple)} == set(stub["zero"])


def test_the_runner_reports_a_passing_shortcut_and_a_broken_kernel():
    """Two planted cases on notebook 13 (pure Python, quick): the solution's own code listed as a shortcut
    (its check passes: reported), and a case that breaks numpy for good (the re-run after it fails)."""
    name = "13_scaling_laws"
    ex = next(c for c in solution(name).cells if c.cell_type == "code" and c.id.startswith("ex"))
    honest = {"name": "the solution itself", "cells": {ex.id: ex.source}, "zero": ["optimal_allocation"]}
    breaker = {"name": "breaks numpy", "cells": {ex.id: ex.source + "\nimport numpy\nnumpy.log = None\n"},
               "zero": ["optimal_allocation"]}
    problems = [m for _, m in run_known_wrong(name, [honest, breaker])]
    assert any("'the solution itself' on optimal_allocation: the check passed" in p for p in problems), problems
    assert any("run with the solution again after every case: must pass" in p for p in problems), problems


@pytest.mark.parametrize("name", [p.stem for p in SOLUTIONS])
def test_course_solution_scores_full_marks(known_wrong_problems, name):
    """The solution, run first in each of its notebook's runs (a fresh kernel, every cell in order, the
    grader's runner and check cells), passes every check: full marks."""
    if name not in known_wrong_problems:
        if ONLY and not any(name.startswith(n) for n in ONLY):
            pytest.skip(f"{name} not in COURSE_NOTEBOOKS")
        pytest.fail(f"{name} was not run: add tests/known_wrong/{name}.py (its runs start with the solution)")
    bad = [m for kind, m in known_wrong_problems[name] if kind == "solution"]
    assert not bad, "\n".join(bad)


def test_known_wrong_solutions_score_zero_where_listed(known_wrong_problems):
    """Each shortcut fails its listed checks; the other checks of its span, and every check re-run with
    the solution after all cases, pass."""
    bad = [m for problems in known_wrong_problems.values() for kind, m in problems if kind == "case"]
    assert not bad, "\n".join(bad)
