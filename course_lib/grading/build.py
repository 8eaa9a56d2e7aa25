"""Generate ``exercises/NN_topic.ipynb`` from the hand-written ``solutions/NN_topic.ipynb``.

Each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region becomes, at the marker's indentation::

    # YOUR CODE HERE
    raise NotImplementedError("exercise 'ring_token': write your code here")

each ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` region becomes one comment line saying
that more checks run at grading time, outputs and execution counts are cleared, and cell ids and all
metadata are kept (the grader finds check cells by ``grade_id`` and places restored cells by cell id).
The output is a pure function of the solution file, so ``--check`` can compare bytes.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .notebook import (BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION, NotebookError,
                       course_meta, find_regions, grade_id, notebook_name, read_notebook, source_of,
                       validate_source_notebook)

STUB_COMMENT = "# YOUR CODE HERE"
HIDDEN_NOTE = "# (more checks run when the notebook is graded)"


def stub_message(exercise: str) -> str:
    return f"exercise {exercise!r}: write your code here"


def _replace_regions(source: str, regions: list[tuple[int, int, str]], make_lines) -> str:
    lines = source.splitlines()
    for begin, end, indent in reversed(regions):  # back to front keeps earlier line numbers valid
        lines[begin:end + 1] = [indent + text for text in make_lines()]
    out = "\n".join(lines)
    return out + "\n" if source.endswith("\n") else out


def _python_syntax_error(source: str) -> str | None:
    """None if ``source`` (IPython syntax allowed) parses as Python, else a one-line description."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        source = TransformerManager().transform_cell(source)
    except Exception:  # IPython missing or odd input: check the raw text
        pass
    try:
        ast.parse(source)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    return None


def make_exercise(solution: nbformat.NotebookNode, where: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook for a (validated) solution notebook; ``solution`` is not modified."""
    validate_source_notebook(solution, where)
    nb = copy.deepcopy(solution)
    nb.metadata.pop("widgets", None)  # saved widget state is output, not source
    for i, cell in enumerate(nb.cells):
        if "id" not in cell:
            raise NotebookError(f"{where} cell {i}: no cell id; save the notebook with nbformat >= 5.1.4 "
                                "(notebook format 4.5) so cells have stable ids")
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        src = source_of(cell)
        new = src
        sol = find_regions(new, BEGIN_SOLUTION, END_SOLUTION, f"{where} cell {i}")
        if sol:
            exercise = course_meta(cell).get("exercise") or _next_grade_id(nb, i) or notebook_name(nb)
            line = f"raise NotImplementedError({stub_message(exercise)!r})"
            new = _replace_regions(new, sol, lambda: [STUB_COMMENT, line])
        hidden = find_regions(new, BEGIN_HIDDEN, END_HIDDEN, f"{where} cell {i}")
        if hidden:
            new = _replace_regions(new, hidden, lambda: [HIDDEN_NOTE])
        if new != src:
            err = _python_syntax_error(new)
            if err:
                raise NotebookError(f"{where} cell {i}: the generated exercise cell is not valid Python "
                                    f"({err}); a region must not be the only statement of a block that "
                                    "stays in the exercise")
            cell.source = new
    return nb


def _next_grade_id(nb: nbformat.NotebookNode, index: int) -> str | None:
    for cell in nb.cells[index + 1:]:
        gid = grade_id(cell)
        if gid:
            return gid
    return None


def hidden_free_source(source: str, where: str = "cell") -> str:
    """A check cell's source as the learner sees it (hidden regions replaced by the note)."""
    hidden = find_regions(source, BEGIN_HIDDEN, END_HIDDEN, where)
    return _replace_regions(source, hidden, lambda: [HIDDEN_NOTE]) if hidden else source


def notebook_text(nb: nbformat.NotebookNode) -> str:
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


@dataclass
class BuildResult:
    written: list[Path] = field(default_factory=list)    # files (re)written, or stale under --check
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)    # exercises with no solution (stale under --check)


def build(solutions_dir: str | Path, exercises_dir: str | Path, check: bool = False) -> BuildResult:
    """Generate every ``exercises_dir/NN_topic.ipynb`` from ``solutions_dir``.

    With ``check=True`` nothing is written: ``written`` lists exercises that are missing or differ from
    what the build would produce and ``removed`` lists exercises without a solution.
    Raises NotebookError for a malformed solutions notebook.
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    if not solutions_dir.is_dir():
        raise NotebookError(f"{solutions_dir}: no such folder; pass --solutions DIR")
    result = BuildResult()
    wanted: set[str] = set()
    for src in sorted(solutions_dir.glob("*.ipynb")):
        nb = read_notebook(src)
        text = notebook_text(make_exercise(nb, str(src)))
        name = notebook_name(nb)
        if name != src.stem:
            raise NotebookError(f"{src}: course.notebook is {name!r} but the file is named {src.stem!r}; "
                                "make them agree")
        target = exercises_dir / src.name
        wanted.add(src.name)
        current = target.read_text(encoding="utf-8") if target.is_file() else None
        if current == text:
            result.unchanged.append(target)
            continue
        result.written.append(target)
        if not check:
            exercises_dir.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    if exercises_dir.is_dir():
        for extra in sorted(exercises_dir.glob("*.ipynb")):
            if extra.name not in wanted:
                result.removed.append(extra)
                if not check:
                    extra.unlink()
    return result
