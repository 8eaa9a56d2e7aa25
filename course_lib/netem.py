"""An emulated network for the virtual cluster: every rank gets one link of a set bandwidth.

On one machine the ranks talk over loopback, where the CPU, not any link, is the bottleneck: the
root of a naive all-reduce is not slower than anybody else, so the ring's advantage cannot show.
This module gives each rank a link of its own, outside the algorithms' code, in one of two ways:

* :class:`NamespaceNetwork` (Linux, root, ``ip`` and ``tc``): every rank runs in its own network
  namespace, joined to a bridge by a veth pair. A token-bucket filter (``tc qdisc ... tbf``) on
  both ends of each pair limits what the rank sends (its uplink) and what it receives (its
  downlink) to ``link.bandwidth``. The bytes really cross a shaped network; the collectives and
  gloo are unchanged. Use it through ``Cluster(n, network=Link(...))``.
* :class:`PacedTransport` (anywhere, no privileges): a point-to-point layer with
  ``torch.distributed``'s ``isend``/``irecv`` signature that makes every message take as long as it
  would on the link: a send occupies the sender's uplink for ``latency + bytes / bandwidth``
  before it goes out; a receive completes no earlier than the receiver's downlink could have
  taken it, one message after another. Pass it to the collectives: ``ring_all_reduce(t,
  transport=PacedTransport(link))``. Only our point-to-point collectives are paced
  (``dist.all_reduce`` is not).

The alpha-beta (Hockney) model these links realise: a message of ``m`` bytes costs
``alpha + m * beta`` with ``beta = 1 / bandwidth`` (R. Hockney, "The communication challenge for
MPP", Parallel Computing 20, 1994).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

__all__ = ["Link", "PacedTransport", "AsyncPacedTransport", "NamespaceNetwork", "namespaces_unavailable_reason"]


@dataclass(frozen=True)
class Link:
    """One rank's network link: ``bandwidth`` in bytes per second each way, ``latency`` in seconds.

    ``latency`` is added per message by :class:`PacedTransport`; :class:`NamespaceNetwork` needs
    ``latency=0`` (its latency is whatever the kernel's network stack takes: adding delay needs
    the ``netem`` queueing discipline, which not every kernel has).
    """

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be a positive number of bytes per second, got "
                             f"{self.bandwidth!r} (e.g. Link(bandwidth=25e6) for 200 Mbit/s)")
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0):
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency!r}")

    def time(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` occupies the link: ``latency + nbytes / bandwidth``."""
        return self.latency + nbytes / self.bandwidth


# ------------------------------------------------------------------------------------------
# paced sends: the fallback that needs no privileges
# ------------------------------------------------------------------------------------------
class _PacedRecv:
    """The work handle of a paced receive: ``wait()`` returns when the downlink could have delivered."""

    def __init__(self, transport: "PacedTransport", work, nbytes: int, posted: float) -> None:
        self._t, self._work, self._nbytes, self._posted = transport, work, nbytes, posted

    def wait(self, timeout=None):
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._t._sleep_until(self._t._downlink(self._nbytes, self._posted))
        return ok



class PacedTransport:
    """Point-to-point over ``torch.distributed``, paced as if each rank had one link ``link``.

    Model (per rank, full duplex): the uplink sends one message at a time, each for
    ``link.time(bytes)``; the downlink takes one message at a time, ``bytes / bandwidth`` each, from
    when the receive was posted. So N-1 ranks sending to one root at once finish after N-1 times
    one message's time, as on a real link. Times come from ``time.perf_counter`` of the rank itself.

    ``isend`` blocks while the (emulated) uplink is busy, then hands the message to
    ``torch.distributed.isend``; callers that post their receives before their sends (as every
    collective in :mod:`course_lib.collectives` does) lose no overlap. The object is picklable and
    keeps its link state per process, so one instance can be shipped to every rank.
    """

    def __init__(self, link: Link) -> None:
        if not isinstance(link, Link):
            raise TypeError(f"PacedTransport needs a netem.Link, got {type(link).__name__}")
        self.link = link
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._uplink_free = 0.0
        self._downlink_free = 0.0

    def __getstate__(self):
        return {"link": self.link}

    def __setstate__(self, state) -> None:
        self.link = state["link"]
        self._reset()

    def _state(self) -> None:
        if os.getpid() != self._pid:  # a forked copy starts with idle links
            self._reset()

    @staticmethod
    def _sleep_until(t: float) -> None:
        while True:
            left = t - time.perf_counter()
            if left <= 0:
                return
            time.sleep(left)

    def _downlink(self, nbytes: int, posted: float) -> float:
        with self._lock:
            start = max(self._downlink_free, posted)
            self._downlink_free = start + nbytes / self.link.bandwidth
            return self._downlink_free

    def isend(self, tensor, dst: int, group=None, tag: int = 0):
        """Like ``torch.distributed.isend``; first waits ``link.time(bytes)`` on this rank's uplink."""
        import torch.distributed as dist

        done = self._uplink(tensor)
        self._sleep_until(done)
        return dist.isend(tensor, dst, group=group, tag=tag)

    def _uplink(self, tensor) -> float:
        """Book ``tensor``'s bytes on this rank's uplink (after what is queued there); when they are out."""
        self._state()
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            start = max(self._uplink_free, time.perf_counter())
            self._uplink_free = start + self.link.time(nbytes)
            return self._uplink_free

    def _irecv(self, tensor, src: int, group, tag: int, handle):
        import torch.distributed as dist

        self._state()
        posted = time.perf_counter()
        work = dist.irecv(tensor, src, group=group, tag=tag)
        return handle(self, work, tensor.numel() * tensor.element_size(), posted)

    def irecv(self, tensor, src: int, group=None, tag: int = 0):
        """Like ``torch.distributed.irecv``; its ``wait()`` also waits for this rank's downlink."""
        return self._irecv(tensor, src, group, tag, _PacedRecv)

    def __repr__(self) -> str:
        return f"PacedTransport({self.link})"


class _AsyncPacedSend:
    """The work handle of an asynchronous paced send: ``wait()`` returns when the uplink is done."""

    def __init__(self, work, done: float) -> None:
        self._work, self._done = work, done

    def wait(self, timeout=None):
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        PacedTransport._sleep_until(self._done)
        return ok


class _AsyncPacedRecv(_PacedRecv):
    """A paced receive whose message left the sender at once (:class:`AsyncPacedTransport`)."""

    def wait(self, timeout=None):
        # When did the message leave the sender? gloo cannot say (its works report completion only once
        # waited for). If it was already here, the wait returns at once, and we take it to have left
        # when we posted the receive (the ranks of a ring or an all-to-all post together); if the wait
        # holds, the sender posted late, and the link starts when it returns.
        before = time.perf_counter()
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        after = time.perf_counter()
        start = self._posted if after - before < self._LATE else after
        self._t._sleep_until(self._t._downlink(self._nbytes, start) + self._t.link.latency)
        return ok

    _LATE = 2e-3  # seconds a wait may take on loopback for a message that was already sent


class AsyncPacedTransport(PacedTransport):
    """:class:`PacedTransport` whose ``isend`` returns at once, as a GPU's does.

    On a GPU, a send is a kernel (NCCL) or a copy engine's job: the host thread posts it and goes on
    computing while the bytes move. :class:`PacedTransport` instead holds the caller for the message's
    link time (a CPU thread that sends), so nothing can overlap it. Here a send is posted to
    ``torch.distributed`` at once and only its handle's ``wait()`` holds until this rank's uplink would
    have finished (``link.time(bytes)`` after the previous message, one message at a time); a receive's
    ``wait()`` holds until the downlink would have delivered it. So computation between posting and
    waiting hides the link time, which is what overlap means. Same model and state as
    :class:`PacedTransport` (picklable, per process); everything is posted from the caller's thread.
    """

    def isend(self, tensor, dst: int, group=None, tag: int = 0):
        """Like ``torch.distributed.isend``, returning at once; ``wait()`` holds until the uplink is done."""
        import torch.distributed as dist

        done = self._uplink(tensor)
        return _AsyncPacedSend(dist.isend(tensor, dst, group=group, tag=tag), done)

    def irecv(self, tensor, src: int, group=None, tag: int = 0):
        """Like ``torch.distributed.irecv``; ``wait()`` also holds until the downlink delivered it."""
        return self._irecv(tensor, src, group, tag, _AsyncPacedRecv)

    def __repr__(self) -> str:
        return f"AsyncPacedTransport({self.link})"


# ------------------------------------------------------------------------------------------
# network namespaces + tc: a real shaped network (Linux, root)
# ------------------------------------------------------------------------------------------
def _sh(*cmd: str) -> str:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def namespaces_unavailable_reason() -> str | None:
    """``None`` when :class:`NamespaceNetwork` can work here, else why not (for a message)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (this process is not root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is missing (Debian/Ubuntu: apt-get install iproute2)"
    probe = f"ddlp{uuid.uuid4().hex[:8]}"
    try:
        _sh("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace here ({exc})"
    try:
        _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", "1gbit", "burst", "64kb", "latency", "50ms")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"the kernel refuses traffic shaping with tc tbf ({exc})"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


_live_networks: "set[NamespaceNetwork]" = set()


class NamespaceNetwork:
    """``world_size`` network namespaces on one bridge, each rank's link shaped to ``link``.

    Layout: bridge ``ddl<id>`` with address ``10.<a>.<b>.1/24`` in the root namespace (where the
    caller's rendezvous store listens); rank r in namespace ``ddl<id>r<r>`` with interface
    ``eth0`` = ``10.<a>.<b>.<10+r>``, the other end of its veth pair on the bridge. ``tc tbf`` at
    ``link.bandwidth`` on ``eth0`` shapes the rank's uplink and on the bridge-side end its
    downlink. tbf counts whole Ethernet frames, so TCP payload gets about 95% of the rate.

    Raises ``RuntimeError`` with the reason when namespaces cannot be made here (see
    :func:`namespaces_unavailable_reason`); everything is removed by :meth:`close`, at interpreter
    exit, or on a failed set-up.
    """

    ifname = "eth0"

    def __init__(self, world_size: int, link: Link) -> None:
        if not isinstance(link, Link):
            raise TypeError(f"NamespaceNetwork needs a netem.Link, got {type(link).__name__}")
        if link.latency:
            raise ValueError(f"NamespaceNetwork shapes bandwidth only; got latency={link.latency} s. "
                             "Use Link(bandwidth, latency=0) here, or PacedTransport for latency.")
        if not 1 <= world_size <= 200:
            raise ValueError(f"world_size must be 1..200 for one /24 subnet, got {world_size}")
        reason = namespaces_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot build an emulated network of namespaces: {reason}. "
                               "Use netem.PacedTransport(link) with the collectives instead.")
        self.world_size, self.link = world_size, link
        self.id = uuid.uuid4().hex[:6]
        self.bridge = f"ddl{self.id}"
        self.namespaces = [f"ddl{self.id}r{r}" for r in range(world_size)]
        self.subnet = self._free_subnet()
        self.host_ip = f"{self.subnet}.1"
        self.rank_ips = [f"{self.subnet}.{10 + r}" for r in range(world_size)]
        self._closed = False
        _live_networks.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _free_subnet(self) -> str:
        used = _sh("ip", "-o", "-4", "addr", "show")
        for _ in range(200):
            h = uuid.uuid4().int
            cand = f"10.{200 + h % 50}.{(h >> 8) % 256}"
            if f" {cand}." not in used:
                return cand
        raise RuntimeError("found no free 10.x.y.0/24 subnet for the emulated network")

    def _tbf(self, *where: str, dev: str) -> None:
        rate = f"{int(self.link.bandwidth * 8)}bit"
        burst = max(16_000, int(self.link.bandwidth * 0.002))  # ~2 ms of data, >= a few frames
        _sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", str(burst), "latency", "200ms")

    def _build(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for r, ns in enumerate(self.namespaces):
            host_end = f"ddl{self.id}h{r}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", self.ifname,
                "netns", ns)
            _sh("ip", "link", "set", host_end, "master", self.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.rank_ips[r]}/24", "dev", self.ifname)
            _sh("ip", "-n", ns, "link", "set", self.ifname, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._tbf("ip", "netns", "exec", ns, dev=self.ifname)  # uplink: what rank r sends
            self._tbf(dev=host_end)                                  # downlink: what rank r gets

    def command_prefix(self, rank: int) -> list[str]:
        """Prefix a command with this to run it as rank ``rank`` inside its namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def close(self) -> None:
        """Delete the namespaces (with their veth pairs) and the bridge. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        _live_networks.discard(self)

    def __enter__(self) -> "NamespaceNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "up"
        return (f"NamespaceNetwork({self.world_size} ranks, {self.link.bandwidth * 8 / 1e6:g} Mbit/s "
                f"per link, tc tbf, {state})")


@atexit.register
def _close_all() -> None:
    for net in list(_live_networks):
        try:
            net.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
