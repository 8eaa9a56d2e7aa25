"""A pre-forked template for virtual-cluster ranks (``python -m course_lib._zygote FD``), Linux only.

Starting a rank as a fresh interpreter costs about a second of CPU, most of it ``import torch``; a
4-rank cluster pays it 4 times, and a notebook, a grading or a test that restarts workers pays it
again. The zygote pays it once per caller process: it imports torch (and nothing that starts threads
or touches a device), then waits on a Unix ``SOCK_SEQPACKET`` socket. For each request, which carries
the rank's environment and, as ancillary data, its three pipe ends (tasks, results, output), it forks;
the child points stdout/stderr at the output pipe, takes the environment and runs
:func:`course_lib._worker.main`, exactly what ``python -m course_lib._worker`` runs.

The zygote is single-threaded (fork with other threads running is unsafe); it reaps its children and
reports each exit code to the caller, which has no other way to learn it (the ranks are not its
children). It exits when the caller closes the socket; its children notice that their parent is gone
and exit too (:func:`course_lib._worker._watch_parent`).

Messages (pickled, one per packet): caller -> zygote ``("spawn", env)`` with 3 fds; zygote -> caller
``("ready", pid)`` once, ``("spawned", pid)`` per request, ``("exited", pid, code)`` per child
(``code`` as ``subprocess.Popen.returncode``: negative signal numbers).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


def _child(sock: socket.socket, env: dict, fds: list[int]) -> None:
    task_r, res_w, out_w = fds
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.close(out_w)
        env = dict(env, COURSE_TASK_FD=str(task_r), COURSE_RESULT_FD=str(res_w),
                   COURSE_PARENT_PID=str(os.getppid()))
        os.environ.clear()
        os.environ.update(env)
        from course_lib import _worker
        _worker.main()
        code = 0
    except BaseException:  # noqa: BLE001 - a rank's start-up failure goes to its output
        import traceback
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    # Ctrl-C in a terminal or a notebook's shutdown signals the whole process group: the template
    # ignores it (the caller stops it by closing the socket); each rank gets Python's default back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    # What every rank imports anyway; nothing here may start a thread or initialise a device.
    import cloudpickle  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    # Building any torch.optim optimizer imports torch._dynamo (about 1 s of CPU per rank otherwise);
    # FSDP2, DTensor, DCP and pipelining come with it or cost little more.
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    sock.send(pickle.dumps(("ready", os.getpid())))
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock)
        if not readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:                      # the caller has gone
            return
        kind, env = pickle.loads(msg)
        if kind != "spawn" or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            _child(sock, env, fds)
        for fd in fds:
            os.close(fd)
        sock.send(pickle.dumps(("spawned", pid)))


if __name__ == "__main__":
    main()
