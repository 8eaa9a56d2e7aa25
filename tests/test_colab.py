"""course_lib.colab: one definition of the repository, badge and set-up cell, and the notebooks agree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib import colab

try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_notebook_badge_and_setup_cell_agree_with_course_lib_colab():
    stale = colab.sync(REPO, check=True)
    assert not stale, ("notebooks disagree with course_lib.colab (run `python -m course_lib.colab sync`, "
                       "then `python -m course_lib.grading build`):\n" + "\n".join(stale))


def test_exercises_carry_the_same_setup_cell():
    for ex in sorted((REPO / "exercises").glob("[0-9]*.ipynb")):
        nb = nbformat.read(ex, as_version=4)
        cells = [c for c in nb.cells if "colab-setup" in c.metadata.get("tags", [])]
        assert [c.source for c in cells] == [colab.setup_cell_source()], f"{ex.name}: regenerate exercises"
        assert colab.badge_url(f"exercises/{ex.name}") in nb.cells[0].source, f"{ex.name}: badge"


def test_pyproject_names_the_same_repository():
    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Repository"] == colab.REPOSITORY


def test_badge_and_install_source_name_the_same_repository_and_branch():
    assert colab.install_source() == f"course-lib @ git+{colab.REPOSITORY}@{colab.BRANCH}"
    owner_name = colab.REPOSITORY.removeprefix("https://github.com/")
    assert colab.badge_url("notebooks/x.ipynb") == (
        f"https://colab.research.google.com/github/{owner_name}/blob/{colab.BRANCH}/notebooks/x.ipynb")
    assert colab.install_source() in colab.setup_cell_source()
    with pytest.raises(ValueError, match="github.com/OWNER/NAME"):
        colab.badge_url("x.ipynb", repository="https://gitlab.com/a/b")


def _mini_repo(tmp_path: Path) -> Path:
    for sub in ("notebooks", "solutions", "exercises"):
        (tmp_path / sub).mkdir()
    nb = new_notebook(cells=[new_markdown_cell("# 07 · A topic\n\nSummary."),
                             new_code_cell("x = 1", outputs=[nbformat.v4.new_output("stream", text="1\n")])])
    nbformat.write(nb, tmp_path / "notebooks" / "07_topic.ipynb")
    nbformat.write(nb, tmp_path / "solutions" / "07_topic.ipynb")
    return tmp_path


def test_sync_adds_badge_and_cell_keeps_the_rest_and_is_idempotent(tmp_path):
    repo = _mini_repo(tmp_path)
    before = nbformat.read(repo / "notebooks" / "07_topic.ipynb", as_version=4)
    assert len(colab.sync(repo, check=True)) == 3 and not (repo / colab.INDEX).exists()  # --check writes nothing
    changed = colab.sync(repo)
    assert len(changed) == 3, changed
    after = nbformat.read(repo / "notebooks" / "07_topic.ipynb", as_version=4)
    assert colab.badge_markdown("notebooks/07_topic.ipynb") in after.cells[0].source
    assert after.cells[0].source.startswith("# 07 · A topic\n")
    assert after.cells[1].source == colab.setup_cell_source()
    assert after.cells[1].metadata["tags"] == colab.SETUP_TAGS
    assert after.cells[2].id == before.cells[1].id and after.cells[2].outputs == before.cells[1].outputs
    sol = nbformat.read(repo / "solutions" / "07_topic.ipynb", as_version=4)
    assert colab.badge_url("exercises/07_topic.ipynb") in sol.cells[0].source  # learners open the exercise
    assert colab.sync(repo) == [] and colab.sync(repo, check=True) == []
    index = json.loads((repo / colab.INDEX).read_text())["cells"][0]["source"]
    assert "[07 · A topic](notebooks/07_topic.ipynb)" in "".join(index)


def test_sync_replaces_a_stale_badge_and_cell(tmp_path):
    repo = _mini_repo(tmp_path)
    colab.sync(repo)
    p = repo / "notebooks" / "07_topic.ipynb"
    nb = nbformat.read(p, as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace(colab.BRANCH, "old-branch")
    nb.cells[1].source = '!pip install "course-lib[lab] @ git+https://example.invalid/x"'
    nbformat.write(nb, p)
    # the index page counts each lecture's lines of code, so a changed set-up cell changes it too
    assert colab.sync(repo, check=True) == ["notebooks/07_topic.ipynb: badge, set-up cell", "START_HERE.ipynb: index"]
    colab.sync(repo)
    nb = nbformat.read(p, as_version=4)
    assert "old-branch" not in nb.cells[0].source and nb.cells[1].source == colab.setup_cell_source()


def test_path_counts_self_check_answers_as_core_and_deep_dives_as_folded():
    core = "Two words.\n\n**1.** A question?\n\n"
    answer = "<details><summary>Answer</summary>\n\nThe answer.\n\n</details>"
    deep = "<details><summary>Optional deep dive: more</summary>\n\nfive folded words here\n\n</details>"
    md = f"{core}{deep}\n\n{answer}"
    assert colab._words(md, folded=True) == colab._words(deep, folded=True) == 12   # the deep dive only
    assert colab._words(md) == colab._words(core) + colab._words(answer) == 5 + 7  # the answer is core path


def test_cli_check_exit_status(tmp_path, capsys):
    repo = _mini_repo(tmp_path)
    assert colab.main(["sync", "--check", "--repo", str(repo)]) == 1
    assert "out of date: notebooks/07_topic.ipynb" in capsys.readouterr().out
    assert colab.main(["sync", "--repo", str(repo)]) == 0
    assert colab.main(["sync", "--check", "--repo", str(repo)]) == 0
    assert colab.main(["sync", "--repo", str(tmp_path / "nowhere")]) == 2
    assert "no notebooks/ folder" in capsys.readouterr().err


def test_install_missing_installs_only_missing_or_older(monkeypatch, capsys):
    import importlib.metadata as md
    reqs = ["torch>=2.7", "jax>=0.8.2", "tqdm>=4.60", 'pytest>=7.4; extra == "test"']
    have = {"torch": "2.13.0+cpu", "jax": "0.5.0"}

    def version(name):
        if name not in have:
            raise md.PackageNotFoundError(name)
        return have[name]
    monkeypatch.setattr(colab.md, "requires", lambda dist: reqs)
    monkeypatch.setattr(colab.md, "version", version)
    assert colab.install_missing(dry_run=True) == ["jax>=0.8.2", "tqdm>=4.60"]
    assert "torch 2.13.0+cpu" in capsys.readouterr().out
    monkeypatch.setattr(colab.md, "requires", lambda dist: ["torch~=2.7"])
    with pytest.raises(ValueError, match="name>=version"):
        colab.install_missing(dry_run=True)


def _pyproject_runtime_requirements() -> list[tuple[str, str]]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for d in deps:
        m = colab._REQ_RE.fullmatch(d.strip())
        assert m, f"pyproject.toml: {d!r} is not of the form name>=version"
        out.append((m[1], m[3]))
    return out


def test_colabs_stock_image_satisfies_every_floor_so_the_setup_cell_installs_nothing_else(monkeypatch, capsys):
    # pyproject's runtime requirements, checked against the versions of Colab's image (COLAB_IMAGE):
    # the set-up cell's install_missing must find nothing to install. `make test-versions` repeats this
    # in a venv built from the same pins, on the installed wheel's own metadata.
    reqs = [f"{n}>={v}" for n, v in _pyproject_runtime_requirements()]
    monkeypatch.setattr(colab.md, "requires", lambda dist: reqs)
    assert colab.install_missing(dry_run=True, installed=colab.COLAB_IMAGE) == []
    assert "torch 2.11.0" in capsys.readouterr().out
    # and the check can fail: one floor above Colab's version is reported for install
    monkeypatch.setattr(colab.md, "requires", lambda dist: reqs + ["ipywidgets>=8.0"])
    assert colab.install_missing(dry_run=True, installed=colab.COLAB_IMAGE) == ["ipywidgets>=8.0"]


def test_every_runtime_requirement_is_pinned_in_the_colab_image():
    names = {n.lower() for n, _ in _pyproject_runtime_requirements()}
    missing = names - set(colab.COLAB_IMAGE)
    assert not missing, f"COLAB_IMAGE lacks {sorted(missing)}: add Colab's version (backend-info's pip-freeze.txt)"
    assert all(r.count("==") == 1 for r in colab.colab_pins())


def test_download_sizes_reports_pips_resolution(monkeypatch):
    report = {"install": [{"metadata": {"name": "tqdm", "version": "4.67.3"},
                           "download_info": {"url": "file:///nowhere/tqdm.whl"}}]}

    class Done:
        returncode, stdout = 0, json.dumps(report)
    calls = []
    monkeypatch.setattr(colab.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done())
    assert colab.download_sizes(["tqdm>=4.60"]) == {"tqdm": ("4.67.3", None)}   # no http: size unknown
    assert "--dry-run" in calls[0] and "--report" in calls[0]
