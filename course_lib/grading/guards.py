"""Make APIs unusable, and record the communication a rank issues, while a grading check runs.

A check cell must not pass when the learner calls ``course_lib``'s reference or a production API that
does the exercise's job. :class:`forbid` disables such APIs for the duration of a ``with`` block (in the
kernel, or inside a worker function on the ranks) and restores everything afterwards;
:class:`record_comm` records every collective and point-to-point call with its bytes, so a check can
compare what a rank sent with the formula the notebook teaches::

    from course_lib.grading.guards import forbid, record_comm, TORCH_COLLECTIVES

    no_shortcuts = forbid(*TORCH_COLLECTIVES, "course_lib.collectives",
                          why="write it with isend/irecv")
    with no_shortcuts, record_comm() as comm:         # on a rank
        learner_ring_all_reduce(t, group)
    comm.calls        # [Comm(op, group_ranks, group_rank, group_size, nbytes, peer)], e.g. Comm("send", (2, 3), 0, 2, 64, 1)
    comm.sent_bytes   # bytes this rank sent point-to-point

Targets of :class:`forbid`, and why aliases and copies cannot get round them:

* ``"ns::op"`` (or ``"ns::*"``): a dispatcher operator, e.g. ``"c10d::allreduce_"``. Every Python path to
  it (``dist.all_reduce``, ``torch.distributed.distributed_c10d.all_reduce``, ``import torch.distributed
  as d; d.all_reduce``, ``ProcessGroup.allreduce``, functional collectives, DTensor) ends in the operator,
  which a ``TorchDispatchMode`` intercepts. This is how torch collectives are forbidden.
* a module, class or function (by dotted name, or the object): blocked by **what runs**. While the block
  is active a trace function (``sys.settrace``, also in threads started inside the block; in every thread
  on Python >= 3.12) looks at every Python function that starts executing and raises when its code is the
  target's: for a module, any
  function whose code comes from the module's source file (a package: any file under its folder); for a
  class, its methods (and those of its bases from the same module); for a function, that function (the
  one it wraps, ``__wrapped__``, rather than a generic decorator's wrapper) and the functions defined
  inside it. It does not matter which object or copy the code came from: an alias imported before the
  check, a bound method, the module after ``importlib.reload``, a second copy loaded from the same file,
  or from a copy of the file elsewhere (code identical to a forbidden function's, same qualified name,
  is refused too). Loading such a copy is allowed; calling into it is not.
* anything else reachable by a dotted name (a C builtin): the attribute is replaced on its owner. An
  alias taken before the check still works, so also forbid its operator (``"aten::..."``) where it has one.

A forbidden call raises :class:`ForbiddenAPIError` (an ``AssertionError``, so the grader scores it as a
failed check) naming the API and saying ``why``. Catching it does not help: leaving the block raises it
again, as does leaving it after the hook was removed (``sys.settrace(None)``). Intercepting operators
runs every torch operation in the block through Python, and the trace function adds about a microsecond
to every Python call (a TinyMLP Adam step takes about 3x as long inside the block): fine for the small
work of a check, so keep the block around the learner's call only.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ForbiddenAPIError", "forbid", "record_comm", "Comm", "record_p2p", "Message",
           "TORCH_COLLECTIVES", "P2P_OPS", "COMM_OPS"]

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
#: The point-to-point operators (:class:`record_p2p` records these).
P2P_OPS = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")
#: Everything :class:`record_comm` records: every ``c10d`` operator and every functional collective.
COMM_OPS = ("c10d::*", "_c10d_functional::*", "c10d_functional::*")
_NOT_COMM = ("c10d::check_for_nan", "_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")


class ForbiddenAPIError(AssertionError):
    """A forbidden API was called while a :class:`forbid` block was active."""


# ----------------------------------------------------------------------------- operator interception

_op_rules: list[tuple[tuple[str, ...], Callable[[Any, tuple, dict], None]]] = []  # active, innermost last
_mode = None  # the one TorchDispatchMode while any rule is active
_mode_users = 0


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


def _push_rule(patterns: tuple[str, ...], callback) -> None:
    """Call ``callback(op, args, kwargs)`` for every dispatcher operator matching ``patterns``."""
    global _mode, _mode_users
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._schema.name
            for pats, cb in reversed(_op_rules):
                if _matches(name, pats):
                    cb(func, args, kwargs)
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


# ----------------------------------------------------------------------------- blocking what runs

_CO_OPTIMIZED = 0x0001  # set on functions, lambdas, comprehensions; not on module or class bodies


@dataclass
class _CodeRules:
    """What one active guard refuses: whole files, (file, qualname) pairs, and code fingerprints."""
    guard: "forbid"
    tripped_at_start: int
    files: dict[str, str]                      # real path -> label (every function in the file)
    folders: list[tuple[str, str]]             # (real folder path + os.sep, label): a package
    names: dict[tuple[str, str], str]          # (real path, qualname or qualname prefix ending in '.') -> label
    prints: dict[tuple, str]                   # _fingerprint(code) -> label


_active: list[_CodeRules] = []                 # innermost last
_verdicts: dict[int, tuple[types.CodeType, Any]] = {}
_realpaths: dict[str, str] = {}
_hook_state: dict[str, Any] = {}               # while installed: "thread", "all_threads"
_chained: list = [None]                        # a trace function that was active before (a debugger's)
_tripped = [0]                                 # forbidden calls refused so far (CPython then drops the hook)
_SELF = os.path.realpath(__file__)             # the guards' own code always runs (forbid("course_lib") too)


def _real(path: str) -> str:
    real = _realpaths.get(path)
    if real is None:
        real = _realpaths[path] = os.path.realpath(path) if path and not path.startswith("<") else path
    return real


def _fingerprint(code: types.CodeType) -> tuple:
    # The line number too: a copy of the file keeps it, while a notebook's own function that happens to
    # compile to the same bytecode (a one-line helper, a list comprehension) does not share it.
    return (code.co_qualname, code.co_firstlineno, code.co_code, code.co_names, code.co_varnames)


def _judge(code: types.CodeType):
    """``(rules, label)`` of the innermost guard refusing ``code``, or None."""
    if not code.co_flags & _CO_OPTIMIZED:
        return None
    path, qual = _real(code.co_filename), code.co_qualname
    if path == _SELF:
        return None
    for rules in reversed(_active):
        label = rules.files.get(path)
        if label is None:
            label = next((lab for folder, lab in rules.folders if path.startswith(folder)), None)
        if label is None:
            label = rules.names.get((path, qual))
            if label is None and rules.names:
                # a method of a forbidden class, or a function defined inside a forbidden function
                parts = qual.split(".")
                for i in range(len(parts) - 1, 0, -1):
                    label = rules.names.get((path, ".".join(parts[:i]) + "."))
                    if label is not None:
                        break
        if label is None and rules.prints:
            label = rules.prints.get(_fingerprint(code))
        if label is not None:
            return rules, label
    return None


def _trace(frame, event, arg):
    """The global trace function while a guard is active: called once per Python frame that starts."""
    local = _chained[0](frame, event, arg) if _chained[0] is not None else None
    if event != "call":
        return local
    code = frame.f_code
    verdict = _verdicts.get(id(code))
    if verdict is None or verdict[0] is not code:
        verdict = _verdicts[id(code)] = (code, _judge(code))
    if verdict[1] is None:
        return local
    back = frame.f_back
    if (back is not None and not back.f_code.co_flags & _CO_OPTIMIZED
            and back.f_code.co_filename == code.co_filename):
        return local  # the module's own body defining itself (a decorator applied while it loads)
    rules, label = verdict[1]
    rules.guard._violations.append(label)
    _tripped[0] += 1
    called = "" if label.endswith(code.co_qualname) else f" ({code.co_qualname} was called)"
    raise ForbiddenAPIError(f"{label} is disabled during this check{called}, whatever name or copy of it "
                            f"is used: {rules.guard.why}")


def _install_hook() -> None:
    # A trace function (not a profile function): it runs once per Python frame, not per C call.
    previous = sys.gettrace()
    _chained[0] = previous
    _hook_state.update(thread=getattr(threading, "_trace_hook", None),
                       all_threads=previous is None and hasattr(threading, "settrace_all_threads"))
    if _hook_state["all_threads"]:          # Python >= 3.12: also the threads already running
        threading.settrace_all_threads(_trace)
    else:
        sys.settrace(_trace)
        threading.settrace(_trace)          # threads started inside the block


def _remove_hook() -> bool:
    """Uninstall; True when the hook was still in place in this thread."""
    intact = sys.gettrace() is _trace
    if _hook_state.get("all_threads"):
        threading.settrace_all_threads(None)
    else:
        sys.settrace(_chained[0])
    threading.settrace(_hook_state.get("thread"))
    _hook_state.clear()
    _chained[0] = None
    return intact


def _activate(rules: _CodeRules) -> None:
    if not _active:
        _install_hook()
    _active.append(rules)
    _verdicts.clear()


def _deactivate(rules: _CodeRules) -> bool:
    """Remove ``rules``; True when the hook had been removed behind the guard's back."""
    _active.remove(rules)
    _verdicts.clear()
    missing = sys.gettrace() is not _trace
    if not _active:
        missing = not _remove_hook()
    elif missing:
        sys.settrace(_trace)   # an inner guard's refusal dropped it (CPython does so when a hook raises)
    return missing and _tripped[0] == rules.tripped_at_start


def _codes_within(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes_within(const)


def _innermost(fn: types.FunctionType) -> types.FunctionType:
    """The function a decorator chain wraps (``functools.wraps``'s ``__wrapped__``); ``fn`` if none."""
    seen = {id(fn)}
    while isinstance(getattr(fn, "__wrapped__", None), types.FunctionType) and id(fn.__wrapped__) not in seen:
        fn = fn.__wrapped__
        seen.add(id(fn))
    return fn


def _class_methods(cls: type) -> list[types.FunctionType]:
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
                out.append(_innermost(value))
    # Only the class's own functions: a class attribute can be a function shared by every class of
    # its kind (Python 3.13 makes ``dataclasses._replace`` every dataclass's ``__replace__``).
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


def _module_functions(mod: types.ModuleType) -> list[types.FunctionType]:
    """Functions and methods defined in ``mod`` or its loaded submodules (for the copy fingerprints)."""
    mods = [m for key, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType) and (key == mod.__name__ or key.startswith(mod.__name__ + "."))]
    out = []
    for m in mods:
        if m.__name__ == __name__:                   # the guards themselves always run
            continue
        for value in list(vars(m).values()):
            if getattr(value, "__module__", None) != m.__name__:
                continue
            if isinstance(value, types.FunctionType):
                out.append(_innermost(value))
            elif isinstance(value, type):
                out += _class_methods(value)
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
        self._built: tuple[_CodeRules, list] | None = None
        self._depth = 0
        self._violations: list[str] = []

    def _ops(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if isinstance(t, str) and "::" in t)

    def __enter__(self) -> "forbid":
        self._depth += 1
        if self._depth > 1:  # re-entered (a guarded function calling another): already installed
            return self
        undo: list[Callable[[], None]] = []
        self._violations = []
        try:
            if self._built is None:  # resolved once per guard: re-entering it (wrap) stays cheap
                template, builtins = _CodeRules(self, 0, {}, [], {}, {}), []
                for target in self.targets:
                    if not (isinstance(target, str) and "::" in target):
                        self._install(target, template, builtins)
                self._built = template, builtins
            template, builtins = self._built
            rules = _CodeRules(self, _tripped[0], template.files, template.folders, template.names, template.prints)
            for owner, attr, original, label in builtins:
                setattr(owner, attr, self._refuser(label))
                undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
            if self._ops():
                def refuse(func, args, kwargs):
                    raise ForbiddenAPIError(f"torch operator {func._schema.name} (whatever Python name calls "
                                            f"it) is disabled during this check: {self.why}")
                _push_rule(self._ops(), refuse)
                undo.append(lambda: _pop_rule(refuse))
            if rules.files or rules.folders or rules.names or rules.prints:
                _activate(rules)
                self._rules = rules
        except BaseException:
            self._depth -= 1
            for u in reversed(undo):
                u()
            raise
        self._undo = undo
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        undo, self._undo = self._undo or [], None
        rules, self._rules = getattr(self, "_rules", None), None
        tampered = _deactivate(rules) if rules is not None else False
        for u in reversed(undo):
            u()
        if exc_type is not None and issubclass(exc_type, ForbiddenAPIError):
            return
        if self._violations:  # a forbidden call whose error the code caught
            raise ForbiddenAPIError(f"{self._violations[0]} was called during this check (and its "
                                    f"ForbiddenAPIError caught): {self.why}")
        if tampered:
            raise ForbiddenAPIError("the check's guard was switched off (sys.settrace) during the check: "
                                    f"{self.why}")

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` called inside this guard (for a check that calls the learner's function many times)."""
        def guarded(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        guarded.__name__ = getattr(fn, "__name__", "guarded")
        guarded.__doc__ = getattr(fn, "__doc__", None)
        return guarded

    def _refuser(self, label: str) -> Callable:
        def refuse(*args, **kwargs):
            raise ForbiddenAPIError(f"{label} is disabled during this check: {self.why}")
        return refuse

    # -- resolving one target
    def _install(self, target: Any, rules: _CodeRules, builtins: list) -> None:
        owner, attr = None, ""
        label = target if isinstance(target, str) else None
        if isinstance(target, str):
            owner, target, attr = _resolve(target)
        label = label or getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
        if isinstance(target, types.MethodType):
            target = target.__func__
        if isinstance(target, types.ModuleType):
            path = getattr(target, "__file__", None)
            if not path:
                raise ValueError(f"forbid: module {label!r} has no source file to block")
            path = _real(path)
            if os.path.basename(path).startswith("__init__."):  # a package: every file under it
                rules.folders.append((os.path.dirname(path) + os.sep, label))
            else:
                rules.files[path] = label
            for fn in _module_functions(target):
                self._add_code(fn, f"{target.__name__}.{fn.__qualname__}", rules, whole=False)
        elif isinstance(target, type):
            for fn in _class_methods(target):  # none for a class built in C (its construction stays possible)
                self._add_code(fn, label, rules, whole=True)
        elif isinstance(target, types.FunctionType):
            self._add_code(_innermost(target), label, rules, whole=True)
        elif owner is not None and callable(target):  # a C builtin: replaced where it is looked up, on entry
            builtins.append((owner, attr, target, label))
        else:
            raise ValueError(f"forbid: cannot disable {label!r} (a {type(target).__name__}); name a function, "
                             "class, module or operator ('ns::op')")

    @staticmethod
    def _add_code(fn: types.FunctionType, label: str, rules: _CodeRules, whole: bool) -> None:
        """Refuse ``fn``'s code wherever it runs from: its file and qualified name (``whole``: also the
        functions defined inside it), and the fingerprint of it and its inner functions (copies)."""
        code = fn.__code__
        if whole and not code.co_filename.startswith("<"):  # generated code ("<string>"): by fingerprint only
            path = _real(code.co_filename)
            rules.names[(path, code.co_qualname)] = label
            rules.names[(path, code.co_qualname + ".")] = label
        for inner in _codes_within(code):
            if inner.co_flags & _CO_OPTIMIZED:
                rules.prints[_fingerprint(inner)] = label


# ----------------------------------------------------------------------------- recording traffic

@dataclass(frozen=True)
class Comm:
    """One communication call seen on this rank, at the dispatcher (whichever Python API issued it).

    ``op``: the operator without its namespace and trailing underscore: ``"send"``, ``"recv"``,
    ``"recv_any_source"``, ``"allreduce"``, ``"allgather"``, ``"_allgather_base"``, ``"_reduce_scatter_base"``,
    ``"broadcast"``, ``"barrier"``, ``"all_reduce"`` (a functional collective), ...
    ``group_ranks``: the global ranks of the process group, in group order (``None`` if unknown);
    ``group_rank``, ``group_size``: this rank's rank in it and its size. ``nbytes``: the bytes this rank hands to the call (a send:
    the payload; a receive: the buffer; a collective: its input tensors). ``peer``: for point-to-point,
    the other rank **in the group** (None for a receive from any source and for collectives).
    """
    op: str
    group_ranks: tuple[int, ...] | None
    group_rank: int
    group_size: int
    nbytes: int
    peer: int | None = None


_INPUT_ARGS = ("input_tensors", "input_tensor", "input", "inputs", "input_list", "tensors", "tensor")
_PEER_ARGS = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}


def _nbytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.numel() * value.element_size()
    return 0


def _describe(func, args, kwargs) -> Comm:
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    schema = func._schema
    named = {a.name: v for a, v in zip(schema.arguments, args)}
    named.update(kwargs)
    op = schema.name.split("::", 1)[1].rstrip("_")
    pg = None
    if "process_group" in named:
        pg = ProcessGroup.unbox(named["process_group"])
    elif "group_name" in named:
        pg = dist.distributed_c10d._resolve_process_group(named["group_name"])
    ranks, rank, size = None, -1, -1
    if pg is not None:
        rank, size = pg.rank(), pg.size()
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except (ValueError, RuntimeError, KeyError):
            ranks = None
    payload = next((named[n] for n in _INPUT_ARGS if n in named), None)
    peer = named.get(_PEER_ARGS.get(op, ""))
    return Comm(op, ranks, rank, size, _nbytes(payload), None if peer is None else int(peer))


class record_comm:
    """A context manager that records every collective and point-to-point call issued on this rank.

    It sees them whatever API issued them (``dist.*`` under any name, ``isend``/``irecv``/
    ``batch_isend_irecv``, ``ProcessGroup`` methods, functional collectives, DTensor, ``course_lib``'s
    collectives), because it intercepts the ``c10d`` operators. ``calls`` is the list of :class:`Comm`
    in issue order. Nests with :class:`forbid` (a forbidden operator is recorded, then refused).
    """

    def __init__(self) -> None:
        self.calls: list[Comm] = []
        self._cb = None

    def __enter__(self) -> "record_comm":
        def note(func, args, kwargs):
            if func._schema.name not in _NOT_COMM:
                self.calls.append(_describe(func, args, kwargs))
        self._cb = note
        _push_rule(COMM_OPS, note)
        return self

    def __exit__(self, *exc) -> None:
        if self._cb is not None:
            _pop_rule(self._cb)
            self._cb = None

    def ops(self, *names: str) -> list[Comm]:
        """The calls whose ``op`` is one of ``names`` (all calls if none given)."""
        return [c for c in self.calls if not names or c.op in names]

    @property
    def collectives(self) -> list[Comm]:
        """Every call that is not point-to-point (``barrier`` included)."""
        return [c for c in self.calls if c.op not in ("send", "recv", "recv_any_source", "isend", "irecv")]

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sent point-to-point."""
        return sum(c.nbytes for c in self.calls if c.op in ("send", "isend"))

    @property
    def received_bytes(self) -> int:
        """Bytes this rank received point-to-point (the sizes of its receive buffers)."""
        return sum(c.nbytes for c in self.calls if c.op in ("recv", "recv_any_source", "irecv"))


@dataclass(frozen=True)
class Message:
    """One point-to-point operation seen on this rank (a :class:`Comm` of ``record_p2p``).

    ``kind`` is ``"send"`` or ``"recv"``; ``peer`` the other rank **in the group** (None for a receive from
    any source); ``nbytes`` the payload; ``group_rank`` / ``group_size`` this rank's rank in the group used
    and that group's size.
    """
    kind: str
    peer: int | None
    nbytes: int
    group_rank: int
    group_size: int


class record_p2p(record_comm):
    """:class:`record_comm` seen as point-to-point messages: ``messages`` lists the sends and receives as
    :class:`Message` in issue order; ``sent_bytes`` / ``received_bytes`` sum them."""

    @property
    def messages(self) -> list[Message]:
        out = []
        for c in self.calls:
            kind = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "recv_any_source": "recv"}.get(c.op)
            if kind is not None:
                out.append(Message(kind, c.peer, c.nbytes, c.group_rank, c.group_size))
        return out

    def peers(self, kind: str) -> set:
        return {m.peer for m in self.messages if m.kind == kind}
