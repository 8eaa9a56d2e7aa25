"""The grader as a grading server meets it: its own dependencies, and a folder of mixed submissions.

``test_grader_refuses_to_run_without_its_dependencies`` covers an installation without the ``test``
extra (the wheel, Colab): grading must stop with exit status 2 and say what to install, instead of
scoring every check 0 as "not run". The absence of pytest/nbval is simulated the standard way, by
blanking the modules in ``sys.modules`` of a fresh interpreter, so find_spec/import cannot see them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_grader_refuses_to_run_without_its_dependencies(tmp_path):
    code = ("import sys\n"
            "for m in ('pytest', 'nbval'):\n"
            "    sys.modules[m] = None  # as if not installed\n"
            "from course_lib.grading.__main__ import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    out_json = tmp_path / "grades.json"
    r = subprocess.run([PY, "-c", code, "grade", str(REPO / "solutions"), "--solutions", str(REPO / "solutions"),
                        "--json", str(out_json)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err.startswith("error: grading needs pytest, nbval, which are not installed"), err
    assert 'pip install "course-lib[test]"' in err and len(err.splitlines()) == 1, err
    assert r.stdout == "" and not out_json.exists()  # nothing graded, nothing written
