"""Live tensor bytes on any device, CPU included: a peak-memory meter that needs no CUDA allocator.

On a GPU, ``torch.cuda.max_memory_allocated()`` tells the peak. On a CPU there is no such counter, so
the course measures memory the way the allocator would see it, from the tensors themselves:

    with track_memory() as mem:          # a TorchDispatchMode: it sees every aten op that runs
        loss = model(x).sum()            # every new storage an op produces is registered ...
        loss.backward()                  # ... and counted until its last reference goes
    mem.peak_bytes, mem.current_bytes    # the high-water mark and what is still alive

How it counts (what a learner should know to read its numbers):

* Every tensor **produced inside** the block by an aten op is tracked by its *storage* (the memory
  block): a view, an in-place op or an ``out=`` op returns a storage that one of its inputs already
  has, so it allocates nothing and is not counted again. Tensors created before the block (the
  model's parameters, the input batch) are not counted: the meter shows what the computation adds.
* A storage is counted from the op that creates it until it is freed (a ``weakref.finalize`` on
  the storage, which PyTorch keeps alive exactly as long as any tensor uses it). Tensors that
  autograd saves for the backward are alive until the backward frees them, so they are in the count
  -- which is what activation checkpointing (notebook 11) reduces.
* Frees that happen after the block (the caller drops the result later) still lower
  ``current_bytes``; nothing new is registered once the block is left.
* Bytes are ``storage.nbytes()``: the exact payload, without the allocator's rounding or caching
  (on CUDA the caching allocator rounds up to 512-byte blocks and keeps freed blocks, so
  ``torch.cuda.max_memory_allocated`` reads a little higher).

Autograd's backward runs its ops through the same dispatcher, so they are seen too (the engine
carries the mode to its worker thread). Used by notebooks 05 (activation memory under gradient
accumulation), 06 (ZeRO) and 11 (activation checkpointing).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "track_memory", "tensor_bytes"]


def tensor_bytes(*tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view and its base count once)."""
    seen = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_bytes expects tensors, got {type(t).__name__}")
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class MemoryTracker(TorchDispatchMode):
    """A ``TorchDispatchMode`` that counts the bytes of live storages created while it is active.

    Attributes (bytes, ``int``):

    * ``current_bytes`` -- tracked storages still alive now;
    * ``peak_bytes`` -- the highest ``current_bytes`` seen (reset with :meth:`reset_peak`);
    * ``timeline`` -- with ``timeline=True``, a list of ``(event, current_bytes)`` after every
      allocation (``event`` = the aten op name, e.g. ``"aten.mm.default"``), every free
      (``"free"``) and every :meth:`mark` (``"mark:<label>"``); empty otherwise.

    Use :func:`track_memory` to create one; it is a context manager.
    """

    def __init__(self, timeline: bool = False):
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.timeline = []
        self._record = bool(timeline)
        self._live = {}          # id -> (nbytes, op name) of tracked storages still alive
        self._by_ptr = {}        # data_ptr -> id, to recognise an already-tracked storage
        self._next_id = 0
        self._lock = threading.Lock()   # finalizers may run on autograd's worker thread

    # ---------------------------------------------------------------- reading
    def live_by_op(self) -> dict:
        """``{aten op name: bytes}`` of the tracked storages alive now, grouped by the op that made them."""
        out = {}
        with self._lock:
            for nbytes, op in self._live.values():
                out[op] = out.get(op, 0) + nbytes
        return out

    def reset_peak(self) -> None:
        """Set ``peak_bytes`` to ``current_bytes`` (e.g. between the forward and the backward)."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def mark(self, label: str) -> None:
        """Put a labelled point in the timeline (e.g. ``mem.mark("backward")``)."""
        with self._lock:
            if self._record:
                self.timeline.append((f"mark:{label}", self.current_bytes))

    # ---------------------------------------------------------------- counting
    def _register(self, storage, op: str) -> None:
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        with self._lock:
            if ptr in self._by_ptr:
                return
            key = self._next_id
            self._next_id += 1
            self._live[key] = (nbytes, op)
            self._by_ptr[ptr] = key
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            if self._record:
                self.timeline.append((op, self.current_bytes))
        weakref.finalize(storage, self._free, key, ptr)

    def _free(self, key, ptr) -> None:
        with self._lock:
            nbytes, _ = self._live.pop(key)
            if self._by_ptr.get(ptr) == key:
                del self._by_ptr[ptr]
            self.current_bytes -= nbytes
            if self._record:
                self.timeline.append(("free", self.current_bytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Storages the op received: an output that shares one of them (a view, in-place or out=
        # op) allocated nothing new.
        inputs = {s.data_ptr() for s in map(_storage, tree_flatten((args, kwargs))[0])
                  if s is not None}
        op = str(func)
        for s in map(_storage, tree_flatten(out)[0]):
            # Empty storages (nbytes 0) cost nothing and all share data_ptr 0: skip them.
            if s is not None and s.nbytes() and s.data_ptr() not in inputs:
                self._register(s, op)
        return out


def _storage(t):
    """The untyped storage of a plain tensor; None for non-tensors, meta tensors and tensor
    subclasses without a storage of their own (e.g. DTensor: its local shards are allocated
    beneath this mode and are not seen -- use FSDP's own memory tracker there)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def track_memory(timeline: bool = False) -> MemoryTracker:
    """Context manager that counts live tensor bytes created inside it (see the module docstring).

    ``timeline=True`` also records ``(event, current_bytes)`` after every allocation and free,
    for plotting memory over a training step. Example::

        with track_memory() as mem:
            model(x).sum().backward()
        print(mem.peak_bytes)

    Works on CPU and GPU tensors alike; on a GPU it complements ``torch.cuda.max_memory_allocated``
    (same storages, no allocator rounding).
    """
    return MemoryTracker(timeline=timeline)
