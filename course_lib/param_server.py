"""A parameter server on real processes: asynchronous and synchronous SGD.

Rank 0 is the server; it owns the parameters. Ranks ``1..n_workers`` are workers: each one pulls
the parameters, computes a gradient on a mini-batch of its own data shard and pushes it back.

* ``mode="sync"``: the server waits for one gradient from *every* worker, averages them, takes one
  step and sends the new parameters to everyone. This is synchronous SGD (one large batch), and the
  slowest worker sets the pace.
* ``mode="async"``: the server applies each gradient the moment it arrives
  (``dist.recv(src=None)`` takes whichever worker's message comes first) and answers only that worker.
  Nobody waits for a straggler, but a gradient may have been computed on parameters that are
  ``staleness = version_now - version_used`` updates old (Hogwild-style asynchrony; Dean et al. 2012,
  "Large Scale Distributed Deep Networks" (DistBelief, Downpour SGD), section 4.1; Li et al. 2014,
  "Scaling Distributed Machine Learning with the Parameter Server", OSDI).

Every message is one flat tensor ``[version, payload...]`` of ``1 + P`` elements (P = number of
parameters) in the parameters' dtype and on their device, so the server's traffic per update is easy
to predict: with float32 parameters it receives ``(1 + P) * 4`` bytes and sends ``(1 + P) * 4`` bytes
per gradient, i.e. ``2 * n_workers * (1 + P) * 4`` bytes per synchronous step -- linear in the number
of workers, the bottleneck the parameter server is known for.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

__all__ = ["parameter_server_sgd"]

_STOP = -1.0


def _record(name, nbytes_sent, nbytes_recv, start, end):
    try:
        from course_lib import trace
    except ImportError:  # pragma: no cover
        return
    rec = trace.current()
    if rec is not None:
        rec.comm(name, nbytes_sent, nbytes_recv, start, end)


def _validate(world_size, n_workers, n_updates, lr, batch_size, mode, delays, X):
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if not (isinstance(n_workers, int) and 1 <= n_workers <= world_size - 1):
        raise ValueError(f"n_workers must be an int in [1, world_size - 1] = [1, {world_size - 1}] "
                         f"(rank 0 is the server), got {n_workers!r}; start more ranks for more workers")
    if not (isinstance(n_updates, int) and n_updates >= 1):
        raise ValueError(f"n_updates must be a positive int, got {n_updates!r}")
    if not (lr > 0):
        raise ValueError(f"lr must be positive, got {lr!r}")
    shard = len(X) // n_workers
    if not (isinstance(batch_size, int) and 1 <= batch_size <= shard):
        raise ValueError(f"batch_size must be an int in [1, {shard}] (each of the {n_workers} workers "
                         f"owns {shard} of the {len(X)} samples), got {batch_size!r}")
    for r, d in (delays or {}).items():
        if d < 0:
            raise ValueError(f"delays[{r}] = {d} is negative; a delay is extra seconds per gradient")


def parameter_server_sgd(rank: int, world_size: int, model: nn.Module, X: torch.Tensor, y: torch.Tensor,
                         *, n_updates: int, lr: float, batch_size: int, mode: str = "async",
                         n_workers: int | None = None, delays: dict | None = None, seed: int = 0,
                         loss_fn=nn.functional.mse_loss) -> dict:
    """Train ``model`` on ``(X, y)`` with a parameter server; call it on every rank.

    Args:
        model: the same architecture on every rank (the server's initial parameters are used).
        X, y: the whole data set ``(n, ...)``; worker ``w`` (1-based) owns rows
            ``[(w-1) s, w s)`` with ``s = n // n_workers`` (the remainder is left out).
        n_updates: optimizer steps the server takes (async: one per gradient; sync: one per round of
            ``n_workers`` gradients).
        lr: SGD learning rate. batch_size: samples per worker gradient.
        mode: ``"async"`` or ``"sync"`` (see the module docstring).
        n_workers: workers among ranks ``1..world_size-1`` (default all); other ranks sit idle.
        delays: ``{rank: seconds}`` of extra sleep per gradient (a straggler).
        seed: mini-batch sampling seed (each worker adds its rank).

    Returns:
        On the server: ``dict(mode, time, grads, loss, staleness, worker, bytes_sent, bytes_recv)`` where
        ``time[i]`` (s since start), ``grads[i]`` (gradients consumed so far) and ``loss[i]`` (full-data
        loss) describe the model after update ``i`` (index 0 = before training); ``staleness[j]`` and
        ``worker[j]`` describe the j-th gradient applied. On a worker: ``dict(rank, n_grads)``.
    """
    n_workers = world_size - 1 if n_workers is None else n_workers
    delays = dict(delays or {})
    _validate(world_size, n_workers, n_updates, lr, batch_size, mode, delays, X)
    if mode == "async" and dist.get_backend() == "nccl":
        raise ValueError("mode='async' receives from whichever worker is first (dist.recv(src=None)), which "
                         "NCCL does not support; use mode='sync' under NCCL, or gloo (CPU processes)")
    flat = parameters_to_vector(model.parameters()).detach().clone()
    P = flat.numel()
    msg_bytes = (1 + P) * flat.element_size()
    if rank == 0:
        return _server(model, X, y, flat, n_workers, n_updates, lr, mode, loss_fn, msg_bytes)
    if rank > n_workers:
        return dict(rank=rank, n_grads=0)
    return _worker(rank, model, X, y, flat, n_workers, batch_size, delays.get(rank, 0.0), seed, loss_fn)


def _server(model, X, y, flat, n_workers, n_updates, lr, mode, loss_fn, msg_bytes):
    P = flat.numel()
    buf = torch.empty(1 + P, dtype=flat.dtype, device=flat.device)
    out = torch.empty(1 + P, dtype=flat.dtype, device=flat.device)
    sent = recv = 0
    version = 0

    @torch.no_grad()
    def full_loss():
        vector_to_parameters(flat, model.parameters())
        return loss_fn(model(X), y).item()

    def reply(dst, v):
        nonlocal sent
        out[0] = v
        out[1:] = flat
        t0 = time.time()
        dist.send(out, dst=dst)
        _record("send params", msg_bytes, 0, t0, time.time())
        sent += msg_bytes

    def receive(src=None):
        nonlocal recv
        t0 = time.time()
        who = dist.recv(buf, src=src)
        _record("recv grad", 0, msg_bytes, t0, time.time())
        recv += msg_bytes
        return who

    t_start = time.time()
    hist = dict(mode=mode, time=[0.0], grads=[0], loss=[full_loss()], staleness=[], worker=[])
    for w in range(1, n_workers + 1):
        reply(w, version)
    if mode == "async":
        active = n_workers
        while active:
            who = receive()  # whichever worker is first: real asynchrony
            if version >= n_updates:
                reply(who, _STOP)
                active -= 1
                continue
            hist["staleness"].append(version - int(buf[0].item()))
            hist["worker"].append(who)
            flat.sub_(lr * buf[1:])
            version += 1
            hist["time"].append(time.time() - t_start)
            hist["grads"].append(hist["grads"][-1] + 1)
            hist["loss"].append(full_loss())
            reply(who, version)
    else:
        acc = torch.zeros(P, dtype=flat.dtype, device=flat.device)
        for _ in range(n_updates):
            acc.zero_()
            for w in range(1, n_workers + 1):
                receive(w)
                hist["staleness"].append(version - int(buf[0].item()))
                hist["worker"].append(w)
                acc.add_(buf[1:])
            flat.sub_(lr / n_workers * acc)  # the average of the workers' gradients
            version += 1
            hist["time"].append(time.time() - t_start)
            hist["grads"].append(hist["grads"][-1] + n_workers)
            hist["loss"].append(full_loss())
            for w in range(1, n_workers + 1):
                reply(w, version if version < n_updates else _STOP)
    hist["bytes_sent"], hist["bytes_recv"] = sent, recv
    hist["params"] = flat.clone()
    return hist


def _worker(rank, model, X, y, flat, n_workers, batch_size, delay, seed, loss_fn):
    s = len(X) // n_workers
    Xw, yw = X[(rank - 1) * s: rank * s], y[(rank - 1) * s: rank * s]
    g = torch.Generator(device="cpu").manual_seed(seed + rank)   # the same mini-batches on every device
    buf = torch.empty(1 + flat.numel(), dtype=flat.dtype, device=flat.device)
    msg = torch.empty(1 + flat.numel(), dtype=flat.dtype, device=flat.device)
    n = 0
    while True:
        dist.recv(buf, src=0)
        if buf[0].item() == _STOP:
            return dict(rank=rank, n_grads=n)
        vector_to_parameters(buf[1:], model.parameters())
        model.zero_grad(set_to_none=True)
        idx = torch.randint(0, s, (batch_size,), generator=g, device="cpu")   # indexes X on any device
        loss_fn(model(Xw[idx]), yw[idx]).backward()
        if delay:
            time.sleep(delay)  # a straggler: slower hardware, a busy node, a long data load...
        msg[0] = buf[0]  # the version this gradient was computed on
        msg[1:] = parameters_to_vector(p.grad for p in model.parameters())
        dist.send(msg, dst=0)
        n += 1
