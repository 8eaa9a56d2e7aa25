"""The Slurm batch script (``course_lib/demos/slurm/torchrun.sbatch``) on a Slurm cluster started here.

When Slurm and munge are installed (Debian: ``apt install slurm-wlm munge``), the test starts a private
single-host cluster in a temporary folder: its own munge key and munged socket, a ``slurm.conf`` with two
nodes ``n1``, ``n2`` on 127.0.0.1 (one slurmd each, on their own ports; no cgroups needed:
``proctrack/linuxproc``, ``task/none``), a slurmctld, all as the current (root) user. It submits the
batch script with ``sbatch --nodes=2`` (2 torchrun agents x 2 gloo processes, rendezvous on the first
node), checks that all 4 ranks report OK, that a rank killed on the second node fails the whole job, and
that no process of either job is left; every daemon is stopped afterwards, also on failure.
Skipped when the daemons are not on PATH.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.launch import pids_with_env

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("n1", "n2")
JOB_TIMEOUT = 120


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _script() -> Path:
    return Path(str(importlib.resources.files("course_lib.demos.slurm") / "torchrun.sbatch"))


def test_batch_script_ships_with_the_package():
    text = _script().read_text()
    assert text.startswith("#!/bin/bash") and "torch.distributed.run" in text and "--rdzv_backend=c10d" in text


def _slurm_conf(d: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} CPUs=2 State=UNKNOWN"
                      for n, p in zip(NODES, node_ports))
    return f"""\
ClusterName=coursetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    missing = [x for x in DAEMONS if _which(x) is None]
    if missing:
        pytest.skip(f"slurm test skipped: {missing[0]} not found (apt install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("slurm test skipped: starting slurmd needs root")
    d = Path(tmp_path_factory.mktemp("slurm"))
    d.chmod(0o700)
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, ctld_port, node_ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF":
            del env[k]
    daemons: list[subprocess.Popen] = []

    def start(*cmd: str) -> None:
        daemons.append(subprocess.Popen(list(cmd), env=env, stdout=subprocess.DEVNULL,
                                        stderr=open(d / f"{Path(cmd[0]).name}-{len(daemons)}.err", "w"),
                                        start_new_session=True))

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(d.glob("*.log")) + sorted(d.glob("*.err")))

    try:
        start(_which("munged"), "-F", "-f", f"--key-file={key}", f"--socket={d}/munge.socket",
              f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge.log", f"--seed-file={d}/munge/seed")
        _wait_for(lambda: (d / "munge.socket").exists(), 10, "munged did not start", logs)
        start(_which("slurmctld"), "-D", "-i", "-f", str(conf))
        for n in NODES:
            start(_which("slurmd"), "-D", "-N", n, "-f", str(conf))
        sinfo = _which("sinfo")

        def nodes_idle() -> bool:
            r = subprocess.run([sinfo, "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return all(states.get(n) == "idle" for n in NODES)

        _wait_for(nodes_idle, 30, "the Slurm nodes did not become idle", logs)
        yield env, d, logs
    finally:
        # Jobs first (a job step's slurmstepd leaves slurmd's session and outlives it), then the daemons,
        # then anything still carrying this cluster's SLURM_CONF (a slurmstepd, a job's processes).
        if len(daemons) > 2:
            subprocess.run([_which("scancel"), "--partition=debug"], env=env, capture_output=True)
            squeue, deadline = _which("squeue"), time.monotonic() + 15
            while time.monotonic() < deadline and subprocess.run(
                    [squeue, "-h"], env=env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.3)
        for p in reversed(daemons):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in reversed(daemons):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in daemons:  # anything a daemon started in its session
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while (left := pids_with_env(f"SLURM_CONF={conf}")) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


def _wait_for(cond, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s\n{logs()}")
        time.sleep(0.3)


def _submit(cluster, name: str, *demo_args: str) -> tuple[str, str, str, float]:
    """Submit the batch script on both nodes; wait for the job; return its state, exit code and wall time.

    Not ``sbatch --wait``: Slurm 22.05's sbatch polls with doubling sleeps (2, 4, 8, 16, 32 s) and
    returned 28 s after the job had ended; ``scontrol show job`` is polled every 0.5 s instead.
    """
    env, d, logs = cluster
    out, tag = d / f"{name}.out", os.urandom(8).hex()
    env = {**env, "COURSE_PYTHON": sys.executable, "COURSE_MODULE": "course_lib.demos.hello",
           "COURSE_ARGS": " ".join(demo_args), "RDZV_PORT": str(_free_ports(1)[0]), "PYTHONUNBUFFERED": "1",
           "COURSE_TEST_TAG": tag}
    t0 = time.monotonic()
    r = subprocess.run([_which("sbatch"), "--parsable", "--nodes=2", f"--job-name={name}", f"--output={out}",
                        f"--chdir={d}", "--time=00:03:00", str(_script())],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"sbatch: {r.returncode}\n{r.stdout}{r.stderr}\n{logs()}"
    job = r.stdout.strip().split(";")[0]
    scontrol = _which("scontrol")
    state = code = ""
    while time.monotonic() - t0 < JOB_TIMEOUT:
        q = subprocess.run([scontrol, "show", "job", job, "-o"], env=env, capture_output=True, text=True).stdout
        state = (re.search(r"JobState=(\S+)", q) or [None, ""])[1]
        code = (re.search(r"ExitCode=(\S+)", q) or [None, ""])[1]
        if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.5)
    else:
        subprocess.run([_which("scancel"), job], env=env)
        pytest.fail(f"job {job} did not end within {JOB_TIMEOUT} s (state {state})\n{logs()}")
    wall = time.monotonic() - t0
    left = pids_with_env(f"COURSE_TEST_TAG={tag}", within=10)   # steps killed by slurmd: a moment to be reaped
    assert not left, f"processes of job {job} left behind: {left}"
    text = out.read_text(errors="replace") if out.exists() else "(no job output)"
    return state, code, text + "\n" + logs(), wall


def test_batch_script_on_two_slurm_nodes(slurm_cluster):
    state, code, text, wall = _submit(slurm_cluster, "hello", "--size", "3")
    assert (state, code) == ("COMPLETED", "0:0"), f"{state} {code}\n{text}"
    lines = [x for x in text.splitlines() if x.startswith("[rank ")]
    assert sorted(int(re.match(r"\[rank (\d+)/4 ", x).group(1)) for x in lines) == [0, 1, 2, 3], text
    for line in lines:
        assert "via gloo" in line and line.endswith(" OK"), line
        assert "after_all_reduce=[10.0, 10.0, 10.0]" in line, line
    assert "2 torchrun agent(s) on n[1-2], 2 processes each" in text, text
    print(f"2 Slurm nodes x 2 processes, submit to end: {wall:.1f} s")


def test_a_dead_rank_fails_the_whole_slurm_job(slurm_cluster):
    """Rank 3 (on n2) kills itself: the job must end FAILED, on both nodes, without hanging."""
    state, code, text, wall = _submit(slurm_cluster, "die", "--die-rank", "3")
    assert state == "FAILED" and code != "0:0", f"{state} {code}\n{text}"
    assert "--die-rank 3: killing myself" in text, text
    assert not any(x.startswith("[rank ") and x.endswith(" OK") for x in text.splitlines()), text
    print(f"failed job ended in {wall:.1f} s")
