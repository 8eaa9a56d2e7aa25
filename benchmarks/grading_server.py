"""The grader on a folder of generated submissions, as a grading server meets it.

    python benchmarks/grading_server.py --n 50 --jobs 2 --timeout 20

Generates ``n`` submissions of ``05_gradient_accumulation`` (the cheapest exercise: no cluster), in a
fixed rotation of kinds: the solution, the untouched exercise, a known-wrong shortcut (no 1/k loss
scaling), a tampered check cell (replaced by ``assert True``, wrong code above it), an endless loop, a
kernel that dies (``os._exit``). Runs ``python -m course_lib.grading grade FOLDER --jobs J`` once, and
prints the wall time, the peak resident memory of the whole process tree (sampled every 0.2 s), and
whether any process of the run is left afterwards (each carries an environment tag looked for in /proc).
Not part of ``make test`` (50 submissions take minutes); tests/test_grading_server.py runs a small one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import nbformat
import psutil

REPO = Path(__file__).resolve().parents[1]
NAME = "05_gradient_accumulation"
STEP_CELL = "e4045c5c"  # the solution cell (accumulation_step)
CHECK_CELL = "2a4a6cac"

WRONG = '''def accumulation_step(model, optimizer, loss_fn, X, y, k):
    optimizer.zero_grad()
    for xb, yb in zip(X.chunk(k), y.chunk(k)):
        loss_fn(model(xb), yb).backward()   # forgot to divide by k
    optimizer.step()
'''
LOOP = "def accumulation_step(model, optimizer, loss_fn, X, y, k):\n    while True:\n        pass\n"
DIES = "import os\nos._exit(3)\n"
KINDS = ("solution", "exercise", "wrong", "tampered", "loop", "dies")
EXPECTED = {"solution": ("pass", 3), "exercise": ("error", 0), "wrong": ("fail", 0),
            "tampered": ("fail", 0), "loop": ("timeout", 0), "dies": ("not run", 0)}


def _with(nb, cell_id: str, source: str):
    nb = copy.deepcopy(nb)
    next(c for c in nb.cells if c.get("id") == cell_id).source = source
    return nb


def make_submissions(folder: Path, n: int) -> dict[str, str]:
    """Write ``n`` submissions into ``folder``; return ``{file stem: kind}``."""
    sol = nbformat.read(str(REPO / "solutions" / f"{NAME}.ipynb"), as_version=4)
    ex = nbformat.read(str(REPO / "exercises" / f"{NAME}.ipynb"), as_version=4)
    step_src = next(c for c in sol.cells if c.get("id") == STEP_CELL).source
    solved = _with(ex, STEP_CELL, step_src)
    made = {"solution": solved, "exercise": ex, "wrong": _with(ex, STEP_CELL, WRONG),
            "tampered": _with(_with(ex, STEP_CELL, WRONG), CHECK_CELL, "assert True  # fine"),
            "loop": _with(ex, STEP_CELL, LOOP), "dies": _with(solved, STEP_CELL, DIES)}
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {}
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        stem = f"s{i:03d}_{kind}"
        nbformat.write(made[kind], str(folder / f"{stem}.ipynb"))
        kinds[stem] = kind
    return kinds


def _tagged(tag: str) -> list[int]:
    from course_lib.launch import pids_with_env
    return pids_with_env(f"COURSE_GRADING_TAG={tag}", within=10)


def run_grader(folder: Path, jobs: int, timeout: float, out_json: Path) -> dict:
    """One grading run; wall time, peak RSS of the process tree (bytes), exit code, leftover pids."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "COURSE_GRADING_TAG": tag}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.grading", "grade", str(folder), "--quiet",
                             "--jobs", str(jobs), "--timeout", f"{timeout:g}", "--json", str(out_json),
                             "--solutions", str(REPO / "solutions")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = 0
                for p in tree:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], rss)
            except psutil.Error:
                pass
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    wall = time.monotonic() - t0
    t.join()
    return {"wall_s": wall, "peak_rss": peak[0], "returncode": proc.returncode, "stdout": out,
            "stderr": err, "leftover": _tagged(tag)}         # after up to 10 s for killed kernels to be reaped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=20.0, help="per cell, as grade --timeout")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/course-grading-server"))
    a = ap.parse_args()
    kinds = make_submissions(a.dir / "submissions", a.n)
    res = run_grader(a.dir / "submissions", a.jobs, a.timeout, a.dir / "grades.json")
    reports = json.loads((a.dir / "grades.json").read_text())["submissions"]
    wrong = []
    for r in reports:
        kind = kinds[Path(r["submission"]).stem]
        e = r["exercises"][0]
        if (e["status"], e["points"]) != EXPECTED[kind]:
            wrong.append((r["submission"], kind, e["status"], e["points"]))
    print(f"{len(reports)} reports for {a.n} submissions, --jobs {a.jobs}, --timeout {a.timeout:g} s: "
          f"wall {res['wall_s']:.1f} s ({res['wall_s'] / a.n:.1f} s per submission), "
          f"peak RSS of the process tree {res['peak_rss'] / 2**20:.0f} MiB, exit status {res['returncode']}, "
          f"processes left: {len(res['leftover'])}, unexpected scores: {wrong or 'none'}")


if __name__ == "__main__":
    main()
