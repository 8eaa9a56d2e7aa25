"""Exercise notebooks from one source, and a tamper-resistant grader built on nbval.

* :func:`build` turns ``solutions/NN_topic.ipynb`` into ``exercises/NN_topic.ipynb``;
* :func:`grade` grades submitted exercise notebooks and returns one :class:`Report` each.

Command line: ``python -m course_lib.grading build [--check]`` and
``python -m course_lib.grading grade SUBMISSION.ipynb ... [--json FILE] [--csv FILE]``
(``python -m course_lib.grading --help`` for the options and exit codes).
"""

from .build import build, make_exercise
from .grade import ExerciseResult, Report, format_report, grade, grade_one, load_solutions, to_csv, to_json
from .notebook import NotebookError

__all__ = ["build", "make_exercise", "grade", "grade_one", "load_solutions", "Report", "ExerciseResult",
           "format_report", "to_json", "to_csv", "NotebookError"]
