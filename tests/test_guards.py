"""The grading guards (course_lib.grading.guards): forbid blocks by what runs; record_comm sees every call.

The forbid tests use a small module written to a temporary folder, so they show the guard on code it
has never seen: the shortcuts a learner would try (an alias taken before the check, a bound method,
``importlib.reload``, a second copy loaded from the file or from a copy of the file, catching the error,
switching the hook off) each raise ForbiddenAPIError. The traffic test runs on real gloo ranks, on a
subgroup that does not start at rank 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
import threading

import pytest

from course_lib.grading.guards import ForbiddenAPIError, forbid, record_comm, record_p2p

SOURCE = '''
import functools


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def answer(x):
    """The reference a check forbids."""
    return x * 2


@logged
def decorated_answer(x):
    return x * 3


@logged
def allowed_too(x):
    return x - 1


def factory():
    def inner(x):
        return x + 100
    return inner


class Solver:
    def solve(self, x):
        return x + 1

    @staticmethod
    def quick(x):
        return x + 2


def unrelated(x):
    return x - 5
'''


@pytest.fixture
def lib(tmp_path, monkeypatch):
    """A fresh module ``guarded_lib_<n>`` importable from tmp_path."""
    name = f"guarded_lib_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    yield mod
    sys.modules.pop(name, None)


def _load_copy(path, name="second_copy"):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def refused(guard, call, match=None):
    """``call()`` inside ``guard`` raises ForbiddenAPIError (a check's first forbidden call fails it)."""
    with pytest.raises(ForbiddenAPIError, match=match):
        with guard:
            call()


def test_alias_taken_before_and_other_functions_still_work(lib):
    answer = lib.answer
    guard = forbid(f"{lib.__name__}.answer", why="write it yourself")
    refused(guard, lambda: answer(1), match="write it yourself")
    with guard:
        assert lib.unrelated(10) == 5 and lib.Solver().solve(1) == 2
    assert answer(1) == 2  # restored


def test_reload_and_second_copy_of_the_file_are_blocked(lib):
    guard = forbid(lib.__name__, why="no library")
    with guard:
        reloaded = importlib.reload(lib)          # loading is allowed, calling into it is not
        copy = _load_copy(lib.__file__)
    refused(guard, lambda: reloaded.answer(1))
    refused(guard, lambda: copy.answer(1))
    refused(guard, lambda: copy.Solver().solve(1))
    refused(guard, lambda: _load_copy(lib.__file__, "inside").answer(1))
    assert lib.answer(1) == 2 and copy.answer(1) == 2


def test_function_target_blocks_copies_of_its_file(lib, tmp_path):
    guard = forbid(lib.answer, why="no")
    refused(guard, lambda: _load_copy(lib.__file__).answer(1))
    elsewhere = tmp_path / "renamed_elsewhere.py"   # the file copied under another name
    shutil.copy(lib.__file__, elsewhere)
    refused(guard, lambda: _load_copy(str(elsewhere), "renamed_elsewhere").answer(1))
    with guard:
        assert _load_copy(lib.__file__, "third").unrelated(6) == 1


def test_own_code_that_compiles_like_the_library_still_runs(lib):
    ns = {}
    exec(compile("def answer(x):\n    return x * 2\n", "<notebook cell>", "exec"), ns)  # the same bytecode
    with forbid(lib.__name__, why="no"):
        assert ns["answer"](2) == 4


def test_class_target_blocks_bound_methods_staticmethods_and_subclasses(lib):
    bound = lib.Solver().solve
    quick = lib.Solver.quick

    class Mine(lib.Solver):
        pass

    guard = forbid(f"{lib.__name__}.Solver", why="no")
    for call in (lambda: bound(1), lambda: quick(1), lambda: Mine().solve(1),
                 lambda: _load_copy(lib.__file__).Solver().solve(1)):
        refused(guard, call)
    with guard:
        assert lib.answer(1) == 2
    assert bound(1) == 2


def test_bound_method_target_and_functions_defined_inside(lib):
    inner = lib.factory()
    guard = forbid(lib.Solver().solve, lib.factory, why="no")
    refused(guard, lambda: lib.Solver().solve(1))
    refused(guard, lambda: inner(1))                # made by the forbidden factory before the check
    with guard:
        assert lib.Solver.quick(1) == 3


def test_a_decorated_function_does_not_block_the_decorators_other_users(lib):
    guard = forbid(lib.decorated_answer, why="no")
    refused(guard, lambda: lib.decorated_answer(1))
    with guard:
        assert lib.allowed_too(1) == 0


def test_catching_the_error_or_switching_the_hook_off_still_fails(lib):
    def swallow():
        try:
            lib.answer(1)
        except Exception:
            pass
    refused(forbid(lib.answer, why="no"), swallow, match="caught")
    refused(forbid(lib.answer, why="no"), lambda: sys.settrace(None), match="switched off")
    assert sys.gettrace() is None and lib.answer(1) == 2


def test_threads_started_inside_the_block_are_guarded(lib):
    seen = []

    def work():
        try:
            lib.answer(1)
        except ForbiddenAPIError as err:
            seen.append(err)

    def in_a_thread():
        t = threading.Thread(target=work)
        t.start()
        t.join()

    refused(forbid(lib.answer, why="no"), in_a_thread)   # reported on exit too
    assert len(seen) == 1


def test_guards_nest_and_reenter(lib):
    outer, inner = forbid(lib.answer, why="outer"), forbid(lib.unrelated, why="inner")
    with outer:
        with inner, outer:
            assert lib.Solver().solve(1) == 2
        assert lib.unrelated(6) == 1
    with outer:
        refused(inner, lambda: lib.unrelated(1), match="inner")
    refused(outer, lambda: refused(inner, lambda: lib.answer(1)), match="outer")
    assert lib.answer(1) == 2 and sys.gettrace() is None


def test_a_package_target_blocks_its_modules_but_not_the_guard_itself():
    import course_lib.estimate as E
    guard = forbid("course_lib", why="no library")
    refused(guard, lambda: E.model_state_bytes(10))
    with guard:                                      # entering and leaving runs guards.py: allowed
        with forbid("course_lib.grading", why="nested"):
            pass
    assert E.model_state_bytes(10)


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="say why"):
        forbid("os.path.join", why="")
    with pytest.raises(ValueError, match="does not exist"):
        with forbid("os.path.no_such_thing", why="x"):
            pass


# ------------------------------------------------------------------ on real ranks

def _traffic(rank, world_size):
    import torch
    import torch.distributed as dist

    from course_lib.collectives import ring_all_reduce
    from course_lib.grading.guards import TORCH_COLLECTIVES, ForbiddenAPIError, forbid, record_comm

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    t = torch.ones(8)
    with record_comm() as comm:
        ring_all_reduce(t, group=group)
        dist.all_reduce(t, group=group)
        import torch.distributed.distributed_c10d as c10d   # another Python name, same operator
        c10d.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    refused = False
    try:
        with forbid(*TORCH_COLLECTIVES, why="ring"):
            dist.all_reduce(t, group=group)
    except ForbiddenAPIError:
        refused = True
    return [(c.op, c.group_ranks, c.group_rank, c.nbytes, c.peer) for c in comm.calls], comm.sent_bytes, refused


def test_record_comm_sees_p2p_and_collectives_on_a_subgroup():
    from course_lib.launch import Cluster

    with Cluster(4, timeout=120) as cluster:
        out = cluster.run(_traffic)
    for rank, (calls, sent, refused) in enumerate(out):
        ranks = (0, 2) if rank % 2 == 0 else (1, 3)
        me = ranks.index(rank)
        p2p = [c for c in calls if c[0] in ("send", "recv")]
        # a 2-rank ring: one reduce-scatter step and one all-gather step, half the tensor each
        assert sorted(c[0] for c in p2p) == ["recv", "recv", "send", "send"], calls
        assert all(c[1] == ranks and c[2] == me and c[3] == 16 and c[4] == 1 - me for c in p2p), calls
        assert sent == 32
        coll = [c for c in calls if c[0] not in ("send", "recv")]
        assert [(c[0], c[1], c[3]) for c in coll] == [("allreduce", ranks, 32), ("broadcast", ranks, 32)], calls
        assert refused


def test_record_p2p_keeps_its_messages_view():
    rec = record_p2p()
    assert rec.messages == [] and rec.sent_bytes == 0 and rec.peers("send") == set()
    assert isinstance(rec, record_comm)
