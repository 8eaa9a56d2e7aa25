"""Make APIs unusable, and record point-to-point traffic, while a grading check runs.

A check cell must not pass when the learner calls ``course_lib``'s reference or a production API that
does the exercise's job. :class:`forbid` disables such APIs for the duration of a ``with`` block (in the
kernel, or inside a worker function on the ranks) and restores everything afterwards::

    from course_lib.grading.guards import forbid, record_p2p, TORCH_COLLECTIVES

    no_shortcuts = forbid(*TORCH_COLLECTIVES, "course_lib.collectives",
                          why="write it with isend/irecv")
    with no_shortcuts, record_p2p() as traffic:      # on a rank
        learner_ring_all_reduce(t, group)
    traffic.messages                                  # [Message(kind, peer, nbytes, group_rank, group_size)]

Targets, and why aliases cannot get round them:

* ``"ns::op"`` (or ``"ns::*"``): a dispatcher operator, e.g. ``"c10d::allreduce_"``. Every Python path to
  it (``dist.all_reduce``, ``torch.distributed.distributed_c10d.all_reduce``, ``import torch.distributed
  as d; d.all_reduce``, ``ProcessGroup.allreduce``, functional collectives, DTensor) ends in the operator,
  which a ``TorchDispatchMode`` intercepts. This is how torch collectives are forbidden.
* a Python function (or its dotted name): its ``__code__`` is swapped for one that raises, so every
  reference to the function object (an alias imported before the check, a bound method) raises too.
  Functions it wraps (``__wrapped__``) are forbidden as well.
* a class: every Python function in its ``__dict__`` (and in its bases from the same module).
* a module (by dotted name): every function and class defined in it or in its loaded submodules.
* anything else reachable by a dotted name (a C builtin): the attribute is replaced on its owner. An
  alias taken before the check still works, so also forbid its operator (``"aten::..."``) where it has one.

A forbidden call raises :class:`ForbiddenAPIError` (an ``AssertionError``, so the grader scores it as a
failed check) naming the API and saying ``why``. Intercepting operators runs every torch operation in
the block through Python: fine for the small tensors of a check.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ForbiddenAPIError", "forbid", "record_p2p", "Message", "TORCH_COLLECTIVES", "P2P_OPS"]

#: Every torch collective, as dispatcher operators (point-to-point ``send``/``recv`` and ``barrier`` stay
#: allowed). Covers ``torch.distributed.*`` under any name, ``ProcessGroup`` methods, functional
#: collectives and DTensor redistribution.
TORCH_COLLECTIVES = (
    "c10d::allreduce_", "c10d::allreduce_coalesced_", "c10d::allgather_", "c10d::_allgather_base_",
    "c10d::allgather_coalesced_", "c10d::allgather_into_tensor_coalesced_", "c10d::reduce_scatter_",
    "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_", "c10d::broadcast_",
    "c10d::reduce_", "c10d::gather_", "c10d::scatter_", "c10d::alltoall_", "c10d::alltoall_base_",
    "_c10d_functional::*", "c10d_functional::*", "_dtensor::*",
)
#: The point-to-point operators :class:`record_p2p` records.
P2P_OPS = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")


class ForbiddenAPIError(AssertionError):
    """A forbidden API was called while a :class:`forbid` block was active."""


# ----------------------------------------------------------------------------- operator interception

_op_rules: list[tuple[tuple[str, ...], Callable[[str, tuple, dict], None]]] = []  # active, innermost last
_mode = None  # the one TorchDispatchMode while any rule is active
_mode_users = 0


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def _push_rule(patterns: tuple[str, ...], callback) -> None:
    global _mode, _mode_users
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._schema.name
            for pats, cb in reversed(_op_rules):
                if _matches(name, pats):
                    cb(name, args, kwargs)
            return func(*args, **kwargs)

    _op_rules.append((patterns, callback))
    if _mode is None:
        _mode = _Guard()
        _mode.__enter__()
    _mode_users += 1


def _pop_rule(callback) -> None:
    global _mode, _mode_users
    for i in range(len(_op_rules) - 1, -1, -1):
        if _op_rules[i][1] is callback:
            del _op_rules[i]
            break
    _mode_users -= 1
    if _mode_users == 0 and _mode is not None:
        mode, _mode = _mode, None
        mode.__exit__(None, None, None)


# ----------------------------------------------------------------------------- Python-level targets

_forbidden_by_token: dict[int, tuple[str, str]] = {}
_next_token = [0]


def _raise_forbidden(token: int):
    name, why = _forbidden_by_token.get(token, ("this API", ""))
    raise ForbiddenAPIError(f"{name} is disabled during this check: {why}")


def _stand_in_code(fn: types.FunctionType, token: int) -> types.CodeType:
    """Code that raises ForbiddenAPIError, with as many free variables as ``fn`` (so it can be swapped in)."""
    names = [f"_free{i}" for i in range(len(fn.__code__.co_freevars))]
    lines = ["def _outer():"] + [f"    {n} = None" for n in names]
    lines.append("    def _forbidden(*args, **kwargs):")
    if names:
        lines.append(f"        ({', '.join(names)},)")
    lines.append("        __import__('course_lib.grading.guards', fromlist=['_raise_forbidden'])"
                 f"._raise_forbidden({token})")
    lines.append("    return _forbidden")
    ns: dict[str, Any] = {}
    exec("\n".join(lines), ns)  # noqa: S102 - generated from integers only
    return ns["_outer"]().__code__.replace(co_name=fn.__code__.co_name)


def _functions_of_class(cls: type) -> list[types.FunctionType]:
    out = []
    for klass in cls.__mro__:
        if klass is not cls and klass.__module__ != cls.__module__:
            continue
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                out += [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
            elif isinstance(value, types.FunctionType):
                out.append(value)
    # Only the class's own functions: a class attribute can be a function shared by every class of
    # its kind (Python 3.13 makes ``dataclasses._replace`` every dataclass's ``__replace__``), and
    # disabling it would break ``dataclasses.replace`` everywhere.
    return [f for f in out if f.__module__ == cls.__module__]


def _resolve(name: str) -> tuple[Any, Any, str]:
    """``(owner, object, attribute)`` for a dotted name: the longest importable module prefix, then getattr."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        owner, attr = None, ""
        for part in parts[i:]:
            if not hasattr(obj, part):
                raise ValueError(f"forbid: {name!r} does not exist ({'.'.join(parts[:i])} has no {part!r})")
            owner, attr, obj = obj, part, getattr(obj, part)
        return owner, obj, attr
    raise ValueError(f"forbid: {name!r} is not importable")


def _module_members(mod: types.ModuleType) -> list[Any]:
    mods = [m for key, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType) and (key == mod.__name__ or key.startswith(mod.__name__ + "."))]
    out = []
    for m in mods:
        for value in list(vars(m).values()):
            if (isinstance(value, (types.FunctionType, type))
                    and getattr(value, "__module__", None) == m.__name__):
                out.append(value)
    return out


class forbid:
    """A reusable context manager: while active, calling any of ``targets`` raises ForbiddenAPIError.

    Args:
        *targets: operator names (``"c10d::allreduce_"``, ``"aten::..."``, ``"ns::*"``), dotted names of
            modules, classes, functions or attributes (``"course_lib.collectives"``,
            ``"course_lib.data_parallel.average_gradients"``), or the objects themselves.
        why: what the learner should do instead, e.g. ``"write it with isend/irecv"``; it ends the
            error message.

    Everything is restored on exit, also when the block raises. Different guards may nest (exit in reverse
    order); re-entering the same guard (a guarded function calling another) is a no-op.
    ``guard.wrap(fn)`` returns a function that calls ``fn`` inside the guard.
    """

    def __init__(self, *targets: Any, why: str):
        if not targets:
            raise ValueError("forbid: name at least one target")
        if not isinstance(why, str) or not why.strip():
            raise ValueError("forbid: say why (what the learner should do instead), e.g. why='write it with isend/irecv'")
        self.targets, self.why = targets, why
        self._undo: list[Callable[[], None]] | None = None
        self._depth = 0

    def _ops(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if isinstance(t, str) and "::" in t)

    def __enter__(self) -> "forbid":
        self._depth += 1
        if self._depth > 1:  # re-entered (a guarded function calling another): already installed
            return self
        undo: list[Callable[[], None]] = []
        try:
            for target in self.targets:
                if isinstance(target, str) and "::" in target:
                    continue
                self._install(target, undo)
            if self._ops():
                def refuse(name, args, kwargs):
                    raise ForbiddenAPIError(f"torch operator {name} (whatever Python name calls it) is "
                                            f"disabled during this check: {self.why}")
                _push_rule(self._ops(), refuse)
                undo.append(lambda: _pop_rule(refuse))
        except BaseException:
            self._depth -= 1
            for u in reversed(undo):
                u()
            raise
        self._undo = undo
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        undo, self._undo = self._undo or [], None
        for u in reversed(undo):
            u()

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` called inside this guard (for a check that calls the learner's function many times)."""
        def guarded(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        guarded.__name__ = getattr(fn, "__name__", "guarded")
        guarded.__doc__ = getattr(fn, "__doc__", None)
        return guarded

    # -- installing one target
    def _install(self, target: Any, undo: list) -> None:
        owner, attr = None, ""
        label = target if isinstance(target, str) else None
        if isinstance(target, str):
            owner, target, attr = _resolve(target)
        label = label or getattr(target, "__qualname__", None) or repr(target)
        if isinstance(target, types.ModuleType):
            for member in _module_members(target):
                self._install_object(member, f"{target.__name__}.{member.__qualname__}", undo)
        elif isinstance(target, (types.FunctionType, type, types.MethodType)):
            self._install_object(target, label, undo)
        elif owner is not None and callable(target):  # a C builtin: replace it where it is looked up
            def refuse(*args, **kwargs):
                raise ForbiddenAPIError(f"{label} is disabled during this check: {self.why}")
            setattr(owner, attr, refuse)
            undo.append(lambda: setattr(owner, attr, target))
        else:
            raise ValueError(f"forbid: cannot disable {label!r} (a {type(target).__name__}); name a function, "
                             "class, module or operator ('ns::op')")

    def _install_object(self, obj: Any, label: str, undo: list) -> None:
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        if isinstance(obj, type):
            for fn in _functions_of_class(obj):
                self._swap(fn, f"{label}.{fn.__name__}", undo)
            return
        seen = set()
        while isinstance(obj, types.FunctionType) and id(obj) not in seen:
            seen.add(id(obj))
            self._swap(obj, label, undo)
            obj = getattr(obj, "__wrapped__", None)

    def _swap(self, fn: types.FunctionType, label: str, undo: list) -> None:
        token = _next_token[0]
        _next_token[0] += 1
        _forbidden_by_token[token] = (label, self.why)
        original = fn.__code__
        fn.__code__ = _stand_in_code(fn, token)

        def restore():
            fn.__code__ = original
            _forbidden_by_token.pop(token, None)
        undo.append(restore)


# ----------------------------------------------------------------------------- recording traffic

@dataclass(frozen=True)
class Message:
    """One point-to-point operation seen on this rank.

    ``kind`` is ``"send"`` or ``"recv"``; ``peer`` the other rank **in the group** (None for a receive from
    any source); ``nbytes`` the payload; ``group_rank`` / ``group_size`` this rank's rank in the group used
    and that group's size.
    """
    kind: str
    peer: int | None
    nbytes: int
    group_rank: int
    group_size: int


class record_p2p:
    """A context manager that records every point-to-point send/receive issued on this rank.

    It sees them whatever API issued them (``dist.send``/``isend``/``batch_isend_irecv``, ``ProcessGroup``
    methods), because it intercepts the ``c10d::send``/``c10d::recv_`` operators. ``messages`` is the list of
    :class:`Message` in issue order; ``sent_bytes`` / ``received_bytes`` sum them.
    """

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._cb = None

    def __enter__(self) -> "record_p2p":
        from torch._C._distributed_c10d import ProcessGroup

        def note(name, args, kwargs):
            tensors, pg = args[0], ProcessGroup.unbox(args[1])
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            kind = "send" if name == "c10d::send" else "recv"
            peer = None if name == "c10d::recv_any_source_" else int(args[2])
            self.messages.append(Message(kind, peer, nbytes, pg.rank(), pg.size()))
        self._cb = note
        _push_rule(P2P_OPS, note)
        return self

    def __exit__(self, *exc) -> None:
        if self._cb is not None:
            _pop_rule(self._cb)
            self._cb = None

    @property
    def sent_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages if m.kind == "send")

    @property
    def received_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages if m.kind == "recv")

    def peers(self, kind: str) -> set:
        return {m.peer for m in self.messages if m.kind == kind}
