"""Build exercise notebooks from solutions/, and grade submitted exercise notebooks.

Exit codes
  build:          0 exercises/ written (or, with --check, up to date); 1 --check found stale, missing or
                  orphaned exercises (listed); 2 a solutions notebook is malformed, or bad arguments.
  grade:          0 every submission was graded (whatever the scores); 1 at least one submission was
                  rejected (each gets a one-line error; the others are still graded and written);
                  2 bad arguments, unusable --solutions, or the grader's own packages (pytest, nbval,
                  ipykernel: the "test" extra) are missing; nothing is graded then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .build import build
from .grade import DEFAULT_TIMEOUT, GraderSetupError, default_dir, format_report, grade, to_csv, to_json
from .notebook import NotebookError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m course_lib.grading", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="generate exercises/ from solutions/")
    b.add_argument("--solutions", type=Path, default=None, help="default: ./solutions (or the repository's)")
    b.add_argument("--exercises", type=Path, default=None, help="default: ./exercises (or the repository's)")
    b.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 listing the exercises that are out of date")
    g = sub.add_parser("grade", help="grade submitted exercise notebooks")
    g.add_argument("submissions", nargs="+", type=Path, help="notebooks, or folders of *.ipynb")
    g.add_argument("--solutions", type=Path, default=None, help="default: ./solutions (or the repository's)")
    g.add_argument("--json", type=Path, default=None, help="write all reports as JSON to FILE")
    g.add_argument("--csv", type=Path, default=None, help="write a gradebook (one row per submission)")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds per cell before it is interrupted (default {DEFAULT_TIMEOUT:g})")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded at the same time (default 1)")
    g.add_argument("--quiet", action="store_true", help="print only the one-line summary per submission")
    g.add_argument("--only", default=None, metavar="ID[,ID...]",
                   help="grade only these exercises (grade ids); the notebook runs up to the last of them")
    return p


def _build(args) -> int:
    sol = args.solutions or default_dir("solutions")
    ex = args.exercises or (sol.parent / "exercises" if args.solutions else default_dir("exercises"))
    try:
        res = build(sol, ex, check=args.check)
    except NotebookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if res.written or res.removed:
            for p in res.written:
                print(f"stale: {p} (differs from, or is missing for, {sol / p.name})", file=sys.stderr)
            for p in res.removed:
                print(f"stale: {p} has no solution in {sol}; it would be deleted", file=sys.stderr)
            print("exercises/ is out of date: run `python -m course_lib.grading build`", file=sys.stderr)
            return 1
        print(f"exercises up to date ({len(res.unchanged)} notebooks)")
        return 0
    for p in res.written:
        print(f"wrote {p}")
    for p in res.removed:
        print(f"removed {p} (no solution)")
    print(f"{len(res.written)} written, {len(res.unchanged)} unchanged, {len(res.removed)} removed")
    return 0


def _grade(args) -> int:
    if args.timeout <= 0 or args.jobs < 1:
        print("error: --timeout must be > 0 and --jobs >= 1", file=sys.stderr)
        return 2
    try:
        only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None
        reports = grade(args.submissions, args.solutions, timeout=args.timeout, jobs=args.jobs, only=only)
    except (NotebookError, GraderSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not reports:
        print("error: no submissions found (a folder is searched for *.ipynb); pass notebooks or folders",
              file=sys.stderr)
        return 2
    for r in reports:
        if r.error:
            print(f"error: {r.error}", file=sys.stderr)
        elif args.quiet:
            print(f"{r.submission}: {r.total}/{r.max_total}")
        else:
            print(format_report(r))
    if args.json:
        args.json.write_text(to_json(reports, args.timeout), encoding="utf-8")
    if args.csv:
        args.csv.write_text(to_csv(reports), encoding="utf-8")
    return 1 if any(r.error for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _build(args) if args.command == "build" else _grade(args)


if __name__ == "__main__":
    sys.exit(main())
