"""The frontier recipe (course_lib.frontier, course_lib.demos.frontier): every technique composed.

In fp32 the composed run equals one process to float32 rounding on two 4-rank layouts; in bf16 it stays
within bf16's own distance; a SIGKILL in the middle resumes bit for bit from the sharded checkpoints;
bad recipes and a checkpoint of another layout are refused; the torchrun entry point runs with --check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from course_lib import frontier as FR
from course_lib.fault import FaultPlan, run_with_restarts
from course_lib.launch import Cluster, RankError


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, timeout=300) as c:
        yield c


def _recipe(**kw):
    base = dict(dp=2, pp=2, tp=1, layers=2, steps=4, batch=8, micro=2, checkpoint_every=2)
    return FR.Recipe(**{**base, **kw})


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 2, 2)])
def test_fp32_composition_equals_one_process(cluster, tmp_path, layout):
    """Losses and global gradient norms equal one process's; the clip (0.05) is active at every step, so
    a norm that counted a tensor-parallel copy or the pipeline's tied embedding twice would show."""
    dp, pp, tp = layout
    r = _recipe(dp=dp, pp=pp, tp=tp, bf16=False, micro=4 // dp, clip=0.05)
    out = cluster.run(FR.train, 0, str(tmp_path), asdict(r))
    ref, ref_norms = FR.train_reference(r, with_norms=True)
    assert min(ref_norms) > r.clip
    for o in out:
        assert len(o["losses"]) == r.steps
        assert max(abs(a - b) for a, b in zip(o["losses"], ref)) < 1e-5, (o["losses"], ref)
        assert o["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)


def test_bf16_is_close_and_a_kill_resumes_bitwise(cluster, tmp_path):
    r = _recipe(steps=6)
    whole = cluster.run(FR.train, 0, str(tmp_path / "whole"), asdict(r))[0]
    rec = run_with_restarts(cluster, FR.train, str(tmp_path / "killed"), asdict(r),
                            plan=FaultPlan([(1, 3)]), max_restarts=1, measure_step=4)
    out = rec.results[0]
    assert rec.failures[0].ranks == [1] and out["resumed_from"] == 2
    assert out["losses"] == whole["losses"]
    assert max(abs(a - b) for a, b in zip(out["losses"], FR.train_reference(r))) < 0.05
    # the measured step: bytes on every axis it uses, a trace, a peak; ZeRO-1 shards Adam over dp
    assert out["bytes"]["dp"] > 0 and out["bytes"]["pp"] > 0 and out["events"] and out["peak_bytes"] > 0
    sb = out["state_bytes"]
    assert sb["optimizer_states"] == pytest.approx(sb["parameters"] / 2 * 12 / r.dp, rel=0.01)


def test_checkpoint_of_another_layout_is_refused(cluster, tmp_path):
    r = _recipe(steps=2)
    cluster.run(FR.train, 0, str(tmp_path), asdict(r))
    other = _recipe(steps=4, layers=4)
    with pytest.raises(RankError, match="another layout or model: layers 2 vs 4"):
        cluster.run(FR.train, 0, str(tmp_path), asdict(other))


@pytest.mark.parametrize("kw, match", [(dict(batch=6), "multiple of 4"), (dict(top_k=5), "top_k=5 > experts=4"),
                                       (dict(tp=0), "Recipe.tp must be a positive int"),
                                       (dict(clip=0), "Recipe.clip must be a positive number")])
def test_bad_recipes(kw, match):
    with pytest.raises(ValueError, match=match):
        _recipe(**kw)


def test_wrong_world_size(cluster, tmp_path):
    with pytest.raises(RankError, match="needs dp\\*pp\\*tp = 8 ranks, the job has 4"):
        cluster.run(FR.train, 0, str(tmp_path), asdict(FR.Recipe()))


def test_step_flops_scale_with_the_batch():
    a, b = FR.step_flops(_recipe()), FR.step_flops(_recipe(batch=16))
    assert a > 0 and b == 2 * a


def test_demo_under_torchrun_with_check(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "-m", "course_lib.demos.frontier", "--tp", "2", "--pp", "2", "--steps", "3", "--layers", "2",
           "--fp32", "--check", "--dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert p.stdout.count("MFU") == 3 and "check: max |loss - one-process loss|" in p.stdout and "OK" in p.stdout
    bad = subprocess.run(cmd[:4] + ["--nproc_per_node=2"] + cmd[5:], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "must divide the world size 2" in bad.stdout + bad.stderr


def test_toolbox_table_numbers_come_from_the_cited_notebooks():
    """Notebook 14's toolbox table quotes what notebooks 02-16 measured: every number in its "saves" and
    "costs" columns must stand, as a whole number, in the text (sources and printed outputs) of the committed
    notebook its last column cites (digits compared without thousands separators), so a re-run notebook or an edited table cannot drift apart silently."""
    import json
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    nb = json.loads((repo / "notebooks" / "14_putting_it_together.ipynb").read_text())
    table = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"
                 and "## 2. The toolbox, measured" in "".join(c["source"]))
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| technique")]
    assert len(rows) >= 10, f"the toolbox table has {len(rows)} rows"
    number = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")
    plain = lambda s: re.sub(r"(?<=\d),(?=\d{3})", "", s)  # noqa: E731  1,572,864 -> 1572864
    def notebook_text(path):
        # what a learner reads: cell sources and text outputs (not images' base64, where any digits occur)
        text = []
        for c in json.loads(path.read_text())["cells"]:
            text.append("".join(c["source"]))
            for o in c.get("outputs", []):
                text.append("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")))
        return "\n".join(text)

    problems = []
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        cited = re.match(r"(\d\d_[a-z_]+)", cells[-1])
        if cited is None:
            problems.append(f"{cells[0]!r} cites no notebook")
            continue
        seen.add(cited.group(1)[:2])
        source = plain(notebook_text(repo / "notebooks" / f"{cited.group(1)}.ipynb"))
        missing = sorted({n for n in number.findall(" ".join(cells[1:-1]))
                          if not re.search(rf"(?<![\d.]){re.escape(plain(n))}(?![\d])", source)})
        if missing:
            problems.append(f"{cells[0]!r}: {missing} not in {cited.group(1)}")
    lectures = {f"{n:02d}" for n in range(2, 17)} - {"14"}   # 14 is the notebook holding the table
    assert not lectures - seen, f"the toolbox cites no row of notebooks {sorted(lectures - seen)}"
    assert not problems, "\n".join(problems)
