"""Device mistakes, caught on a machine without a GPU.

Every from-scratch technique in ``course_lib`` must run on CUDA tensors under NCCL as written, and no
GPU runs these tests. Two kinds of check stand in:

* static (:func:`factory_calls`, with the ``ast`` module): every tensor factory call in ``course_lib``
  (``torch.empty``, ``zeros``, ``arange``, ``tensor``, ``randn``, ...; not the ``*_like`` ones, which
  follow their argument) names its device, and not the CPU literally, except in the few places
  ``ALLOWED`` lists, each with its reason. A buffer made without ``device=`` lands on the CPU (or the
  default device) whatever the tensors it serves, which is how the ring's receive buffers broke
  under NCCL. A test feeds the checker such a line to show that it is caught.
* behavioural: the collectives run on ``"meta"`` tensors (shapes, no data) in this process, against a
  stand-in process group whose wire checks the device of every message instead of sending it; and
  the pipeline runner and the collectives run on real gloo ranks whose *default* device is
  ``"meta"``, so that a factory call without ``device=`` would make a tensor gloo cannot send.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import course_lib
from course_lib import collectives as C
from course_lib.launch import Cluster

ROOT = Path(course_lib.__file__).parent
_GROUP = C._Group          # the real class (the meta test replaces C._Group by a stand-in factory)

# What makes a new tensor without taking the device from another tensor.
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "range", "tensor", "as_tensor", "randn", "rand",
             "randint", "randperm", "normal", "empty_strided", "eye", "linspace", "logspace",
             "scalar_tensor", "tril_indices", "triu_indices", "sparse_coo_tensor"}

# (file under course_lib, function) -> why its factory calls may name no device, or the CPU.
ALLOWED = {
    ("context_parallel.py", "sequence_positions"):
        "positions of a sequence layout (integers, no tensor served); callers move them to their tensors' device",
    ("checkpoint.py", "ResumableSampler._epoch_order"):
        "sample indices drawn by a seeded CPU generator: the same order on every machine; they index "
        "data on any device",
    ("models.py", "make_regression"):
        "drawn by a seeded CPU generator on the CPU (the same values on every device), then moved",
    ("models.py", "make_tokens"):
        "drawn by a seeded CPU generator on the CPU (the same tokens on every device), then moved",
    ("models.py", "SleepLayer.__init__"):
        "a module's parameter, made where nn.Linear makes its weights (the default device)",
    ("param_server.py", "_worker"):
        "mini-batch indices drawn by a seeded CPU generator; they index the data on any device",
    ("precision.py", "bits_of"): "the bits of a Python float: a scalar computation, no tensor served",
    ("precision.py", "ulp"): "the gap after a Python float: a scalar computation, no tensor served",
    ("precision.py", "_f32"): "rounds a Python float to float32: a scalar computation",
    ("tensor_parallel.py", "_rows_of"): "row indices on the CPU; they index a weight on any device",
    ("zero.py", "ZeRO._adam_state"): "Adam's step count, which torch.optim.Adam keeps on the CPU",
    ("zero.py", "ZeRO.load_sharded_state_dict"): "Adam's step count, which torch.optim.Adam keeps on the CPU",
}


def _names_the_cpu(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device"
            and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(":")[0] == "cpu")


def factory_calls(source: str) -> list[tuple[int, str, str, str]]:
    """``(line, function, factory, what)`` for every ``torch.<factory>(...)`` call in ``source`` that has
    no ``device=`` (``what = "no device="``) or names the CPU (``"device=cpu"``). ``function`` is the
    qualified name of the enclosing function (``Class.method``; ``<module>`` at the top level). A call
    with ``**kwargs`` is taken to pass its device through them."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in FACTORIES):
                kw = {k.arg: k.value for k in child.keywords}
                what = None
                if "device" in kw:
                    what = "device=cpu" if _names_the_cpu(kw["device"]) else None
                elif None not in kw:
                    what = "no device="
                if what:
                    found.append((child.lineno, ".".join(scope) or "<module>", child.func.attr, what))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def test_the_checker_finds_a_buffer_without_its_device():
    src = ("import torch\n"
           "def _scratch(numel, dtype):\n"
           "    return torch.empty(numel, dtype=dtype)\n"                     # the ring's old receive buffer
           "class Ring:\n"
           "    def step(self, x):\n"
           "        a = torch.zeros(3, device='cpu')\n"
           "        b = torch.zeros(3, device=torch.device('cpu'))\n"
           "        c = torch.zeros_like(x)\n"                                  # follows x: fine
           "        return torch.empty(4, dtype=x.dtype, device=x.device), torch.ones(2, **kw)\n")
    assert factory_calls(src) == [(3, "_scratch", "empty", "no device="), (6, "Ring.step", "zeros", "device=cpu"),
                                  (7, "Ring.step", "zeros", "device=cpu")]


def test_every_tensor_factory_in_course_lib_names_its_device():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, function, factory, what in factory_calls(path.read_text()):
            found.setdefault((name, function), []).append(f"course_lib/{name}:{line} torch.{factory} ({what})")
    unexplained = [place for key, places in found.items() if key not in ALLOWED for place in places]
    assert not unexplained, (
        "tensor factory calls without device= (or with the CPU named): allocate on the device of the "
        "tensors they serve (device=x.device), or add the function to ALLOWED with the reason:\n"
        + "\n".join(unexplained))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED names functions that no longer need it; remove them: {stale}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


# ------------------------------------------------------------------ the collectives on "meta" tensors
class _Wire:
    """A transport with ``isend``/``irecv`` that checks each message's device and delivers nothing."""

    def __init__(self, device: torch.device):
        self.device, self.messages = torch.device(device), 0

    def _check(self, t: torch.Tensor):
        assert t.device == self.device, f"a message on {t.device}, the caller's tensors are on {self.device}"
        self.messages += 1
        return _Done()

    def isend(self, tensor, dst, group=None, tag=0):
        return self._check(tensor)

    def irecv(self, tensor, src, group=None, tag=0):
        return self._check(tensor)


class _Done:
    def wait(self, timeout=None):
        return True


def _fake_group(rank: int, size: int, wire: _Wire, paired: bool = False) -> C._Group:
    """A ``collectives._Group`` for rank ``rank`` of ``size`` without torch.distributed, on ``wire``
    (``paired``: the code path NCCL takes)."""
    g = object.__new__(_GROUP)
    g.group, g.transport, g.rank, g.size, g.backend = None, wire, rank, size, "gloo"
    g.paired = paired
    g.global_ranks = list(range(size))
    return g


@pytest.mark.parametrize("paired", [False, True], ids=["gloo", "nccl-path"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_collectives_allocate_their_buffers_on_the_tensors_device(monkeypatch, size, paired):
    """On meta tensors every buffer the collectives send or receive must be a meta tensor; one made on
    the CPU (as the ring's receive buffers were) fails the wire's check or mixes devices in an exchange."""
    meta = torch.device("meta")
    monkeypatch.setattr(C.dist, "get_world_size", lambda group=None: size)   # for all_to_all_single
    C.free_scratch()
    for rank in range(size):
        wire = _Wire(meta)
        monkeypatch.setattr(C, "_Group", lambda group, transport=None: _fake_group(rank, size, wire, paired))
        x = torch.empty(10, device=meta)
        C.ring_all_reduce(x, "avg")
        C.ring_all_reduce(x, pipeline_bytes=8)
        C.plain_ring_all_reduce(x)
        C.naive_all_reduce(x, "avg", root=size - 1)
        C.ring_reduce_scatter(torch.empty(3, device=meta), torch.empty(3 * size, device=meta))
        C.ring_reduce_scatter(torch.empty(2, device=meta), [torch.empty(2, device=meta)] * size)
        C.ring_all_gather(torch.empty(3 * size, device=meta), torch.empty(3, device=meta))
        C.ring_all_gather([torch.empty(2, device=meta) for _ in range(size)], torch.empty(2, device=meta))
        C.all_to_all([torch.empty(2, device=meta) for _ in range(size)], [torch.empty(2, device=meta)] * size)
        C.all_reduce(x, "avg")
        C.all_gather_single(torch.empty(2 * size, device=meta), torch.empty(2, device=meta))
        C.reduce_scatter_single(torch.empty(2, device=meta), torch.empty(2 * size, device=meta))
        C.all_to_all_single(torch.empty(size, 3, device=meta), torch.empty(size, 3, device=meta))
        assert wire.messages > 0
    C.free_scratch()


def test_an_exchange_refuses_mixed_devices_and_cpu_tensors_under_nccl():
    wire = _Wire(torch.device("cpu"))
    g = _fake_group(0, 2, wire)
    with pytest.raises(ValueError, match=r"one exchange holds tensors on \['cpu', 'meta'\]"):
        g.exchange([(torch.ones(2), 1)], [(torch.empty(2, device="meta"), 1)])
    g.backend = "nccl"
    with pytest.raises(ValueError, match="NCCL sends CUDA tensors only, got a tensor on cpu"):
        g.exchange([(torch.ones(2), 1)], [])


# ------------------------------------------------------------------ real ranks, "meta" by default
class CheckingTransport:
    """torch.distributed's point-to-point, batched or not, after checking each message's device."""

    def __init__(self, device):
        self.device, self.messages = torch.device(device), 0

    def _check(self, t):
        if t.device != self.device:
            raise AssertionError(f"a message on {t.device}; the tensors it serves are on {self.device}")
        self.messages += 1

    def batch_isend_irecv(self, ops):
        import torch.distributed as dist
        for op in ops:
            self._check(op.tensor)
        return dist.batch_isend_irecv(ops)

    def isend(self, tensor, dst, group=None, tag=0):
        import torch.distributed as dist
        self._check(tensor)
        return dist.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src, group=None, tag=0):
        import torch.distributed as dist
        self._check(tensor)
        return dist.irecv(tensor, src, group=group, tag=tag)


class PairedCheckingTransport(CheckingTransport):
    """The same, asking for NCCL's paired exchanges (as :class:`course_lib.collectives.PairedP2P`)."""

    paired = True


class IsendOnlyTransport(CheckingTransport):
    """The same without ``batch_isend_irecv``, as :class:`course_lib.netem.PacedTransport`."""

    batch_isend_irecv = None


def _default_device_meta_case(rank, world_size, paired):
    """The runner (interleaved: messages both ways between the same ranks) and the collectives on CPU
    tensors while torch's default device is "meta": a factory call without device= makes a meta tensor."""
    import torch
    import torch.nn as nn
    from course_lib import collectives as C
    from course_lib import pipeline as P

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 * world_size)])
    stages = P.build_stages(model, P.partition(model, 2 * world_size), [rank, rank + world_size])
    x = torch.randn(8, 4)
    wire = (PairedCheckingTransport if paired else CheckingTransport)("cpu")
    plain = IsendOnlyTransport("cpu")
    C.free_scratch()
    torch.set_default_device("meta")
    try:
        out = P.run_schedule(P.interleaved_1f1b_schedule(world_size, 4, 2), stages, P.split_microbatches(x, 4),
                             P.split_microbatches(x, 4), nn.functional.mse_loss, transport=wire)
        t = torch.full((7,), float(rank + 1), device="cpu")
        C.ring_all_reduce(t, pipeline_bytes=8, transport=wire)
        C.naive_all_reduce(t, transport=plain)
        C.ring_all_gather([torch.empty(2, device="cpu") for _ in range(world_size)],
                          torch.full((2,), float(rank), device="cpu"), transport=wire)
    finally:
        torch.set_default_device(None)
        C.free_scratch()
    grads = [q.grad is not None and q.grad.device.type == "cpu" for q in stages[rank].parameters()]
    return {"messages": wire.messages + plain.messages, "sum": t.tolist(), "grads": all(grads),
            "loss": out["loss"]}


@pytest.mark.slow
@pytest.mark.parametrize("paired", [False, True], ids=["gloo", "nccl-path"])
def test_runner_and_collectives_never_use_the_default_device(paired):
    with Cluster(2, timeout=60) as c:
        res = c.run(_default_device_meta_case, paired)
    for r in res:
        assert r["messages"] > 0 and r["grads"]
        assert r["sum"] == [6.0] * 7          # (1 + 2), ring-reduced, then naive-reduced over 2 ranks
    assert res[1]["loss"] is not None and res[1]["loss"] > 0
