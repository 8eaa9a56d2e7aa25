"""Grade submitted exercise notebooks with nbval.

For each submission:

1. read it and find its canonical solution by ``metadata.course.notebook`` (one-line errors for a file
   that is not a notebook, a notebook of another course, one without graded cells, an unknown grade id);
2. in a copy, put back every check cell from the solution (hidden tests included) by ``grade_id``:
   an edited check cell is replaced, a deleted one is re-inserted after the cell that precedes it in the
   solution (matched by cell id) or at the end, duplicates are dropped keeping the last; each is flagged;
   outputs are cleared so that no stored output is ever compared;
3. run ``python -m pytest --nbval-lax`` on the copy in a temporary folder, with a per-cell timeout and
   :mod:`course_lib.grading.nbval_plugin` recording each cell's outcome by grade id;
4. score: a check cell that passes earns its points, anything else earns 0.

``only`` (``--only ID,ID`` on the command line) grades a chosen subset of the exercises: the notebook
runs up to the last selected check cell and stops there (later cells are not run), and the report
lists the selected exercises only. For re-grading one question, and for the course's known-wrong tests.

The submission file is only read. A hung cell is interrupted after the timeout and the run goes on; a
dead kernel ends the run early and the cells that could not run score 0 as "not run".
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from .build import hidden_free_source
from .notebook import (NotebookError, check_cells, course_meta, grade_id, notebook_name,
                       read_notebook, source_of, validate_source_notebook)

DEFAULT_TIMEOUT = 180.0  # seconds per cell
PASS, FAIL, ERROR, TIMEOUT, NOT_RUN = "pass", "fail", "error", "timeout", "not run"


@dataclass
class ExerciseResult:
    grade_id: str
    points: int
    max_points: int
    status: str                  # pass | fail | error | timeout | not run
    message: str = ""            # first line of the failure
    restored: str | None = None  # None | "edited" | "deleted" | "duplicated": the check cell was put back


@dataclass
class Report:
    submission: str
    notebook: str | None = None
    exercises: list[ExerciseResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None     # set when the submission could not be graded (bad input)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(e.points for e in self.exercises)

    @property
    def max_total(self) -> int:
        return sum(e.max_points for e in self.exercises)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, max_total=self.max_total)
        return d


# ----------------------------------------------------------------------------- the grader's own needs

# Module -> the distribution that provides it. Grading runs each submission under ``python -m pytest
# -p nbval.plugin`` with an IPython kernel of this interpreter, so all of them must be importable here.
GRADER_MODULES = {"pytest": "pytest", "nbval": "nbval", "ipykernel": "ipykernel",
                  "jupyter_client": "jupyter_client", "nbformat": "nbformat"}


class GraderSetupError(RuntimeError):
    """The grader cannot run in this Python installation (missing packages); nothing was graded."""


def missing_grader_modules() -> list[str]:
    """The modules of :data:`GRADER_MODULES` that this interpreter cannot import (in that order)."""
    missing = []
    for mod in GRADER_MODULES:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):  # a broken package, or a module blanked out in sys.modules
            found = False
        if not found:
            missing.append(mod)
    return missing


def check_grader_dependencies() -> None:
    """Raise :class:`GraderSetupError` naming what is missing and how to install it.

    Without this, an installation lacking the ``test`` extra (the plain wheel, Colab) would run pytest
    that does not exist and score every check cell 0 as "not run".
    """
    missing = missing_grader_modules()
    if missing:
        pkgs = ", ".join(GRADER_MODULES[m] for m in missing)
        raise GraderSetupError(
            f"grading needs {pkgs}, which {'is' if len(missing) == 1 else 'are'} not installed for "
            f"{sys.executable}; nothing was graded. Install the grader's extra: "
            f"{sys.executable} -m pip install \"course-lib[test]\"")


# ----------------------------------------------------------------------------- canonical solutions

def default_dir(name: str) -> Path:
    """``./name`` if it exists, else ``name`` next to the installed ``course_lib`` (the repository)."""
    here = Path.cwd() / name
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / name


def load_solutions(solutions_dir: str | Path) -> dict[str, nbformat.NotebookNode]:
    """``{course.notebook: notebook}`` for every ``*.ipynb`` in ``solutions_dir``, validated."""
    solutions_dir = Path(solutions_dir)
    if not solutions_dir.is_dir():
        raise NotebookError(f"{solutions_dir}: no such folder; pass --solutions DIR (the course's solutions/)")
    out: dict[str, nbformat.NotebookNode] = {}
    for path in sorted(solutions_dir.glob("*.ipynb")):
        nb = read_notebook(path)
        validate_source_notebook(nb, str(path))
        name = notebook_name(nb)
        if name in out:
            raise NotebookError(f"{path}: course.notebook {name!r} is used by two solution notebooks; "
                                "give each a unique name")
        out[name] = nb
    if not out:
        raise NotebookError(f"{solutions_dir}: no solution notebooks (*.ipynb); pass --solutions DIR")
    return out


# ----------------------------------------------------------------------------- restoring check cells

def _norm(src: str) -> str:
    return "\n".join(line.rstrip() for line in src.strip("\n").splitlines()).strip()


def _cell_ids(cell) -> set[str]:
    ids = {cell.get("id")}
    colab_id = (cell.get("metadata") or {}).get("id")  # Colab keeps its own id in the metadata
    ids.add(colab_id if isinstance(colab_id, str) else None)
    return {i for i in ids if i}


def _check_sources(solution: nbformat.NotebookNode) -> dict[str, str]:
    """``{normalised source: grade_id}`` of a solution's check cells, as shown and with hidden tests."""
    out = {}
    for _, c in check_cells(solution):
        src = source_of(c)
        out[_norm(hidden_free_source(src, grade_id(c)))] = grade_id(c)
        out[_norm(src)] = grade_id(c)
    return out


def _adopt_check_cells(sub: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
    """Give an unedited check cell that lost its metadata (an editor that drops cell metadata) its grade id."""
    known = _check_sources(solution)
    for cell in sub.cells:
        if cell.cell_type == "code" and grade_id(cell) is None and _norm(source_of(cell)) in known:
            gid = known[_norm(source_of(cell))]
            cell.setdefault("metadata", {})["course"] = copy.deepcopy(
                next(c for _, c in check_cells(solution) if grade_id(c) == gid).metadata["course"])


def identify_notebook(sub: nbformat.NotebookNode, solutions: dict[str, nbformat.NotebookNode]) -> str | None:
    """For a submission without ``course.notebook``: the solution whose check cells it contains, if any."""
    sources = {_norm(source_of(c)) for c in sub.cells if c.cell_type == "code"}
    hits = {name: len(sources & set(_check_sources(sol))) for name, sol in solutions.items()}
    best = max(hits, key=hits.get, default=None)
    return best if best is not None and hits[best] > 0 else None


def _restore_position(nb, solution, k: int, present: set[str], later: list[str]) -> int:
    """Where to insert solution cell ``k`` (a deleted check cell) into ``nb``; see prepare_submission."""
    def index_of(pred) -> int | None:
        return next((j for j, c in enumerate(nb.cells) if pred(c)), None)

    prev = next((c for c in reversed(solution.cells[:k]) if c.cell_type == "code"), None)
    if prev is not None:
        pid, pids = grade_id(prev), _cell_ids(prev)
        j = index_of(lambda c: grade_id(c) == pid if pid else bool(pids & _cell_ids(c)))
        if j is not None:
            return j + 1
    for gid in later:
        if gid in present:
            j = index_of(lambda c: grade_id(c) == gid)
            if j is not None:
                return j
    nxt = next((c for c in solution.cells[k + 1:] if c.cell_type == "code"), None)
    if nxt is not None:
        ids, src = _cell_ids(nxt), _norm(source_of(nxt))
        j = index_of(lambda c: c.cell_type == "code" and (bool(ids & _cell_ids(c)) or _norm(source_of(c)) == src))
        if j is not None:
            return j
    return len(nb.cells)


def prepare_submission(sub: nbformat.NotebookNode, solution: nbformat.NotebookNode,
                       where: str) -> tuple[nbformat.NotebookNode, dict[str, str]]:
    """The notebook to run and ``{grade_id: "edited"|"deleted"|"duplicated"}`` for restored check cells.

    Raises NotebookError when the submission has no graded cell or one with an unknown grade id.
    """
    canonical = {grade_id(c): c for _, c in check_cells(solution)}
    order = [grade_id(c) for _, c in check_cells(solution)]
    sub = copy.deepcopy(sub)
    _adopt_check_cells(sub, solution)
    found = check_cells(sub)
    if not found:
        raise NotebookError(f"{where}: no graded cells (no cell has course.grade_id metadata), so this is "
                            f"not the exercise notebook; submit exercises/{notebook_name(solution)}.ipynb "
                            "with your code filled in")
    for i, c in found:
        if grade_id(c) not in canonical:
            raise NotebookError(f"{where}: cell {i} has grade_id {grade_id(c)!r}, which "
                                f"{notebook_name(solution)} does not have (it has: {', '.join(order)}); "
                                "copy your code into a fresh copy of the exercise notebook and submit that")

    nb = sub
    restored: dict[str, str] = {}
    # Duplicates: keep the last copy (usually the one below the learner's code), drop the others.
    last = {grade_id(c): i for i, c in found}
    drop = {i for i, c in found if last[grade_id(c)] != i}
    for i, c in found:
        if i in drop:
            restored[grade_id(c)] = "duplicated"
    nb.cells = [c for i, c in enumerate(nb.cells) if i not in drop]

    for cell in nb.cells:
        gid = grade_id(cell)
        if gid is None:
            continue
        canon = canonical[gid]
        shown = {_norm(source_of(canon)), _norm(hidden_free_source(source_of(canon), gid))}
        edited = _norm(source_of(cell)) not in shown or course_meta(cell) != course_meta(canon)
        if edited and gid not in restored:
            restored[gid] = "edited"
        cell.source = source_of(canon)
        cell.metadata = copy.deepcopy(canon.metadata)

    # Deleted check cells go back where they run after the learner's code for them: after the code cell
    # that precedes them in the solution (found by cell id); else before the next check cell; else
    # before the code cell that follows them in the solution (by id or unchanged source, e.g. a
    # teardown cell); else at the end.
    present = {grade_id(c) for c in nb.cells if grade_id(c)}
    for gid in order:
        if gid in present:
            continue
        restored[gid] = "deleted"
        canon = canonical[gid]
        k = solution.cells.index(canon)
        pos = _restore_position(nb, solution, k, present, order[order.index(gid) + 1:])
        new = copy.deepcopy(canon)
        new.id = f"restored-{gid}"[:64]
        nb.cells.insert(pos, new)
        present.add(gid)

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb, restored


# ----------------------------------------------------------------------------- running nbval

def _pytest_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in ("COV_CORE_SOURCE", "COV_CORE_CONFIG")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only nbval and our plugin, whatever else is installed
    env["MPLBACKEND"] = "Agg"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _kernel_never_started(records: list[dict]) -> bool:
    """The kernel died before it answered at all (no cell ran): a start-up failure of the machine, such as
    two kernels started at once picking the same port, not anything the notebook did."""
    return bool(records) and all(r["outcome"] == "not_run" for r in records) and \
        "before replying to kernel_info" in records[0].get("evalue", "")


def run_nbval(nb: nbformat.NotebookNode, timeout: float, workdir: Path) -> tuple[list[dict], str, int | None]:
    """Execute ``nb`` under pytest+nbval in ``workdir``; ``(records, pytest output, returncode)``.

    returncode is None when the whole run was stopped (it overran its overall budget). A kernel that dies
    before answering its first request is started once more (no cell of the notebook had run).
    """
    records, out, code = _run_nbval_once(nb, timeout, workdir)
    if _kernel_never_started(records):
        records, out, code = _run_nbval_once(nb, timeout, workdir)
    return records, out, code


def _run_nbval_once(nb: nbformat.NotebookNode, timeout: float, workdir: Path) -> tuple[list[dict], str, int | None]:
    name = (notebook_name(nb) or "submission") + ".ipynb"
    nb_path, results, ini = workdir / name, workdir / "results.json", workdir / "pytest.ini"
    results.unlink(missing_ok=True)
    nb_path.write_text(nbformat.writes(nb), encoding="utf-8")
    ini.write_text("[pytest]\naddopts =\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "pytest", "-p", "nbval.plugin", "-p", "course_lib.grading.nbval_plugin",
           "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={timeout:g}",
           "--grading-results", str(results), "-c", str(ini), "--rootdir", str(workdir),
           "-p", "no:cacheprovider", "-q", "--color=no", "-o", "console_output_style=classic", name]
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    budget = 120.0 + n_code * (timeout + 15.0)  # kernel start + every cell timing out and being stopped
    proc = subprocess.Popen(cmd, cwd=workdir, env=_pytest_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    records = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else []
    return records, out.decode("utf-8", "replace"), code


# ----------------------------------------------------------------------------- scoring

def _message(rec: dict) -> str:
    """``Name: first line``; for an error raised on the ranks, also the rank's own exception line."""
    ename, evalue = rec.get("ename", ""), rec.get("evalue", "")
    msg = f"{ename}: {evalue}" if evalue else ename
    detail = rec.get("detail", "")
    if ename == "RankError" and "--- rank " in detail:
        first_rank = detail.split("--- rank ", 1)[1].split("--- rank ", 1)[0]
        lines = [line.strip() for line in first_rank.splitlines()[1:] if line.strip()]
        if lines:
            msg += f" ({lines[-1]})"
    return msg


def score(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode, restored: dict[str, str],
          records: list[dict], timeout: float, returncode: int | None, output: str) -> tuple[list[ExerciseResult], list[str]]:
    """Exercise results in solution order, and notes about non-graded cells and the run."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    by_cell = {r["cell"]: r for r in records}
    # Name each code cell after the next check cell, so notes can say where a failure sits.
    upcoming, next_check = {}, None
    for n in range(len(code_cells) - 1, -1, -1):
        next_check = grade_id(code_cells[n]) or next_check
        upcoming[n] = next_check
    notes: list[str] = []
    died_in: int | None = None
    for n in range(len(code_cells)):
        rec = by_cell.get(n)
        if rec and rec["outcome"] == "kernel_died" and died_in is None:
            died_in = n
        if rec is None or grade_id(code_cells[n]) or rec["outcome"] in ("passed", "skipped", "not_run"):
            continue
        before = f" (before check {upcoming[n]!r})" if upcoming[n] else ""
        if rec["outcome"] == "timeout":
            notes.append(f"code cell {n}{before} ran longer than {timeout:g} s and was interrupted")
        elif rec["outcome"] == "kernel_died":
            continue  # reported once below, with its consequence
        else:
            notes.append(f"code cell {n}{before} raised {_message(rec)}")
    # Why later cells did not run: the kernel died in a cell, or was gone before one.
    stop_reason = (f"the kernel died in code cell {died_in} (the code exited or was killed)"
                   if died_in is not None else None)
    dead_before = next((n for n in range(len(code_cells))
                        if by_cell.get(n, {}).get("ename") == "KernelDead"), None)
    if stop_reason is None and dead_before is not None:
        prev = by_cell.get(dead_before - 1, {})
        stop_reason = (f"the kernel was stopped after code cell {dead_before - 1} ran past the timeout and "
                       "could not be interrupted" if prev.get("outcome") == "timeout"
                       else f"the kernel was gone after code cell {dead_before - 1}")
    if stop_reason:
        notes.append(f"{stop_reason}; later cells did not run")
    if returncode is None:
        notes.append("grading was stopped: the notebook overran its overall time budget")
    elif not records:
        tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        notes.append(f"pytest/nbval produced no results (exit code {returncode}): {tail[0]}")
    setup_fail = next((r for r in records if r["outcome"] == "not_run" and r.get("ename") != "KernelDead"), None)
    if setup_fail:
        notes.append(f"a cell could not start: {_message(setup_fail)}")

    cell_of = {grade_id(c): n for n, c in enumerate(code_cells) if grade_id(c)}
    results = []
    for _, canon in check_cells(solution):
        gid, pts = grade_id(canon), int(course_meta(canon)["points"])
        rec = by_cell.get(cell_of.get(gid))
        if rec is None or rec["outcome"] in ("not_run", "skipped"):
            why = "did not run"
            if stop_reason:
                why = f"did not run: {stop_reason}"
            elif returncode is None:
                why = "did not run: grading was stopped"
            status, msg = NOT_RUN, why
        elif rec["outcome"] == "passed":
            status, msg = PASS, ""
        elif rec["outcome"] == "timeout":
            status, msg = TIMEOUT, f"ran longer than {timeout:g} s and was interrupted"
        elif rec["outcome"] == "kernel_died":
            status, msg = ERROR, "the kernel died while this check ran"
        elif rec.get("ename") == "AssertionError":
            status, msg = FAIL, _message(rec)
        else:
            status, msg = ERROR, _message(rec)
        results.append(ExerciseResult(gid, pts if status == PASS else 0, pts, status, msg, restored.get(gid)))
    return results, notes


# ----------------------------------------------------------------------------- public API

def _select(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode, only, where: str) -> set[str]:
    """Cut ``nb`` after the last check cell of ``only``; the selected grade ids."""
    known = [grade_id(c) for _, c in check_cells(solution)]
    chosen = set(only)
    unknown = sorted(chosen - set(known))
    if unknown or not chosen:
        raise NotebookError(f"{where}: --only names no exercise of this notebook ({', '.join(unknown) or 'empty'}); "
                            f"its grade ids are: {', '.join(known)}")
    last = max(k for k, c in enumerate(nb.cells) if grade_id(c) in chosen)
    del nb.cells[last + 1:]
    return chosen


def grade_one(path: str | Path, solutions: dict[str, nbformat.NotebookNode],
              timeout: float = DEFAULT_TIMEOUT, only=None) -> Report:
    """Grade one submission; bad input gives a Report with ``error`` set (never raises for it).

    ``only``: grade ids to grade (the run stops after the last of them); ``None``: every exercise.
    """
    t0 = time.monotonic()
    report = Report(submission=str(path))
    try:
        sub = read_notebook(path)
        name = notebook_name(sub)
        if name is None and identify_notebook(sub, solutions):
            name = identify_notebook(sub, solutions)
            report.notes.append(f"the notebook metadata has no course.notebook (an editor may have dropped "
                                f"it); identified as {name} by its check cells")
        if name is None:
            raise NotebookError(f"{path}: not a notebook of this course (its metadata has no course.notebook); "
                                "download the exercise from the course's exercises/ folder, fill it in and "
                                "submit that")
        if name not in solutions:
            raise NotebookError(f"{path}: notebook {name!r} is not an exercise of this course (known: "
                                f"{', '.join(sorted(solutions))}); submit one of those, or pass --solutions DIR")
        report.notebook = name
        nb, restored = prepare_submission(sub, solutions[name], str(path))
        chosen = _select(nb, solutions[name], only, str(path)) if only is not None else None
    except NotebookError as exc:
        report.error = str(exc)
        report.seconds = round(time.monotonic() - t0, 1)
        return report
    workdir = Path(tempfile.mkdtemp(prefix="course-grade-"))
    try:
        records, output, code = run_nbval(nb, timeout, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.exercises, notes = score(nb, solutions[name], restored, records, timeout, code, output)
    if chosen is not None:
        report.exercises = [e for e in report.exercises if e.grade_id in chosen]
        notes.append(f"graded only {', '.join(e.grade_id for e in report.exercises)} (--only); "
                     "the notebook ran up to the last of them")
    report.notes += notes
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def expand_paths(paths: list[str | Path]) -> list[Path]:
    """Files as given; a folder stands for the ``*.ipynb`` files directly in it, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.glob("*.ipynb") if q.is_file()))
        else:
            out.append(p)
    return out


def grade(paths: list[str | Path], solutions_dir: str | Path | None = None,
          timeout: float = DEFAULT_TIMEOUT, jobs: int = 1, only=None) -> list[Report]:
    """Grade every submission (files or folders of ``*.ipynb``); one Report each, in input order.

    ``only``: grade ids to grade in every submission (see :func:`grade_one`), or a list with one such
    collection (or ``None``) per file, in the order of the expanded paths.

    Raises GraderSetupError (before reading anything) when pytest/nbval/ipykernel are missing, and
    NotebookError for unusable ``solutions_dir``.
    """
    check_grader_dependencies()
    solutions = load_solutions(solutions_dir or default_dir("solutions"))
    files = expand_paths(paths)
    per_file = isinstance(only, list) and all(o is None or not isinstance(o, str) for o in only)
    if per_file and len(only) != len(files):
        raise ValueError(f"only: {len(only)} selections for {len(files)} submissions")
    selections = only if per_file else [only] * len(files)
    jobs_list = list(zip(files, selections))
    if jobs <= 1 or len(files) <= 1:
        return [grade_one(f, solutions, timeout, o) for f, o in jobs_list]
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each grading is its own pytest process
        return list(pool.map(lambda fo: grade_one(fo[0], solutions, timeout, fo[1]), jobs_list))


# ----------------------------------------------------------------------------- output

def _status_text(e: ExerciseResult) -> str:
    return e.status + (f", restored ({e.restored})" if e.restored else "")


def format_report(report: Report, message_width: int = 100) -> str:
    """A plain-text table: exercise, points, max, status, first line of the failure, and the total."""
    head = f"{report.submission}" + (f"  [{report.notebook}]" if report.notebook else "")
    if report.error:
        return f"{head}\n  ERROR: {report.error}\n"
    rows = [("exercise", "points", "max", "status", "first line of the failure")]
    clip = lambda m: m if len(m) <= message_width else m[:message_width - 3] + "..."  # noqa: E731
    rows += [(e.grade_id, str(e.points), str(e.max_points), _status_text(e), clip(e.message))
             for e in report.exercises]
    rows.append(("total", str(report.total), str(report.max_total), "", ""))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head]
    for n, r in enumerate(rows):
        if n == len(rows) - 1:
            lines.append("  " + "-" * (sum(w) + 6))
        lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}".rstrip())
    lines += [f"  note: {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def to_json(reports: list[Report], timeout: float) -> str:
    return json.dumps({"timeout_s": timeout, "submissions": [r.to_dict() for r in reports]}, indent=2) + "\n"


def to_csv(reports: list[Report]) -> str:
    """A gradebook: one row per submission, one column per ``notebook:grade_id``."""
    cols: list[str] = []
    for r in reports:
        for e in r.exercises:
            key = f"{r.notebook}:{e.grade_id}"
            if key not in cols:
                cols.append(key)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["submission", "notebook", "total", "max_total", *cols, "restored", "error"])
    for r in reports:
        pts = {f"{r.notebook}:{e.grade_id}": e.points for e in r.exercises}
        restored = "; ".join(f"{e.grade_id}={e.restored}" for e in r.exercises if e.restored)
        if r.error:
            w.writerow([r.submission, r.notebook or "", "", "", *[""] * len(cols), "", r.error])
        else:
            w.writerow([r.submission, r.notebook, r.total, r.max_total, *[pts.get(c, "") for c in cols],
                        restored, ""])
    return buf.getvalue()
