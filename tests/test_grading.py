"""Tests for course_lib.grading: exercise generation, the nbval grader, and the course's own notebooks.

Synthetic notebooks (pure Python, no cluster) exercise the grader's mechanics quickly; the last section
grades every ``solutions/*.ipynb`` and its generated exercise once per session and proves that each
solution earns full marks and each untouched exercise earns zero on every graded cell.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib.grading import NotebookError, build, grade, load_solutions, make_exercise
from course_lib.grading.__main__ import main
from course_lib.grading.grade import grade_one, identify_notebook, prepare_submission
from course_lib.grading.notebook import grade_id
from course_lib.launch import pids_with_env

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
NAME = "99_synthetic"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


# ----------------------------------------------------------------------------- synthetic notebooks

def check_cell(src: str, gid: str, points: int):
    return new_code_cell(src, metadata={"course": {"grade_id": gid, "points": points}})


def synthetic_solution() -> nbformat.NotebookNode:
    """Three independent exercises: one with hidden tests, one with two regions, one plain."""
    nb = new_notebook(metadata={"course": {"notebook": NAME}, "kernelspec": KERNELSPEC})
    nb.cells = [
        new_markdown_cell("# Synthetic exercises"),
        new_code_cell("def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        check_cell("assert square(3) == 9, f'square(3): expected 9, got {square(3)}'\n"
                   "### BEGIN HIDDEN TESTS\n"
                   "assert square(-2) == 4, f'square(-2): expected 4, got {square(-2)}'\n"
                   "### END HIDDEN TESTS", "square", 2),
        new_code_cell("def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION\n\n"
                      "def neg(a):\n    if True:\n        ### BEGIN SOLUTION\n        return -a\n"
                      "        ### END SOLUTION", metadata={"course": {"exercise": "add-and-neg"}}),
        check_cell("assert add(2, 3) == 5, f'add(2, 3): expected 5, got {add(2, 3)}'\n"
                   "assert neg(4) == -4, f'neg(4): expected -4, got {neg(4)}'", "add_neg", 3),
        new_markdown_cell("Independent of the two above."),
        new_code_cell("### BEGIN SOLUTION\ndef total(xs):\n    return sum(xs)\n### END SOLUTION"),
        check_cell("assert total([1, 2, 3]) == sum([1, 2, 3]), f'total([1, 2, 3]) gave {total([1, 2, 3])}'",
                   "total", 1),
    ]
    # A stored output and execution count, which the exercise must not keep.
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="defined\n")]
    nb.cells[1].execution_count = 7
    return nb


SOLVED = {  # learner code for the solution cells, by index in synthetic_solution()
    1: "def square(x):\n    return x ** 2",
    3: "def add(a, b):\n    return b + a\n\ndef neg(a):\n    return 0 - a",
    6: "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s",
}


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def submission(exercise, **cells) -> nbformat.NotebookNode:
    """A copy of ``exercise`` with cell ``c<i>`` replaced by the given source (as a learner would)."""
    nb = copy.deepcopy(exercise)
    for key, src in cells.items():
        nb.cells[int(key[1:])].source = src
    return nb


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A tiny course: solutions/ and the exercises/ built from it."""
    root = tmp_path_factory.mktemp("course")
    write(synthetic_solution(), root / "solutions" / f"{NAME}.ipynb")
    build(root / "solutions", root / "exercises")
    ex = nbformat.read(str(root / "exercises" / f"{NAME}.ipynb"), as_version=4)
    return root, ex


def cli(*args, cwd=None, env=None):
    return subprocess.run([PY, "-m", "course_lib.grading", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def cli_inproc(capsys, *args):
    """The CLI without a new interpreter (fast); returns an object like CompletedProcess."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


# ----------------------------------------------------------------------------- build

def test_build_makes_stubs_keeps_ids_and_metadata(course):
    root, ex = course
    sol = synthetic_solution()
    solution_file = nbformat.read(str(root / "solutions" / f"{NAME}.ipynb"), as_version=4)
    assert [c.id for c in ex.cells] == [c.id for c in solution_file.cells]
    assert [c.metadata for c in ex.cells] == [c.metadata for c in solution_file.cells]
    assert ex.metadata["course"] == {"notebook": NAME}
    assert ex.cells[1].source == ("def square(x):\n    # YOUR CODE HERE\n"
                                  "    raise NotImplementedError(\"exercise 'square': write your code here\")")
    # Two regions, the second more deeply indented, named by the optional course.exercise key.
    assert ex.cells[3].source.count("raise NotImplementedError(\"exercise 'add-and-neg'") == 2
    assert "\n        raise NotImplementedError" in ex.cells[3].source
    assert "return" not in ex.cells[3].source and "### " not in ex.cells[3].source
    # A region at top level.
    assert ex.cells[6].source.startswith("# YOUR CODE HERE\nraise NotImplementedError(\"exercise 'total'")
    # Hidden checks removed, visible ones kept.
    assert "square(-2)" not in ex.cells[2].source and "square(3)" in ex.cells[2].source
    assert "HIDDEN" not in ex.cells[2].source
    assert all(c.outputs == [] and c.execution_count is None for c in ex.cells if c.cell_type == "code")
    assert sol.cells[1].execution_count == 7  # make_exercise works on a copy
    assert make_exercise(sol).cells[1].outputs == []


def test_build_check_detects_stale_missing_and_orphans(tmp_path, capsys):
    write(synthetic_solution(), tmp_path / "solutions" / f"{NAME}.ipynb")
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    r = cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex, "--check")
    assert r.returncode == 1 and f"{NAME}.ipynb" in r.stderr, r.stderr      # missing
    assert cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex).returncode == 0
    before = (ex / f"{NAME}.ipynb").read_bytes()
    r = cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex, "--check")
    assert r.returncode == 0, r.stderr
    assert cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex).returncode == 0
    assert (ex / f"{NAME}.ipynb").read_bytes() == before                    # deterministic
    (ex / f"{NAME}.ipynb").write_text(before.decode().replace("YOUR CODE HERE", "my edit"))
    r = cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex, "--check")
    assert r.returncode == 1 and f"{NAME}.ipynb" in r.stderr                 # hand-edited
    (ex / f"{NAME}.ipynb").write_bytes(before)
    write(synthetic_solution(), ex / "98_gone.ipynb")
    r = cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex, "--check")
    assert r.returncode == 1 and "98_gone.ipynb" in r.stderr                 # orphan
    assert cli_inproc(capsys, "build", "--solutions", sol, "--exercises", ex).returncode == 0
    assert not (ex / "98_gone.ipynb").exists()


def _broken(mutate) -> nbformat.NotebookNode:
    nb = synthetic_solution()
    mutate(nb)
    return nb


@pytest.mark.parametrize("mutate, words", [
    (lambda nb: setattr(nb.cells[1], "source", "def f():\n    ### BEGIN SOLUTION\n    return 1"), "never closed"),
    (lambda nb: setattr(nb.cells[1], "source", "x = 1\n### END SOLUTION"), "without a"),
    (lambda nb: setattr(nb.cells[2], "source", nb.cells[2].source + "\n### BEGIN SOLUTION\n### END SOLUTION"),
     "check or non-code cell"),
    (lambda nb: setattr(nb.cells[1], "source", "### BEGIN HIDDEN TESTS\n### END HIDDEN TESTS"), "outside a check"),
    (lambda nb: nb.cells[4].metadata["course"].update(grade_id="square"), "already used"),
    (lambda nb: nb.cells[4].metadata["course"].update(points=0), "positive integer"),
    (lambda nb: nb.metadata.pop("course"), "course.notebook"),
    (lambda nb: [nb.cells.pop(7), nb.cells.pop(4), nb.cells.pop(2)], "no check cell"),
    (lambda nb: setattr(nb.cells[2], "source", "if True:\n    ### BEGIN HIDDEN TESTS\n    assert 1\n"
                        "    ### END HIDDEN TESTS\nelse:\n    pass"), "not valid Python"),
    (lambda nb: setattr(nb.cells[1], "source", "for i in range(2):\n### BEGIN SOLUTION\n    pass\n"
                        "### END SOLUTION"), "not valid Python"),
])
def test_build_rejects_malformed_solutions(mutate, words):
    nb = _broken(mutate)
    with pytest.raises(NotebookError, match=words):
        make_exercise(nb, "x.ipynb")


def test_build_cli_reports_malformed_solution_with_exit_2(tmp_path, capsys):
    nb = _broken(lambda nb: setattr(nb.cells[1], "source", "### BEGIN SOLUTION\nx = 1"))
    write(nb, tmp_path / "solutions" / f"{NAME}.ipynb")
    r = cli_inproc(capsys, "build", "--solutions", tmp_path / "solutions", "--exercises", tmp_path / "exercises")
    assert r.returncode == 2 and "never closed" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_repository_exercises_are_up_to_date():
    r = cli("build", "--check", cwd=REPO)
    assert r.returncode == 0, f"exercises/ is stale:\n{r.stderr}"


# ----------------------------------------------------------------------------- restoring (no kernel)

def test_deleted_check_cell_goes_back_after_its_code_cell_or_at_the_end(course):
    root, ex = course
    sol = load_solutions(root / "solutions")[NAME]
    sub = copy.deepcopy(ex)
    del sub.cells[4]                           # add_neg's check; its code cell (3) keeps its id
    sub.cells[5].id = "renamed"                # total's code cell lost its id (e.g. re-created)
    del sub.cells[6]                           # total's check
    nb, restored = prepare_submission(sub, sol, "sub.ipynb")
    assert restored == {"add_neg": "deleted", "total": "deleted"}
    ids = [grade_id(c) for c in nb.cells]
    assert ids.index("add_neg") == 4           # right after the code cell it checks
    assert ids[-1] == "total"                  # anchor gone: at the end, after all learner code
    assert "square(-2)" in nb.cells[2].source  # hidden tests are back
    # No cell ids at all (an old notebook format): before the next check cell, i.e. after this
    # exercise's code and the next one's, never before the learner's code.
    sub = copy.deepcopy(ex)
    for cell in sub.cells:
        cell.id = f"learner-{id(cell)}"
    del sub.cells[2]
    nb, restored = prepare_submission(sub, sol, "sub.ipynb")
    assert restored == {"square": "deleted"}
    assert [grade_id(c) for c in nb.cells if grade_id(c)] == ["square", "add_neg", "total"]
    assert [grade_id(c) for c in nb.cells].index("square") == 3  # after add()/neg()'s cell


def test_unchanged_check_cells_are_not_flagged(course):
    root, ex = course
    sol = load_solutions(root / "solutions")[NAME]
    assert prepare_submission(copy.deepcopy(ex), sol, "ex")[1] == {}
    assert prepare_submission(copy.deepcopy(sol), sol, "sol")[1] == {}


def test_metadata_dropped_by_an_editor_is_recovered_from_check_cell_sources(course):
    root, ex = course
    sols = load_solutions(root / "solutions")
    sub = copy.deepcopy(ex)
    sub.metadata.pop("course")
    for cell in sub.cells:
        cell.metadata = {}
    assert identify_notebook(sub, sols) == NAME
    nb, restored = prepare_submission(sub, sols[NAME], "stripped.ipynb")
    assert restored == {}
    assert [grade_id(c) for c in nb.cells if grade_id(c)] == ["square", "add_neg", "total"]
    report = grade_one(write(lecture_like(ex), root / "lecture_stripped.ipynb"), sols)
    assert "not a notebook of this course" in report.error


def lecture_like(ex):
    nb = copy.deepcopy(ex)
    nb.metadata.pop("course")
    nb.cells = [c for c in nb.cells if grade_id(c) is None]
    return nb


# ----------------------------------------------------------------------------- bad input (no kernel)

def bad_inputs(root: Path, ex) -> dict[str, Path]:
    d = root / "bad"
    d.mkdir(exist_ok=True)
    (d / "text.ipynb").write_text("this is not json")
    (d / "list.ipynb").write_text("[1, 2]")
    lecture = copy.deepcopy(ex)
    lecture.cells = [c for c in lecture.cells if grade_id(c) is None]
    other = new_notebook(metadata={"kernelspec": KERNELSPEC}, cells=[new_code_cell("print('hello')")])
    unknown_nb = copy.deepcopy(ex)
    unknown_nb.metadata["course"]["notebook"] = "42_elsewhere"
    bogus = copy.deepcopy(ex)
    bogus.cells[4].metadata["course"]["grade_id"] = "bogus"
    return {"text": d / "text.ipynb", "list": d / "list.ipynb",
            "lecture": write(lecture, d / "lecture.ipynb"), "other": write(other, d / "other.ipynb"),
            "unknown_nb": write(unknown_nb, d / "unknown_nb.ipynb"), "bogus": write(bogus, d / "bogus.ipynb"),
            "missing": d / "does_not_exist.ipynb"}


@pytest.mark.parametrize("kind, words", [
    ("text", "not a Jupyter notebook"), ("list", "not a Jupyter notebook"), ("lecture", "no graded cells"),
    ("other", "not a notebook of this course"), ("unknown_nb", "not an exercise of this course"),
    ("bogus", "grade_id 'bogus'"), ("missing", "no such file"),
])
def test_bad_input_gives_one_line_error(course, kind, words):
    root, ex = course
    path = bad_inputs(root, ex)[kind]
    report = grade_one(path, load_solutions(root / "solutions"))
    assert report.error and words in report.error and "\n" not in report.error
    assert report.exercises == []


# ----------------------------------------------------------------------------- grading runs

# Seconds per cell in the synthetic runs: far above what their cells need (pure Python, under 0.1 s each,
# even on a busy machine; the kernel's start is not counted), and what each endless loop below burns.
TIMEOUT = 5


@pytest.fixture(scope="module")
def graded(course):
    """One CLI run over a folder of synthetic submissions (plus one bad file); JSON, CSV, stdout."""
    root, ex = course
    sol = nbformat.read(str(root / "solutions" / f"{NAME}.ipynb"), as_version=4)
    subs = root / "submissions"
    write(sol, subs / "a_solution.ipynb")
    write(ex, subs / "b_exercise.ipynb")
    write(submission(ex, c1=SOLVED[1]), subs / "c_partial.ipynb")
    tampered = submission(ex, c1="def square(x):\n    return 3 * x", c3=SOLVED[3], c6=SOLVED[6])
    tampered.cells[2].source = "assert True  # looks fine to me"         # edited check
    tampered.cells[2].metadata["course"]["points"] = 100                  # ...and its points
    dup = copy.deepcopy(tampered.cells[7])
    dup.id = "copy-of-total"
    tampered.cells.insert(7, dup)                                         # duplicated check
    del tampered.cells[4]                                                 # deleted check
    write(tampered, subs / "d_tampered.ipynb")
    write(submission(ex, c1="def square(x):\n    while True:\n        pass", c3=SOLVED[3], c6=SOLVED[6]),
          subs / "e_loops.ipynb")
    write(submission(ex, c1="def square(x):\n    import signal\n"
                     "    signal.signal(signal.SIGINT, signal.SIG_IGN)  # cannot be interrupted\n"
                     "    while True:\n        pass", c3=SOLVED[3], c6=SOLVED[6]), subs / "f_stubborn.ipynb")
    write(submission(ex, c1=SOLVED[1], c3="import os\nos._exit(3)", c6=SOLVED[6]), subs / "g_dies.ipynb")
    (subs / "h_notes.ipynb").write_text("not a notebook at all")
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in subs.iterdir()}
    out_json, out_csv = root / "grades.json", root / "grades.csv"
    tag = uuid.uuid4().hex  # in the environment of every process of the run, to find any left behind
    r = cli("grade", subs, "--solutions", root / "solutions", "--timeout", TIMEOUT,
            "--json", out_json, "--csv", out_csv, "--jobs", 2, env={**os.environ, "COURSE_GRADING_TAG": tag})
    reports = {Path(s["submission"]).stem: s for s in json.loads(out_json.read_text())["submissions"]}
    return {"run": r, "reports": reports, "csv": out_csv.read_text(), "snapshot": snapshot, "dir": subs,
            "leftover": processes_tagged(tag) if os.path.exists("/proc/self/environ") else None}


def processes_tagged(tag: str, within: float = 10.0) -> list[int]:
    """Pids whose environment carries ``COURSE_GRADING_TAG=tag``, after up to ``within`` seconds for
    killed kernels to be reaped."""
    return pids_with_env(f"COURSE_GRADING_TAG={tag}", within)


def ex_of(report, gid):
    return next(e for e in report["exercises"] if e["grade_id"] == gid)


def test_grading_never_writes_to_submissions(graded):
    now = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in graded["dir"].iterdir()}
    assert now == graded["snapshot"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux) to find processes")
def test_grading_leaves_no_process_behind(graded):
    """Kernels that looped, ignored SIGINT or died, and their children, are all gone after the run."""
    assert graded["leftover"] == [], f"processes of the grading run left behind: {graded['leftover']}"


def test_solution_full_marks_exercise_zero(graded):
    a, b = graded["reports"]["a_solution"], graded["reports"]["b_exercise"]
    assert (a["total"], a["max_total"]) == (6, 6)
    assert all(e["status"] == "pass" and e["restored"] is None for e in a["exercises"])
    assert b["total"] == 0
    for e in b["exercises"]:
        assert e["status"] == "error" and e["points"] == 0
        # A stub inside a function raises when the check calls it; a top-level stub leaves a NameError.
        assert e["message"].startswith(("NotImplementedError: exercise", "NameError: name 'total'")), e


def test_partial_submission_scores_in_between(graded):
    c = graded["reports"]["c_partial"]
    assert [(e["grade_id"], e["points"], e["status"]) for e in c["exercises"]] == \
        [("square", 2, "pass"), ("add_neg", 0, "error"), ("total", 0, "error")]


def test_tampered_check_cells_are_restored_and_flagged(graded):
    d = graded["reports"]["d_tampered"]
    sq, an, tot = (ex_of(d, g) for g in ("square", "add_neg", "total"))
    # 3 * x passes the visible check (square(3) == 9) and the edited one; the restored hidden check
    # catches it, and the points come from the solution, not from the edited metadata.
    assert (sq["status"], sq["restored"], sq["points"], sq["max_points"]) == ("fail", "edited", 0, 2)
    assert sq["message"] == "AssertionError: square(-2): expected 4, got -6"
    assert (an["status"], an["restored"], an["points"]) == ("pass", "deleted", 3)
    assert (tot["status"], tot["restored"], tot["points"]) == ("pass", "duplicated", 1)


def test_endless_loop_times_out_and_later_exercises_still_score(graded):
    e = graded["reports"]["e_loops"]
    assert ex_of(e, "square")["status"] == "timeout" and ex_of(e, "square")["points"] == 0
    assert ex_of(e, "add_neg")["points"] == 3 and ex_of(e, "total")["points"] == 1


def test_uninterruptible_loop_still_gives_a_report(graded):
    f = graded["reports"]["f_stubborn"]
    assert ex_of(f, "square")["status"] == "timeout"
    assert {ex_of(f, g)["status"] for g in ("add_neg", "total")} == {"not run"}
    assert "could not be interrupted" in ex_of(f, "add_neg")["message"]
    assert f["total"] == 0 and f["error"] is None


def test_dying_kernel_still_gives_a_report(graded):
    g = graded["reports"]["g_dies"]
    assert ex_of(g, "square")["points"] == 2
    assert [ex_of(g, x)["status"] for x in ("add_neg", "total")] == ["not run", "not run"]
    assert "kernel died" in ex_of(g, "add_neg")["message"]
    assert any("kernel died" in n for n in g["notes"])


def test_cli_outputs_table_csv_and_exit_status(graded):
    r = graded["run"]
    assert r.returncode == 1, r.stderr  # one submission was rejected; the others were graded
    assert "h_notes.ipynb: not a Jupyter notebook" in r.stderr
    assert "total" in r.stdout and "NotImplementedError: exercise 'square'" in r.stdout
    rows = graded["csv"].strip().splitlines()
    assert rows[0] == f"submission,notebook,total,max_total,{NAME}:square,{NAME}:add_neg,{NAME}:total,restored,error"
    assert len(rows) == 1 + 8
    partial = next(row for row in rows if "c_partial" in row)
    assert partial.split(",")[1:7] == [NAME, "2", "6", "2", "0", "0"]


def test_only_grades_the_chosen_exercises_and_stops_after_them(course, tmp_path, capsys):
    root, ex = course
    sol = write(nbformat.read(str(root / "solutions" / f"{NAME}.ipynb"), as_version=4), tmp_path / "s.ipynb")
    r = cli_inproc(capsys, "grade", sol, "--solutions", root / "solutions", "--only", "add_neg", "--json",
                   tmp_path / "g.json")
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "g.json").read_text())["submissions"][0]
    assert [(e["grade_id"], e["status"]) for e in rep["exercises"]] == [("add_neg", "pass")]
    assert rep["total"] == rep["max_total"] == 3
    assert any("graded only add_neg" in n for n in rep["notes"])
    bad = cli_inproc(capsys, "grade", sol, "--solutions", root / "solutions", "--only", "nope")
    assert bad.returncode == 1 and "its grade ids are: square, add_neg, total" in bad.stderr


def test_cli_exit_status_zero_whatever_the_scores(monkeypatch, capsys, tmp_path):
    """Exit codes of `grade` without running a kernel: zero points is still a successful grading."""
    import course_lib.grading.__main__ as cli_mod
    from course_lib.grading import ExerciseResult, Report
    zero = Report("x.ipynb", NAME, [ExerciseResult("square", 0, 2, "error", "NameError: name 'square' ...")])
    monkeypatch.setattr(cli_mod, "grade", lambda *a, **k: [zero])
    assert main(["grade", "x.ipynb", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == "x.ipynb: 0/2"
    monkeypatch.setattr(cli_mod, "grade", lambda *a, **k: [zero, Report("y.ipynb", error="y.ipynb: bad")])
    assert main(["grade", "x.ipynb", "y.ipynb", "--csv", str(tmp_path / "g.csv")]) == 1
    assert "error: y.ipynb: bad" in capsys.readouterr().err
    assert (tmp_path / "g.csv").read_text().splitlines()[2].endswith("y.ipynb: bad")
    monkeypatch.setattr(cli_mod, "grade", lambda *a, **k: [])
    assert main(["grade", str(tmp_path)]) == 2  # an empty folder: nothing to grade


# ----------------------------------------------------------------------------- the course's notebooks

SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
COURSE_TIMEOUT = 300
# Two untouched exercises go through the grader itself, end to end (one without a cluster, one whose
# checks run on subgroups of a 4-rank cluster). That every untouched exercise scores zero on every check
# is proved for all of them in tests/test_known_wrong.py (the first case of each notebook's run), and that
# every solution scores full marks too (its runs start with the solution).
END_TO_END = ["00_setup", "07_tensor_parallel"]


@pytest.fixture(scope="session")
def course_grades():
    """The END_TO_END exercises, untouched, graded once per session."""
    # COURSE_NOTEBOOKS=06,07 grades only those notebooks (the others' tests skip); unset: all
    only = [n.strip() for n in os.environ.get("COURSE_NOTEBOOKS", "").split(",") if n.strip()]
    chosen = [n for n in END_TO_END if not only or any(n.startswith(o) for o in only)]
    reports = grade([REPO / "exercises" / f"{n}.ipynb" for n in chosen], REPO / "solutions",
                    timeout=COURSE_TIMEOUT, jobs=2)
    return {(Path(r.submission).parent.name, Path(r.submission).stem): r for r in reports}


def test_every_solution_has_its_exercise():
    missing = [p.stem for p in SOLUTIONS if not (REPO / "exercises" / p.name).is_file()]
    assert not missing, f"exercises/ lacks {missing}: run `python -m course_lib.grading build`"


@pytest.mark.parametrize("name", END_TO_END)
def test_course_exercise_scores_zero_on_every_graded_cell(course_grades, name):
    """Strict: every check cell ran and failed (not timed out, not skipped by a dead kernel)."""
    assert (REPO / "solutions" / f"{name}.ipynb").is_file(), f"END_TO_END names {name}, which is not a notebook"
    if ("exercises", name) not in course_grades:
        pytest.skip(f"{name} not in COURSE_NOTEBOOKS")
    r = course_grades[("exercises", name)]
    assert r.error is None, r.error
    assert r.exercises and r.max_total > 0
    for e in r.exercises:
        assert e.points == 0 and e.status in ("fail", "error"), f"{name}:{e.grade_id} {e.status}: {e.message}"
        assert e.restored is None


def test_a_kernel_that_never_started_is_started_again_but_nothing_else_is():
    """Only a kernel that died before answering (no cell ran) earns a second start; a cell that killed it,
    or cells that ran and failed, are the submission's own results."""
    from course_lib.grading.grade import _kernel_never_started
    start = {"cell": 0, "outcome": "not_run", "ename": "RuntimeError",
             "evalue": "Kernel died before replying to kernel_info"}
    assert _kernel_never_started([start, {**start, "cell": 1}])
    assert not _kernel_never_started([])
    assert not _kernel_never_started([{"cell": 0, "outcome": "kernel_died", "ename": "KernelDied", "evalue": "x"},
                                      {"cell": 1, "outcome": "not_run", "ename": "KernelDead", "evalue": "y"}])
    assert not _kernel_never_started([{"cell": 0, "outcome": "passed"}, {**start, "cell": 1}])
