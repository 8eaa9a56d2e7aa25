"""The grader as a grading server meets it: its own dependencies, and a folder of mixed submissions.

``test_grader_refuses_to_run_without_its_dependencies`` covers an installation without the ``test``
extra (the wheel, Colab): grading must stop with exit status 2 and say what to install, instead of
scoring every check 0 as "not run". The absence of pytest/nbval is simulated the standard way, by
blanking the modules in ``sys.modules`` of a fresh interpreter, so find_spec/import cannot see them.
"""

from __future__ import annotations

import json
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


# The benchmark's kinds graded here: a course exercise solved, untouched and wrong. Its other three kinds
# (a tampered check cell, an endless loop, a dying kernel) are graded, with a process check after the run,
# in tests/test_grading.py's `graded` fixture on a notebook whose cells take milliseconds, so that its
# per-cell timeout, which an endless loop waits out, can be 5 s instead of the 15 s this notebook needs.
KINDS_HERE = ("solution", "exercise", "wrong")


def test_grading_a_folder_of_mixed_submissions(tmp_path):
    """3 submissions of a course exercise, --jobs 2: a report each with the expected score, exit 0,
    nothing left running. All six kinds, 50 submissions: ``python benchmarks/grading_server.py --n 50``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import grading_server as gs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    n = len(KINDS_HERE)
    kinds = gs.make_submissions(tmp_path / "subs", n)   # the first n kinds of the benchmark's rotation
    assert sorted(kinds.values()) == sorted(KINDS_HERE) and set(KINDS_HERE) <= set(gs.KINDS)
    res = gs.run_grader(tmp_path / "subs", jobs=2, timeout=15, out_json=tmp_path / "grades.json")
    assert res["returncode"] == 0, res["stderr"][-3000:]
    reports = json.loads((tmp_path / "grades.json").read_text())["submissions"]
    assert len(reports) == n
    for r in reports:
        kind = kinds[Path(r["submission"]).stem]
        e = r["exercises"][0]
        assert (e["status"], e["points"]) == gs.EXPECTED[kind], (kind, e)
    assert res["leftover"] == [], f"processes of the grading run left behind: {res['leftover']}"
    print(f"{n} submissions, --jobs 2: {res['wall_s']:.1f} s, peak RSS {res['peak_rss'] / 2**20:.0f} MiB")
