"""Google Colab: where the course is installed from, its set-up cell and its "Open in Colab" badge.

One place defines the repository and branch (:data:`REPOSITORY`, :data:`BRANCH`); the badge of every
lecture notebook and solution and its Colab set-up cell are written from them by::

    python -m course_lib.colab sync [--check] [--repo DIR]

which also writes the index page ``START_HERE.ipynb`` that ``make lab`` opens. ``--check`` writes
nothing and exits 1 listing the notebooks that disagree (``tests/test_colab.py`` runs it).
Exercises are generated from solutions (``python -m course_lib.grading build``), so they follow.

The set-up cell (tags ``nbval-skip`` and ``colab-setup``) does nothing outside Colab. On Colab it
installs the course with ``pip install --no-deps`` and then only the runtime requirements that Colab
lacks or has older than the floor (:func:`install_missing`): Colab's own torch, jax, matplotlib and
ipywidgets stay, and no extra (JupyterLab, test tools) is pulled.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["REPOSITORY", "BRANCH", "DISTRIBUTION", "SETUP_TAGS", "COLAB_IMAGE", "install_source",
           "badge_url", "badge_markdown", "setup_cell_source", "version_tuple", "install_missing",
           "download_sizes", "colab_pins", "sync"]

REPOSITORY = "https://github.com/dist-dl-course/dist-dl-course"
BRANCH = "main"
DISTRIBUTION = "course-lib"
SETUP_TAGS = ["nbval-skip", "colab-setup"]
INDEX = "START_HERE.ipynb"

# Google Colab's stock runtime (github.com/googlecolab/backend-info, pip-freeze.txt and pip-freeze.gpu.txt
# at a724079, 2026-08-19, "Upgrade to Python 3.13"; the same versions on CPU, GPU and TPU runtimes, the GPU
# ones with torch 2.11.0+cu128 and jax's CUDA 12 plugin). The course's floors are these versions
# (pyproject.toml): the set-up cell installs nothing but the course there (tests/test_colab.py), and
# `make test-versions` runs the whole suite in a venv built from these pins (`colab_pins()`).
COLAB_PYTHON = "3.13"
COLAB_IMAGE = {
    "torch": "2.11.0", "jax": "0.7.2", "jaxlib": "0.7.2", "numpy": "2.1.3", "scipy": "1.16.3",
    "matplotlib": "3.10.0", "ipywidgets": "7.7.1", "ipykernel": "6.17.1", "ipython": "7.34.0",
    "cloudpickle": "3.1.2", "tqdm": "4.67.3", "nbformat": "5.11.1",
}


def colab_pins() -> list[str]:
    """Colab's image as pip requirements (``jax[cpu]==0.7.2``, ...), for a venv that mirrors it."""
    return [f"{'jax[cpu]' if n == 'jax' else n}=={v}" for n, v in COLAB_IMAGE.items()]


_BADGE_IMG = "https://colab.research.google.com/assets/colab-badge.svg"
_BADGE_RE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
_REQ_RE = re.compile(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)")


def install_source(repository: str = REPOSITORY, branch: str = BRANCH) -> str:
    """The pip requirement the set-up cell installs: ``course-lib @ git+<repository>@<branch>``."""
    return f"{DISTRIBUTION} @ git+{repository}@{branch}"


def badge_url(path: str, repository: str = REPOSITORY, branch: str = BRANCH) -> str:
    """Colab's URL that opens ``path`` (relative to the repository root) from GitHub."""
    m = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", repository)
    if not m:
        raise ValueError(f"REPOSITORY must be https://github.com/OWNER/NAME, got {repository!r}")
    return f"https://colab.research.google.com/github/{m[1]}/{m[2]}/blob/{branch}/{path}"


def badge_markdown(path: str) -> str:
    """The markdown of the "Open in Colab" badge for ``path`` (relative to the repository root)."""
    return f"[![Open In Colab]({_BADGE_IMG})]({badge_url(path)})"


def setup_cell_source() -> str:
    """The source of the Colab set-up cell, the same in every notebook."""
    return (
        "import sys\n"
        'if "google.colab" in sys.modules:  # on Colab: install the course library (nbval skips this cell)\n'
        f'    !pip install -q --no-deps "{install_source()}"\n'
        "    from course_lib.colab import install_missing\n"
        "    install_missing()  # only what Colab lacks: its torch, jax, ipywidgets stay")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu128"`` -> ``(2, 11, 0)``: the leading dotted numbers of a version string."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def _runtime_requirements(dist: str) -> list[tuple[str, str]]:
    """``(name, floor)`` of ``dist``'s runtime requirements (no extras)."""
    out = []
    for req in md.requires(dist) or []:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = _REQ_RE.fullmatch(spec.strip())
        if not m:
            raise ValueError(f"{dist} requires {req!r}; expected the form name>=version")
        out.append((m[1], m[3]))
    return out


def install_missing(dist: str = DISTRIBUTION, dry_run: bool = False,
                    installed: dict[str, str] | None = None) -> list[str]:
    """pip-install the runtime requirements of ``dist`` that are missing or older than their floor.

    Returns the requirements installed (or, with ``dry_run``, that would be). Already installed
    packages at or above their floor are left alone. ``installed`` (``{name: version}``) checks an
    environment described by its versions instead of this one (``install_missing(dry_run=True,
    installed=COLAB_IMAGE)``: what the set-up cell would install on Colab's stock image). Before it
    installs anything it prints what pip would download and how many megabytes (:func:`download_sizes`);
    if an upgraded package was already imported in this process, a note asks to restart the runtime.
    """
    todo, present = [], []
    for name, floor in _runtime_requirements(dist):
        have = _installed_version(name, installed)
        if have is None or version_tuple(have) < version_tuple(floor):
            todo.append(f"{name}>={floor}")
        else:
            present.append(f"{name} {have}")
    print(f"{dist}: already here: {', '.join(present) or 'nothing'}")
    if not todo:
        return []
    print(f"{dist}: missing or older than the course needs: {' '.join(todo)}")
    if not dry_run:
        sizes = download_sizes(todo)
        if sizes:
            total = sum(b for _, b in sizes.values() if b)
            print(f"{dist}: pip will download {len(sizes)} package(s), about {total / 1e6:,.0f} MB: "
                  + ", ".join(f"{n} {v} ({b / 1e6:,.1f} MB)" if b else f"{n} {v} (size unknown)"
                              for n, (v, b) in sizes.items()))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *todo], check=True)
        loaded = [r for r in todo if _REQ_RE.fullmatch(r)[1].replace("-", "_") in sys.modules]
        if loaded:
            print(f"{dist}: {', '.join(loaded)} upgraded after being imported: restart the runtime "
                  "(Runtime > Restart session) and run the notebook again")
    return todo


def _installed_version(name: str, installed: dict[str, str] | None) -> str | None:
    if installed is not None:
        norm = {k.lower().replace("_", "-"): v for k, v in installed.items()}
        return norm.get(name.lower().replace("_", "-"))
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def download_sizes(requirements: list[str], timeout: float = 10.0) -> dict[str, tuple[str, int | None]]:
    """``{name: (version, bytes)}`` of what ``pip install requirements`` would download, dependencies
    included: pip's own resolution (``pip install --dry-run --report``), each file's size from the
    index (an HTTP ``HEAD``; ``None`` where the index does not say). ``{}`` if pip cannot resolve."""
    import urllib.request

    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                          *requirements], capture_output=True, text=True)
    if out.returncode != 0:
        return {}
    try:
        report = json.loads(out.stdout)
    except ValueError:
        return {}
    sizes = {}
    for item in report.get("install", []):
        meta, url = item.get("metadata", {}), item.get("download_info", {}).get("url", "")
        size = None
        if url.startswith("http"):
            try:
                req = urllib.request.Request(url, method="HEAD")
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    size = int(resp.headers.get("Content-Length") or 0) or None
            except (OSError, ValueError):
                size = None
        sizes[meta.get("name", url)] = (meta.get("version", "?"), size)
    return sizes


# ------------------------------------------------------------------------------ the repository's notebooks

def _course_notebooks(repo: Path) -> list[Path]:
    return sorted([*(repo / "notebooks").glob("[0-9]*.ipynb"), *(repo / "solutions").glob("[0-9]*.ipynb")])


def _badge_path(nb_path: Path, repo: Path) -> str:
    """Solutions open their exercise in Colab (what a learner gets); lectures open themselves."""
    rel = nb_path.relative_to(repo).as_posix()
    return "exercises/" + nb_path.name if rel.startswith("solutions/") else rel


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _synced(nb: dict, badge: str) -> tuple[dict, list[str]]:
    """``nb`` with the badge and set-up cell as defined here; and what had to change."""
    changes = []
    cells = nb["cells"]
    md_idx = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), None)
    if md_idx is None:
        raise ValueError("no markdown cell for the title and badge")
    first = _source(cells[md_idx])
    if _BADGE_RE.search(first):
        new = _BADGE_RE.sub(lambda _: badge, first, count=1)
    else:  # after the title line
        lines = first.split("\n")
        new = "\n".join([lines[0], "", badge, *lines[1:]])
    if new != first:
        cells[md_idx]["source"] = new
        changes.append("badge")
    setup = [c for c in cells if c["cell_type"] == "code" and "colab-setup" in c.get("metadata", {}).get("tags", [])]
    want = setup_cell_source()
    if len(setup) > 1:
        raise ValueError("more than one cell tagged colab-setup")
    if not setup:
        cell = {"cell_type": "code", "execution_count": None, "id": "colab-setup",
                "metadata": {"tags": list(SETUP_TAGS)}, "outputs": [], "source": want}
        if nb.get("nbformat_minor", 0) < 5:
            del cell["id"]
        cells.insert(md_idx + 1, cell)
        changes.append("set-up cell added")
    else:
        cell = setup[0]
        tags = cell["metadata"].setdefault("tags", [])
        if _source(cell) != want or any(t not in tags for t in SETUP_TAGS):
            cell["source"] = want
            tags.extend(t for t in SETUP_TAGS if t not in tags)
            changes.append("set-up cell")
    return nb, changes


def _title(nb: dict) -> str:
    for c in nb["cells"]:
        if c["cell_type"] == "markdown":
            for line in _source(c).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "(untitled)"


WORDS_PER_MINUTE = 200  # the prose column of the path: reading speed for technical prose, roughly
# the order to take the lectures in: each of 01-09 uses the ones before it, 10-13, 15 and 16 need 00-09 and
# not each other, 14 uses everything
_WHEN = {"00": "first", **{f"{n:02d}": "in order" for n in range(1, 10)},
         **{f"{n:02d}": "any order after 09" for n in (10, 11, 12, 13, 15, 16)}, "14": "last"}


# an optional deep dive, folded in <details>; the answers of a lecture's self-check are folded too
# (<details><summary>Answer</summary>), but a reader reads them on the core path
_FOLDED = re.compile(r"<details>(?!<summary>Answer</summary>).*?</details>", re.S)


def _words(markdown: str, folded: bool = False) -> int:
    """Words a reader reads on the core path (``folded``: only those inside the optional ``<details>``
    blocks instead; a self-check's ``<details><summary>Answer</summary>`` blocks are core path, not
    optional); link targets (URLs, the Colab badge's) are not counted."""
    text = re.sub(r"\]\([^)]*\)", "]", markdown)
    text = "".join(_FOLDED.findall(text)) if folded else _FOLDED.sub("", text)
    return len(re.findall(r"\w+", text))


def path_rows(repo: Path) -> list[dict]:
    """Per lecture: title, words of prose (its markdown cells), lines of code, exercise parts and points."""
    out = []
    for lec in sorted(Path(repo, "notebooks").glob("[0-9]*.ipynb")):
        cells = json.loads(lec.read_text(encoding="utf-8"))["cells"]
        ex = Path(repo, "exercises", lec.name)
        checks = []
        if ex.is_file():
            for c in json.loads(ex.read_text(encoding="utf-8"))["cells"]:
                meta = c.get("metadata", {}).get("course")
                if isinstance(meta, dict) and "grade_id" in meta:
                    checks.append(int(meta.get("points", 0)))
        out.append(dict(n=lec.name[:2], file=lec.name, title=_title({"cells": cells}).replace("|", "/"),
                        words=sum(_words(_source(c)) for c in cells if c["cell_type"] == "markdown"),
                        folded=sum(_words(_source(c), folded=True) for c in cells if c["cell_type"] == "markdown"),
                        code=sum(len(_source(c).splitlines()) for c in cells if c["cell_type"] == "code"),
                        exercise=ex.is_file(), parts=len(checks), points=sum(checks)))
    return out


def path_table(repo: Path) -> str:
    """The path through the lectures as a markdown table (README's "The path" and the index page)."""
    rows = path_rows(repo)
    lines = ["| # | lecture | when | prose to read (optional deep dives folded) | code | exercise |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ex = (f"[{r['parts']} part{'s' if r['parts'] != 1 else ''}, {r['points']} points](exercises/{r['file']})"
              if r["exercise"] else "—")
        lines.append(f"| {r['n']} | [{r['title']}](notebooks/{r['file']}) | {_WHEN.get(r['n'], '')} | "
                     f"{r['words']:,} words, {max(1, round(r['words'] / WORDS_PER_MINUTE))} min"
                     + (f" (+{r['folded']:,} folded)" if r["folded"] else "") + " | "
                     f"{r['code']} lines | {ex} |")
    words = sum(r["words"] for r in rows)
    folded = sum(r["folded"] for r in rows)
    lines.append(f"| | all {len(rows)} | | {words:,} words, {words / WORDS_PER_MINUTE / 60:.1f} h (+{folded:,} folded) | "
                 f"{sum(r['code'] for r in rows):,} lines | {sum(r['parts'] for r in rows)} parts |")
    return "\n".join(lines)


def index_notebook(repo: Path) -> dict:
    """The index page: the path through the lectures and their exercises, as a markdown-only notebook."""
    text = "\n".join([
        "# Distributed Deep Learning, hands-on: start here",
        "",
        "Open a lecture (click its name), run it top to bottom (**Run > Run All Cells**, about a minute on",
        "2 CPU cores) and read it as it runs. Then open its exercise: write your code where it says",
        "`# YOUR CODE HERE` and run the check cell below it.",
        "",
        "Take 00 to 09 in order: each uses the ones before it. 10 to 13, 15 and 16 need 00-09 but not each other;",
        f"14 uses everything. The prose column is the notebook's text at {WORDS_PER_MINUTE} words a minute; the code,",
        "the figures and the exercises take longer.",
        "",
        path_table(repo),
        "",
        "**Stuck?** Each check says what it ran, what it expected and what came back. Grade yourself as often",
        "as you like: `python -m course_lib.grading grade exercises/NN_topic.ipynb` in a terminal runs the",
        "exercise in a fresh kernel, as a grader would. The reference solutions are in `solutions/`: look once",
        "your own attempt has run against the checks. Symbols and terms: [GLOSSARY.md](GLOSSARY.md).",
        "",
        "This page is written by `python -m course_lib.colab sync`; do not edit it by hand.",
    ])
    return {"cells": [{"cell_type": "markdown", "id": "index", "metadata": {}, "source": text}],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def _dump(nb: dict) -> str:
    """Text as Jupyter writes it (nbformat: sorted keys, one-space indent, sources as line lists)."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def sync(repo: str | Path = ".", check: bool = False) -> list[str]:
    """Write the badge and set-up cell into every lecture and solution, and the index page.

    Returns one line per file that changed (with ``check``: that would change; nothing is written).
    Only the badge, the set-up cell and the index are touched; cell ids and outputs stay.
    """
    repo = Path(repo)
    if not (repo / "notebooks").is_dir():
        raise FileNotFoundError(f"{repo}: no notebooks/ folder; pass --repo with the course repository")
    changed = []
    for path in _course_notebooks(repo):
        nb, what = _synced(json.loads(path.read_text(encoding="utf-8")), badge_markdown(_badge_path(path, repo)))
        if what:
            changed.append(f"{path.relative_to(repo)}: {', '.join(what)}")
            if not check:
                path.write_text(_dump(nb), encoding="utf-8")
    index = repo / INDEX
    want = _dump(index_notebook(repo))
    if not index.is_file() or index.read_text(encoding="utf-8") != want:
        changed.append(f"{INDEX}: index")
        if not check:
            index.write_text(want, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.colab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sync", help="write the Colab badge + set-up cell into notebooks/ and solutions/, "
                                    "and the index page")
    s.add_argument("--repo", default=".", help="the course repository (default: the current folder)")
    s.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is out of date")
    sub.add_parser("pins", help="print Colab's stock image as pip requirements, one per line "
                                "(`make test-versions` builds its oldest set from them)")
    t = sub.add_parser("path", help="print the path through the lectures (the README's table)")
    t.add_argument("--repo", default=".", help="the course repository (default: the current folder)")
    args = p.parse_args(argv)
    if args.cmd == "path":
        print(path_table(Path(args.repo)))
        return 0
    if args.cmd == "pins":
        print(f"python{COLAB_PYTHON}")
        print("\n".join(colab_pins()))
        return 0
    try:
        changed = sync(args.repo, check=args.check)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in changed:
        print(("out of date: " if args.check else "wrote ") + line)
    if args.check and changed:
        print("run `python -m course_lib.colab sync`, then `python -m course_lib.grading build`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
