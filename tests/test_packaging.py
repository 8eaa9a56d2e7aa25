"""The set-up files agree with each other and with what the README promises."""

from __future__ import annotations

import os
import re
from pathlib import Path
try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def _pyproject():
    return tomllib.loads(_read("pyproject.toml"))


def _environment_pip_requirements():
    """The requirement lines under `- pip:` in environment.yml (without `-e .`)."""
    reqs, in_pip = [], False
    for line in _read("environment.yml").splitlines():
        stripped = line.strip()
        if stripped.startswith("- pip:"):
            in_pip = True
            continue
        if in_pip and stripped.startswith("- "):
            req = stripped[2:].split("#")[0].strip()
            if not req.startswith("-e"):
                reqs.append(req)
    return reqs


def test_environment_yml_and_pyproject_name_the_same_runtime_dependencies():
    runtime = _pyproject()["project"]["dependencies"]
    env = _environment_pip_requirements()
    assert env, "environment.yml has no pip requirements"
    assert sorted(env) == sorted(runtime), (
        f"environment.yml and pyproject.toml disagree:\n only in environment.yml: "
        f"{sorted(set(env) - set(runtime))}\n only in pyproject.toml: {sorted(set(runtime) - set(env))}")


def test_runtime_requirements_are_loose_lower_bounds():
    for req in _pyproject()["project"]["dependencies"]:
        assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+>=[0-9.]+", req), (
            f"{req!r}: runtime requirements must be loose lower bounds (name>=version) so that learners "
            f"can bring their own torch/jax")


def test_readme_shows_the_two_commands_and_ci_calls_make_test():
    readme = _read("README.md")
    assert "make test" in readme and "make lab" in readme
    assert "make test" in _read(".ci/run")


def test_readme_curriculum_lists_exactly_the_notebooks_that_exist():
    readme = _read("README.md")
    listed = set(re.findall(r"notebooks/(\d\d_[a-z_]+)\.ipynb", readme))
    present = {f[:-6] for f in os.listdir(os.path.join(REPO, "notebooks")) if f.endswith(".ipynb")}
    assert listed == present, f"README lists {sorted(listed)}, notebooks/ has {sorted(present)}"


def test_every_course_lib_module_named_in_readme_exists():
    readme = _read("README.md")
    for mod in set(re.findall(r"`course_lib\.([a-z_]+)`", readme)):
        path = os.path.join(REPO, "course_lib", mod)
        assert os.path.exists(path + ".py") or os.path.isdir(path), f"README names course_lib.{mod}, which does not exist"


def test_readme_shows_the_path_computed_from_the_notebooks():
    """README's "The path" table is `python -m course_lib.colab path`: its words, lines and points follow the
    notebooks (regenerate it and paste it in when a notebook changes)."""
    from course_lib.colab import path_table
    want = path_table(Path(REPO))
    assert want in _read("README.md"), (
        "README's path table is out of date: replace it with the output of `python -m course_lib.colab path`")
