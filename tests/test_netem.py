"""The emulated network (course_lib.netem): paced sends everywhere, namespaces + tc where allowed."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from course_lib import netem
from course_lib.launch import Cluster

LINK = netem.Link(bandwidth=50e6)  # 400 Mbit/s
N_BYTES = 1 << 20


def test_link_rejects_bad_values():
    with pytest.raises(ValueError, match="bandwidth"):
        netem.Link(0)
    with pytest.raises(ValueError, match="latency"):
        netem.Link(1e6, latency=-1)
    assert netem.Link(1e6, latency=1e-3).time(1e6) == pytest.approx(1.001)


def paced_worker(rank, world_size, link, nbytes):
    """Naive and ring all-reduce over the paced transport: results, and the root's time."""
    import torch.distributed as dist
    from course_lib import collectives as C

    tr = netem.PacedTransport(link)
    x = torch.full((nbytes // 4,), float(rank + 1))
    out = {}
    for name, fn in (("ring", C.ring_all_reduce), ("naive", C.naive_all_reduce)):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        fn(y, transport=tr)
        out[name] = (time.perf_counter() - t0, bool((y == world_size * (world_size + 1) / 2).all()))
    return out


def test_paced_transport_is_correct_and_never_faster_than_the_link():
    world = 3
    with Cluster(world, timeout=120) as c:
        res = c.run(paced_worker, LINK, N_BYTES)
    for r, out in enumerate(res):
        assert out["ring"][1] and out["naive"][1], f"rank {r}: wrong sum over the paced transport"
    # Lower bounds that the pacing enforces by sleeping (load can only add to them): the naive
    # root takes N-1 messages of n bytes in and sends N-1 out over one link.
    naive_root = res[0]["naive"][0]
    assert naive_root >= 2 * (world - 1) * N_BYTES / LINK.bandwidth * 0.99, naive_root
    ring = max(o["ring"][0] for o in res)
    assert ring >= 2 * (world - 1) / world * N_BYTES / LINK.bandwidth * 0.99, ring


def async_worker(rank, world_size, link, nbytes):
    """Rank 0 sends one message to rank 1 with the async transport: how long isend and wait took."""
    import torch.distributed as dist
    tr = netem.AsyncPacedTransport(link)
    buf = torch.full((nbytes // 4,), float(rank))
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        work = tr.isend(buf, 1)
        posted = time.perf_counter() - t0
        work.wait()
        return {"posted": posted, "done": time.perf_counter() - t0}
    work = tr.irecv(buf, 0)
    posted = time.perf_counter() - t0
    work.wait()
    return {"posted": posted, "done": time.perf_counter() - t0, "got": bool((buf == 0).all())}


def test_async_paced_transport_returns_at_once_and_waits_for_the_link():
    """isend/irecv return without the link time; wait() holds the sender for its uplink and the receiver
    for its downlink plus the latency (notebook 16's overlap rests on this)."""
    link, nbytes = netem.Link(bandwidth=10e6, latency=0.010), 1 << 20       # 105 ms + 10 ms
    with Cluster(2, timeout=60) as c:
        send, recv = c.run(async_worker, link, nbytes)
    wire = nbytes / link.bandwidth
    assert send["posted"] < 0.2 * wire and recv["posted"] < 0.2 * wire, (send, recv)
    assert send["done"] >= wire * 0.99, send
    assert recv["done"] >= wire + link.latency - 1e-3 and recv["got"], recv


def test_paced_transport_needs_a_link():
    with pytest.raises(TypeError, match="Link"):
        netem.PacedTransport(25e6)


def ns_worker(rank, world_size, nbytes):
    import os
    import torch.distributed as dist

    x = torch.full((nbytes // 4,), float(rank))
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    return time.perf_counter() - t0, float(x[0]), os.environ.get("GLOO_SOCKET_IFNAME")


@pytest.mark.skipif(netem.namespaces_unavailable_reason() is not None,
                    reason=f"no network namespaces here: {netem.namespaces_unavailable_reason()}")
def test_cluster_in_network_namespaces_is_shaped_and_cleaned_up():
    with Cluster(2, network=LINK, timeout=120) as c:
        names = list(c._net.namespaces)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n in listed for n in names)
        res = c.run(ns_worker, 4 * N_BYTES)
    for t, value, ifname in res:
        assert value == 1.0 and ifname == "eth0"
        # gloo's all-reduce moves at least n/2 bytes each way over each shaped link
        assert t >= 0.5 * 4 * N_BYTES / LINK.bandwidth * 0.9, t
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), "namespaces left behind after close()"


def test_namespace_network_refuses_latency():
    with pytest.raises(ValueError, match="latency"):
        netem.NamespaceNetwork(2, netem.Link(1e6, latency=1e-3))
