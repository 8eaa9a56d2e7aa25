"""The virtual cluster: real processes, a real ``torch.distributed`` process group, one call away.

::

    from course_lib.launch import Cluster, run

    def hello(rank, world_size):
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)               # a real collective over gloo (CPU) or NCCL (GPUs)
        return t.item()

    run(hello, 4)                        # -> [6.0, 6.0, 6.0, 6.0]
    with Cluster(4) as cluster:          # warm workers: the start-up is paid once
        cluster.run(hello)

How it works. ``Cluster(n)`` starts ``n`` worker processes that inherit nothing from the caller but
three pipes. On Linux they are forked from a *template* process (:mod:`course_lib._zygote`) that
imported torch once, so a rank starts in milliseconds instead of the second ``import torch`` takes;
elsewhere, with an emulated network, with NCCL, or with ``COURSE_NO_ZYGOTE=1`` each rank is a fresh
interpreter (the equivalent of multiprocessing's *spawn*). The caller hosts
a ``TCPStore``; every rank joins it and calls ``init_process_group``. A call ships ``(fn, args)`` to all
ranks by value with cloudpickle (so functions defined in a notebook work), runs ``fn(rank, world_size,
*args)`` and sends the return value back. stdout/stderr of each rank are read by the caller and
printed with a ``[rank r]`` prefix, whole lines.

Failures never hang the caller: an exception on a rank or a dead rank raises :class:`RankError` naming
the rank(s) with the remote traceback or exit code; a call that does not finish within ``timeout``
seconds raises :class:`TimeoutError`. Ranks that may be stuck are stopped, and the next call starts
fresh workers.

The same worker functions run under ``torchrun`` through :func:`init_from_env` (see
``course_lib/demos/hello.py``). :func:`jax_cpu_devices` gives JAX ``n`` simulated CPU devices.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import cloudpickle

from course_lib._worker import SENTINEL

__all__ = ["Cluster", "RankError", "run", "init_from_env", "device", "jax_cpu_devices", "xla_flag_known",
           "pids_with_env"]

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GRACE_S = 3.0  # after one rank fails, how long the others get to finish on their own
_live_clusters: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class RankError(RuntimeError):
    """One or more ranks raised an exception or died.

    Attributes:
        failures: ``{rank: text}`` with the remote traceback or the exit description per failed rank.
        ranks: the failed ranks, sorted.
    """

    def __init__(self, fn_name: str, failures: dict[int, str], stopped: list[int] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.ranks = sorted(failures)
        self.stopped = sorted(stopped or [])
        parts = [f"{fn_name} failed on rank(s) {', '.join(map(str, self.ranks))}"]
        if self.stopped:
            parts[0] += (f"; rank(s) {', '.join(map(str, self.stopped))} were still waiting "
                         f"(probably in a collective with the failed rank) and were stopped")
        for r, text in self.failures.items():
            parts.append(f"--- rank {r} ---\n{text.rstrip()}")
        super().__init__("\n".join(parts))


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} ({world_size!r})")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


def _n_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_backend(backend: str | None, world_size: int) -> str:
    """The virtual cluster's backend: ``None`` -> gloo, GPUs or not (see :class:`Cluster`); checks an
    explicit ``"gloo"`` or ``"nccl"``."""
    if backend is None:
        return "gloo"
    if not isinstance(backend, str) or backend.lower() not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None (gloo), got {backend!r}")
    backend = backend.lower()
    n_gpu = _n_gpus() if backend == "nccl" else 0
    if backend == "nccl" and n_gpu < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {n_gpu} GPU(s) are "
            f"visible. Use backend='gloo' (CPU processes), or ask for at most {n_gpu} ranks.")
    return backend


def _torchrun_backend(ranks_per_node: int) -> str:
    """:func:`init_from_env`'s automatic choice: NCCL when this node has a GPU for each of its
    ``ranks_per_node`` ranks, else gloo."""
    return "nccl" if _n_gpus() >= ranks_per_node else "gloo"


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process died from {name} (exit code {code})"
    return f"the process exited with code {code} before returning a result"


class _Rank:
    """Caller-side handle of one worker process."""

    def __init__(self, rank: int, proc: subprocess.Popen, tasks: Connection, results: Connection,
                 out: "queue.Queue[tuple[int, str | None]]"):
        self.rank, self.proc, self.tasks, self.results = rank, proc, tasks, results
        self.reader = threading.Thread(target=self._read, args=(out,), daemon=True)
        self.reader.start()

    def _read(self, out: "queue.Queue[tuple[int, str | None]]") -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            out.put((self.rank, raw.decode("utf-8", "replace").rstrip("\n")))
        out.put((self.rank, None))

    def stop(self, kill: bool) -> None:
        if kill:
            if self.proc.poll() is None:
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
        else:
            try:
                self.tasks.send(("exit",))
            except (OSError, ValueError):
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for conn in (self.tasks, self.results):
            try:
                conn.close()
            except OSError:
                pass
        self.reader.join(timeout=2)
        self.proc.stdout.close()


class _ForkedProc:
    """The caller's handle of a rank forked by the zygote: the parts of ``subprocess.Popen`` that
    :class:`Cluster` uses (``pid``, ``stdout``, ``poll``, ``wait``, ``kill``). The exit code comes from
    the zygote, which reaps its children."""

    def __init__(self, zygote: "_Zygote", pid: int, stdout):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Zygote:
    """One pre-forked template per caller process (see :mod:`course_lib._zygote`): ``import torch`` is
    paid once, and every rank after that is a fork. Linux only; ``COURSE_NO_ZYGOTE=1`` turns it off."""

    _instance: "_Zygote | None" = None
    _broken = False

    @classmethod
    def get(cls) -> "_Zygote | None":
        if cls._broken or not sys.platform.startswith("linux") or os.environ.get("COURSE_NO_ZYGOTE"):
            return None
        z = cls._instance
        if z is None or z.proc.poll() is not None:
            try:
                z = cls._instance = _Zygote()
            except Exception:  # noqa: BLE001 - fall back to starting interpreters
                cls._broken = True
                return None
        return z

    def __init__(self):
        import socket
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PKG_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "course_lib._zygote", str(theirs.fileno())],
                                     env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock = ours
        self.codes: dict[int, int] = {}
        self.cond = threading.Condition()
        self.replies: "queue.Queue[int]" = queue.Queue()
        self.lock = threading.Lock()
        ours.settimeout(120)
        kind, self.pid = pickle.loads(ours.recv(1 << 16))
        if kind != "ready":
            raise RuntimeError("the rank template did not start")
        ours.settimeout(None)
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:                       # the template has gone: wake whoever waits on it
                self.replies.put(None)
                with self.cond:
                    self.cond.notify_all()
                return
            m = pickle.loads(msg)
            if m[0] == "spawned":
                self.replies.put(m[1])
            elif m[0] == "exited":
                with self.cond:
                    self.codes[m[1]] = m[2]
                    self.cond.notify_all()

    def spawn(self, env: dict, fds: tuple[int, int, int], stdout) -> _ForkedProc:
        import socket
        with self.lock:
            socket.send_fds(self.sock, [pickle.dumps(("spawn", env))], list(fds))
            pid = self.replies.get(timeout=60)
        if pid is None:
            raise RuntimeError("the rank template (course_lib._zygote) exited while starting a rank; the next "
                               "Cluster starts a new one (set COURSE_NO_ZYGOTE=1 to start ranks as interpreters)")
        return _ForkedProc(self, pid, stdout)

    def exit_code(self, pid: int) -> int | None:
        with self.cond:
            return self.codes.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while pid not in self.codes:
                if self.proc.poll() is not None:   # the template died: its children die with it
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        self.codes[pid] = -signal.SIGKILL
                        break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(0.1 if left is None else min(left, 0.1))
            return self.codes[pid]


class Cluster:
    """``world_size`` warm ranks with an initialised default process group.

    Args:
        world_size: number of ranks (processes), >= 1.
        backend: ``None`` (the default) or ``"gloo"``: CPU processes talking over gloo, on every machine,
            with GPUs or without: the notebooks' rank functions create CPU tensors and are checked that
            way. ``"nccl"``: rank ``r`` computes on GPU ``r`` (``torch.cuda.set_device(r)``), which is
            also its default device (``torch.set_default_device``), so that the same rank functions,
            whose factory calls name no device, create their tensors on the GPU unchanged; the tensors in
            the values a rank returns come back as CPU tensors. Needs one GPU per rank. Under NCCL,
            tensors shipped as arguments keep their device (CPU), and code that draws from a CPU
            ``torch.Generator`` must create its tensors with ``device="cpu"`` (a CPU generator cannot
            fill a tensor on the GPU) and move them.
        timeout: default seconds a :meth:`run` call may take before :class:`TimeoutError`.
        threads: ``torch.set_num_threads`` in every rank (1 avoids oversubscribing a laptop).
        output: ``"ordered"`` prints each call's rank output after the call, rank by rank (reads well,
            deterministic); ``"live"`` prints lines as they arrive.
        network: ``None`` (loopback) or a :class:`course_lib.netem.Link`: every rank then runs in its
            own Linux network namespace behind a link shaped to that bandwidth
            (:class:`course_lib.netem.NamespaceNetwork`; needs root, ``ip`` and ``tc``).

    Use as a context manager; the workers are also stopped at interpreter exit.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout: float = 120.0,
                 threads: int = 1, output: str = "ordered", network=None):
        self.world_size = _check_world_size(world_size)
        self.backend = _resolve_backend(backend, self.world_size)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if output not in ("ordered", "live"):
            raise ValueError(f"output must be 'ordered' or 'live', got {output!r}")
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        if network is not None:
            from course_lib.netem import Link
            if not isinstance(network, Link):
                raise TypeError(f"network must be None or a course_lib.netem.Link, got {network!r}")
        self.network = network
        self._net = None  # the NamespaceNetwork of the running workers
        self.timeout = float(timeout)
        self.threads = threads
        self.output = output
        self._ranks: list[_Rank] = []
        self._out: "queue.Queue[tuple[int, str | None]]" = queue.Queue()
        self._store = None
        self._task_id = 0
        self.starts = 0  # how many times workers were (re)started; shown by the notebooks
        _live_clusters.add(self)
        self._start()

    # ----------------------------------------------------------------------------- life cycle
    def _start(self) -> None:
        import torch.distributed as dist
        from datetime import timedelta

        pg_timeout = max(self.timeout, 30.0)
        store_host, prefix = "127.0.0.1", (lambda r: [])
        if self.network is not None:
            from course_lib.netem import NamespaceNetwork
            self._net = NamespaceNetwork(self.world_size, self.network)
            store_host, prefix = self._net.host_ip, self._net.command_prefix
        self._store = dist.TCPStore(store_host, 0, self.world_size, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=pg_timeout))
        self._out = queue.Queue()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PKG_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if self._net is not None:
            env["GLOO_SOCKET_IFNAME"] = self._net.ifname  # the rank's shaped link
        elif self.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env and sys.platform.startswith("linux"):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback: the virtual cluster is one machine
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        ranks = []
        try:
            for r in range(self.world_size):
                task_r, task_w = os.pipe()
                res_r, res_w = os.pipe()
                env.update(COURSE_RANK=str(r), COURSE_WORLD_SIZE=str(self.world_size),
                           COURSE_TASK_FD=str(task_r), COURSE_RESULT_FD=str(res_w),
                           COURSE_PARENT_PID=str(os.getpid()), COURSE_BACKEND=self.backend,
                           COURSE_THREADS=str(self.threads), COURSE_PG_TIMEOUT=str(pg_timeout),
                           COURSE_STORE_HOST=store_host, COURSE_STORE_PORT=str(self._store.port))
                zygote = _Zygote.get() if self.network is None and self.backend == "gloo" else None
                if zygote is not None:   # fork from the template that has torch imported already
                    out_r, out_w = os.pipe()
                    try:
                        proc = zygote.spawn(dict(env), (task_r, res_w, out_w), os.fdopen(out_r, "rb"))
                    finally:
                        os.close(out_w)
                else:
                    proc = subprocess.Popen(prefix(r) + [sys.executable, "-u", "-m", "course_lib._worker"],
                                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, pass_fds=(task_r, res_w))
                os.close(task_r)
                os.close(res_w)
                rank = _Rank(r, proc, Connection(task_w, readable=False),
                             Connection(res_r, writable=False), self._out)
                ranks.append(rank)
                rank.tasks.send(("init", list(sys.path)))
            self._ranks = ranks
            self._wait_ready()
        except BaseException:
            for rank in ranks:
                rank.stop(kill=True)
            self._ranks = []
            self._close_network()
            raise
        self.starts += 1

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + max(self.timeout, 60.0)
        pending = {rk.results: rk for rk in self._ranks}
        lines: dict[int, list[str]] = {r: [] for r in range(self.world_size)}
        failures: dict[int, str] = {}
        while pending:
            for conn in wait(list(pending), timeout=0.05):
                rk = pending.pop(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = ("init_error", _exit_description(rk.proc.wait()))
                if msg[0] != "ready":
                    failures[rk.rank] = msg[1]
            self._drain(lines)
            if failures:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.world_size} ranks did not initialise their process group "
                                   f"within {max(self.timeout, 60.0):.0f} s")
        if failures:
            self._drain(lines)
            out = "\n".join(f"[rank {r}] {ln}" for r in sorted(lines) for ln in lines[r])
            raise RankError("starting the cluster", {r: (out + "\n" if out else "") + t
                                                     for r, t in failures.items()})

    def close(self) -> None:
        """Stop the workers (politely, then by force after 5 s). Safe to call twice."""
        for rank in self._ranks:  # ask all ranks first, so they shut down in parallel
            try:
                rank.tasks.send(("exit",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for rank in self._ranks:
            try:
                rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            rank.stop(kill=True)  # no-op for a process that has exited; closes the pipes
        self._ranks = []
        self._store = None
        self._close_network()

    def _close_network(self) -> None:
        if self._net is not None:
            self._net.close()
            self._net = None

    def _kill(self) -> None:
        for rank in self._ranks:
            rank.stop(kill=True)
        self._ranks = []
        self._store = None
        self._close_network()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (empty when stopped)."""
        return [rk.proc.pid for rk in self._ranks]

    @property
    def exit_codes(self) -> list[int | None]:
        """Per-rank exit code of the current workers: ``None`` while a rank runs (empty when stopped)."""
        return [rk.proc.poll() for rk in self._ranks]

    def __repr__(self) -> str:
        state = "running" if self._ranks else "stopped"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ----------------------------------------------------------------------------- output
    def _drain(self, lines: dict[int, list[str]], done: set[int] | None = None) -> None:
        """Move queued output lines into ``lines`` (or print them live); note sentinels in ``done``."""
        while True:
            try:
                r, text = self._out.get_nowait()
            except queue.Empty:
                return
            if text is None:
                continue
            if text.endswith(SENTINEL):
                text = text[: -len(SENTINEL)]
                if done is not None:
                    done.add(r)
                if not text:
                    continue
            if self.output == "live":
                print(f"[rank {r}] {text}", flush=True)
            else:
                lines[r].append(text)

    def _flush(self, lines: dict[int, list[str]]) -> None:
        for r in sorted(lines):
            for text in lines[r]:
                print(f"[rank {r}] {text}")
            lines[r] = []
        sys.stdout.flush()

    # ----------------------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the values in rank order.

        ``timeout`` is this call's limit in seconds; every other keyword goes to ``fn``.

        Raises:
            TypeError: ``fn`` is not callable, or ``fn``/``args`` cannot be pickled.
            RankError: a rank raised (its traceback is included) or died (its exit code is included).
            TimeoutError: the call took longer than ``timeout`` (default: the cluster's).
        """
        if not callable(fn):
            raise TypeError(f"fn must be a callable taking (rank, world_size, *args), got "
                            f"{type(fn).__name__} ({fn!r})")
        name = getattr(fn, "__name__", repr(fn))
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"{name} or its arguments could not be pickled to send them to the ranks "
                            f"({type(exc).__name__}: {exc}); pass plain data and tensors") from exc
        timeout = self.timeout if timeout is None else float(timeout)
        if any(rk.proc.poll() is not None for rk in self._ranks):
            self._kill()  # a rank died while idle (killed from outside, say): start afresh
        if not self._ranks:
            self._start()
        self._task_id += 1
        task_id = self._task_id
        for rk in self._ranks:
            rk.tasks.send(("task", task_id, payload))

        lines: dict[int, list[str]] = {r: [] for r in range(self.world_size)}
        done: set[int] = set()
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = {rk.results: rk for rk in self._ranks}
        deadline = time.monotonic() + timeout
        grace_end = None
        try:
            while pending:
                for conn in wait(list(pending), timeout=0.05):
                    rk = pending.pop(conn)
                    try:
                        _, tid, ok, data = conn.recv()
                    except (EOFError, OSError):
                        code = rk.proc.wait()
                        failures[rk.rank] = _exit_description(code)
                        done.add(rk.rank)
                        continue
                    if ok:
                        results[rk.rank] = cloudpickle.loads(data)
                    else:
                        failures[rk.rank] = data
                self._drain(lines, done)
                now = time.monotonic()
                if failures and grace_end is None:
                    grace_end = now + _GRACE_S
                if grace_end is not None and now > grace_end:
                    break
                if now > deadline:
                    stuck = sorted(rk.rank for rk in pending.values())
                    self._drain(lines, done)
                    self._flush(lines)
                    self._kill()
                    raise TimeoutError(
                        f"{name} did not finish within {timeout:g} s on rank(s) {stuck} "
                        f"(a hang: often mismatched collectives, e.g. one rank skipped an all_reduce "
                        f"or waits for a recv nobody sends). The workers were stopped; the next call "
                        f"starts fresh ones. Pass timeout=... if the work is just slow.")
        except KeyboardInterrupt:
            self._flush(lines)
            self._kill()
            raise

        stopped = sorted(rk.rank for rk in pending.values())
        # Wait briefly for the rest of the output of ranks that finished (their sentinel line).
        alive = {rk.rank for rk in self._ranks} - set(stopped)
        t_end = time.monotonic() + 2.0
        while not alive <= done and time.monotonic() < t_end:
            time.sleep(0.005)
            self._drain(lines, done)
        self._drain(lines, done)
        if failures:
            self._flush(lines)
            if stopped or any(rk.proc.poll() is not None for rk in self._ranks):
                self._kill()  # the process group is no longer usable: respawn on the next call
            raise RankError(name, failures, stopped)
        self._flush(lines)
        return [results[r] for r in range(self.world_size)]


def run(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
        timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` ranks, run ``fn(rank, world_size, *args, **kwargs)`` on each, stop them.
    ``backend`` as for :class:`Cluster` (``None``: gloo).

    Returns the per-rank return values as a list in rank order. For several calls, keep a
    :class:`Cluster` open instead: starting the processes costs seconds, a warm call milliseconds.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking (rank, world_size, *args), got "
                        f"{type(fn).__name__} ({fn!r})")
    with Cluster(world_size, backend=backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)


@atexit.register
def _stop_all() -> None:
    for cluster in list(_live_clusters):
        try:
            cluster._kill()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------------- torchrun
def pids_with_env(entry: str, within: float = 0.0) -> list[int]:
    """Processes (other than this one) whose environment holds ``entry`` (``"NAME=value"``), read from
    Linux's ``/proc``: how the course's tests and the grading benchmark check that a run left no process
    behind (they start it with a unique tag in its environment, which every child inherits). With
    ``within`` > 0, scans again every 0.2 s for up to that many seconds while the list is not empty
    (killed processes take a moment to be reaped). Raises ``OSError`` where there is no ``/proc``."""
    if "=" not in entry:
        raise ValueError(f"entry must be 'NAME=value', got {entry!r}")
    if not os.path.exists("/proc/self/environ"):
        raise OSError("pids_with_env reads /proc/<pid>/environ (Linux); this system has none")
    needle = entry.encode()

    def scan() -> list[int]:
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    with open(f"/proc/{name}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            out.append(int(name))
                except OSError:        # gone meanwhile, or not ours to read
                    pass
        return out

    end = time.monotonic() + within
    while (left := scan()) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def init_from_env(backend: str | None = None, timeout=None) -> tuple[int, int]:
    """Initialise the default process group from ``torchrun``'s environment; return ``(rank, world_size)``.

    ``torchrun --standalone --nproc_per_node=N -m course_lib.demos.hello`` sets ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. With ``backend=None`` each rank
    uses NCCL on GPU ``LOCAL_RANK`` when the node has enough GPUs, else gloo on CPU. The worker
    functions written for :class:`Cluster` can then be called as ``fn(rank, world_size, *args)``.
    ``timeout`` (a ``datetime.timedelta``) is the process group's; a short one makes a restarted job
    whose rendezvous fails (``torchrun --max-restarts``) fail fast and retry instead of waiting.
    """
    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env() needs torchrun's environment; {', '.join(missing)} not set. "
                           f"Start the script with: torchrun --standalone --nproc_per_node=2 -m course_lib.demos.hello")
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if backend is None:
        backend = _torchrun_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kw = {} if timeout is None else {"timeout": timeout}
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            dist.init_process_group(backend, **kw)
        else:
            # After torchrun restarts the workers (--max-restarts), the rendezvous store still holds
            # the dead attempt's gloo addresses under the same keys; a new worker that reads one
            # fails with "connectFullMesh ... Connection refused". A prefix per attempt keeps them apart.
            from datetime import timedelta
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=(rank == 0 and not agent_store),
                                  timeout=timeout or timedelta(minutes=30))
            dist.init_process_group(backend, store=dist.PrefixStore(f"course_lib/attempt_{restart}/", store),
                                    rank=rank, world_size=world, **kw)
    return dist.get_rank(), dist.get_world_size()


def device():
    """The device this rank computes on: ``cuda:<current>`` under NCCL, else CPU (also before any process
    group exists): :func:`course_lib.collectives.comm_device` of the default group."""
    import torch
    import torch.distributed as dist

    from course_lib.collectives import comm_device   # here: importing launch does not import torch

    return comm_device() if dist.is_initialized() else torch.device("cpu")


# --------------------------------------------------------------------------------- JAX
def _jaxlib_binaries() -> list[str]:
    """The shared libraries of the installed jaxlib that hold XLA (its flag table among them)."""
    import importlib.util

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = list(spec.submodule_search_locations)[0]
    names = sorted(os.listdir(root))
    # libjax_common.so (jaxlib >= 0.5) or xla_extension.so (older); both when a wheel has both
    return [os.path.join(root, f) for f in names
            if f.startswith(("libjax_common", "xla_extension")) and ".so" in f or f.endswith(".pyd")]


_XLA_FLAG_CACHE: dict[str, bool] = {}


def xla_flag_known(name: str) -> bool:
    """Whether the installed XLA (inside jaxlib) defines the ``XLA_FLAGS`` flag ``name``.

    XLA aborts the whole process on a flag it does not know ("Unknown flag in XLA_FLAGS"), and flags
    come and go between jaxlib releases, so optional flags are only set when this finds ``name`` in
    the flag table compiled into jaxlib (a byte search of its shared library: nothing is imported
    or initialised). ``name`` is given without the leading dashes, e.g. ``"xla_cpu_use_xnnpack"``.
    """
    if name not in _XLA_FLAG_CACHE:
        import mmap

        needle = name.encode()
        found = False
        for path in _jaxlib_binaries():
            try:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    found = m.find(needle) >= 0
            except (OSError, ValueError):
                continue
            if found:
                break
        _XLA_FLAG_CACHE[name] = found
    return _XLA_FLAG_CACHE[name]


def jax_cpu_devices(n: int, *, collective_timeout_s: float = 120.0):
    """Give JAX ``n`` simulated CPU devices and return them (a list of ``n`` devices).

    JAX is pinned to its CPU backend (``jax_platforms="cpu"``), so that on a machine with a GPU it
    neither takes the GPU's memory from torch nor runs the notebook's JAX code on a different backend
    than the one whose numbers the notebook prints; ``jax_cpu_devices(1)`` does only that.
    Must run before JAX executes anything in this process (JAX fixes its devices on first use). On
    JAX >= 0.4.38 this sets ``jax_num_cpu_devices``; older versions read
    ``--xla_force_host_platform_device_count`` from ``XLA_FLAGS``, which is set too.

    Collectives between simulated devices never hang silently: when a collective's rendezvous waits
    more than ``collective_timeout_s`` seconds for one of the devices, XLA prints which collective and
    how many of the ``n`` devices arrived, with every thread's stack, and ends the process (a
    notebook kernel dies with that message in its log, a test fails) -- XLA cannot raise a Python
    exception there, since the computation is half run. A warning with the stacks comes after a
    quarter of that time. The flags doing this (and the others below) are only set when the
    installed XLA knows them (:func:`xla_flag_known`), so older or newer jaxlib never aborts on an
    unknown flag; flags the caller already put in ``XLA_FLAGS`` are kept.

    With more simulated devices than cores, XLA:CPU (jaxlib 0.10) deadlocks in a collective now and
    then: one device's computation never starts while the others wait for it in the rendezvous.
    XLA runs each device's computation as a task on a thread pool of ``max(cores, n)`` threads, and a
    participant waiting in a rendezvous blocks its thread, so other tasks on that pool (XNNPACK's
    parallel loops, the devices' own parallel work, host transfers) can leave the last participant
    queued with no thread to run it. So when ``n`` exceeds the core count this also turns XNNPACK off
    and sizes XLA's pools to ``2 n + 2`` threads (``NPROC``, read by XLA, unless already set): a
    spare thread per device and two more. Neither changes results, only which kernels and threads
    compute them. Measured with ``benchmarks/stress_jax_collectives.py`` (notebook 04's JAX cells in a
    loop, 3 processes at once on 2 cores, jaxlib 0.10.2, 2026-12-04), hung processes of 3:

    ============================  ===========================  ===========================
    pool, XNNPACK                 4 devices                    8 devices
    ============================  ===========================  ===========================
    ``n``, on (jaxlib's own)      3 in 120 s                   3 in 60 s
    ``n``, off                    3 in 120 s                   --
    ``n + 2``, on                 1 in 120 s                   --
    ``n + 2``, off                0 in 3 x 300 s (667,694      2 in 150 s
                                  launches)
    ``2 n + 2``, off (this)       0 in 3 x 300 s (579,396      0 in 3 x 300 s (336,762
                                  launches)                    launches)
    ============================  ===========================  ===========================

    Should a collective still stall, the timeout above ends the process with XLA's message.

    Raises:
        RuntimeError: JAX was already initialised with fewer than ``n`` CPU devices (restart the
            kernel and call this first).
        ValueError: ``collective_timeout_s`` is not a positive number of seconds.
    """
    _check_world_size(n)
    if isinstance(collective_timeout_s, bool) or not isinstance(collective_timeout_s, (int, float)) \
            or collective_timeout_s < 1:
        raise ValueError(f"collective_timeout_s must be a number of seconds >= 1, got {collective_timeout_s!r}")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n}")

    def add(name: str, value) -> None:
        if not any(f.lstrip("-").split("=")[0] == name for f in flags) and xla_flag_known(name):
            flags.append(f"--{name}={value}")

    timeout = max(1, int(round(collective_timeout_s)))
    add("xla_cpu_collective_call_terminate_timeout_seconds", timeout)
    add("xla_cpu_collective_call_warn_stuck_timeout_seconds", max(1, timeout // 4))
    if n > (os.cpu_count() or 1):
        add("xla_cpu_use_xnnpack", "false")
        os.environ.setdefault("NPROC", str(2 * n + 2))  # XLA:CPU's pool: a spare thread per device, and two
    os.environ["XLA_FLAGS"] = " ".join(flags)
    # On a machine with a GPU, JAX would otherwise start its CUDA backend too and take 75 % of the
    # GPU's memory at once, so that a torch rank started afterwards fails with "CUDA error: out of
    # memory". The simulated devices are CPU devices: JAX is pinned to its CPU backend, and should a
    # GPU backend start anyway (JAX already initialised on it) it allocates on demand.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    for option, value in (("jax_platforms", "cpu"), ("jax_num_cpu_devices", n)):
        try:
            jax.config.update(option, value)
        except AttributeError:  # very old JAX: XLA_FLAGS alone does it
            pass
        except RuntimeError:  # backends already initialised: fine if there are enough devices
            pass
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(
            f"JAX is already initialised with {len(devices)} CPU device(s) but {n} were asked for. "
            f"Restart the kernel (or the Python process) and call jax_cpu_devices({n}) before any "
            f"other JAX operation.")
    return devices[:n]
