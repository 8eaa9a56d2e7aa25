"""course_lib.memory: live tensor bytes counted exactly, on CPU."""

import gc

import pytest
import torch

from course_lib.memory import MemoryTracker, tensor_bytes, track_memory


def test_known_allocation_exact_bytes():
    with track_memory() as mem:
        a = torch.empty(1000)                  # 4000 bytes
        b = torch.zeros(10, 10, dtype=torch.float64)   # 800 bytes
        assert mem.current_bytes == 4800
    assert mem.peak_bytes == 4800
    assert mem.current_bytes == 4800           # still alive after the block
    del a, b
    assert mem.current_bytes == 0
    assert mem.peak_bytes == 4800


def test_freed_tensors_leave_the_count_and_peak_stays():
    x = torch.randn(256)
    with track_memory() as mem:
        y = x * 2                               # 1 KiB
        z = y + 1                               # 1 KiB
        assert mem.current_bytes == 2048
        del y
        assert mem.current_bytes == 1024
        w = z * 3
        assert mem.current_bytes == 2048
    assert mem.peak_bytes == 2048
    del z, w
    assert mem.current_bytes == 0


def test_views_inplace_and_preexisting_tensors_are_not_counted():
    x = torch.randn(100, 10)                    # created outside: not counted
    with track_memory() as mem:
        v = x[10:].t()                          # a view: no new storage
        x.mul_(2)                               # in place
        torch.add(x, 1, out=x)                  # out= into an existing storage
        y = x.clone()                           # 4000 bytes, new
        yv = y.view(-1)                         # view of a tracked storage: counted once
        assert mem.current_bytes == 4000
    del y
    assert mem.current_bytes == 4000            # yv keeps the storage alive
    del yv, v
    assert mem.current_bytes == 0


def test_saved_for_backward_counted_while_alive():
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with track_memory() as mem:
        h = torch.tanh(x @ w)                   # matmul output 8 KiB; tanh output 8 KiB, saved
        loss = h.sum()
        del h
        # tanh saves its output for the backward; the mm output was freed (tanh does not need it)
        assert mem.current_bytes == 32 * 64 * 4 + loss.untyped_storage().nbytes()
        loss.backward()
    # after the backward the graph (and its saved output) is gone; w.grad was made inside
    del loss
    gc.collect()
    assert mem.current_bytes == w.grad.untyped_storage().nbytes() == 64 * 64 * 4
    assert mem.peak_bytes >= 2 * 32 * 64 * 4


def test_backward_ops_are_seen_and_timeline_records_events():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    with track_memory(timeline=True) as mem:
        out = lin(x).relu().sum()
        mem.mark("backward")
        out.backward()
    events = [e for e, _ in mem.timeline]
    i = events.index("mark:backward")
    assert any(e.startswith("aten.addmm") for e in events[:i])
    assert any(e.startswith("aten.") for e in events[i + 1:]), "backward ops not seen"
    assert "free" in events
    assert max(b for _, b in mem.timeline) == mem.peak_bytes
    by_op = mem.live_by_op()
    assert sum(by_op.values()) == mem.current_bytes


def test_reset_peak_and_no_timeline_by_default():
    with track_memory() as mem:
        a = torch.empty(100)
        del a
        mem.reset_peak()
        assert mem.peak_bytes == 0
        b = torch.empty(10)
    assert mem.peak_bytes == 40 and mem.timeline == []
    del b


def test_tensor_bytes_counts_each_storage_once():
    a = torch.empty(10)
    assert tensor_bytes(a, a[2:], a.view(2, 5)) == 40
    assert tensor_bytes(a, torch.empty(3, dtype=torch.int8)) == 43
    with pytest.raises(TypeError, match="expects tensors"):
        tensor_bytes(a, [1, 2])


def test_tracker_is_a_dispatch_mode():
    assert isinstance(track_memory(), MemoryTracker)
