"""The program each virtual-cluster rank runs (``python -m course_lib._worker``).

Started by :class:`course_lib.launch.Cluster`. It talks to the caller over two inherited pipes:

* the *task* pipe (caller -> rank): ``("init", sys_path)`` once, then ``("task", id, payload)``
  where ``payload = cloudpickle.dumps((fn, args, kwargs))``, or ``("exit",)``;
* the *result* pipe (rank -> caller): ``("ready",)`` / ``("init_error", traceback)`` once, then
  ``("result", id, ok, data)`` per task, ``data`` being the pickled return value or a traceback.

Under NCCL the rank runs on GPU ``rank``, which is also its default device, and the tensors of its
return values travel as CPU tensors (:func:`_dumps`).

stdout and stderr go to one pipe that the caller reads and prefixes with ``[rank r]``. After each
task the rank prints a sentinel line so the caller knows it has seen all of that task's output.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

SENTINEL = "\x1e__course_lib_task_done__"


def _dumps(value, to_cpu: bool) -> bytes:
    """``value`` cloudpickled for the caller; with ``to_cpu`` every tensor in it travels as a CPU tensor
    (a rank's CUDA tensor would be rebuilt on the caller's GPU, starting CUDA in the notebook's process).
    Types (``nn.Parameter``), ``requires_grad`` and the nesting are kept; every tensor arrives as a
    leaf, as plain pickling delivers it."""
    import cloudpickle

    if not to_cpu:
        return cloudpickle.dumps(value)
    import io

    import torch

    class _OnCPU(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) is torch.Tensor:
                # a parameter's data is a plain tensor too, so parameters come here through their data
                return obj.detach().cpu().requires_grad_(obj.requires_grad).__reduce_ex__(self.proto)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    _OnCPU(buf).dump(value)
    return buf.getvalue()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the caller disappears, even if this rank is stuck inside a collective."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def main() -> None:
    env = os.environ
    rank = int(env["COURSE_RANK"])
    world_size = int(env["COURSE_WORLD_SIZE"])
    tasks = Connection(int(env["COURSE_TASK_FD"]), writable=False)
    results = Connection(int(env["COURSE_RESULT_FD"]), readable=False)
    threading.Thread(target=_watch_parent, args=(int(env["COURSE_PARENT_PID"]),), daemon=True).start()

    kind, sys_path = tasks.recv()
    assert kind == "init"
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)

    try:
        import cloudpickle
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        torch.set_num_threads(int(env.get("COURSE_THREADS", "1")))
        backend = env["COURSE_BACKEND"]
        if backend == "nccl":
            # GPU `rank` is this rank's device and its default device: rank functions written for the
            # CPU create their tensors there unchanged (launch.Cluster's docstring).
            torch.cuda.set_device(rank)
            torch.set_default_device(torch.device("cuda", rank))
        timeout = timedelta(seconds=float(env["COURSE_PG_TIMEOUT"]))
        store = dist.TCPStore(env["COURSE_STORE_HOST"], int(env["COURSE_STORE_PORT"]),
                              world_size, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except BaseException:
        results.send(("init_error", traceback.format_exc()))
        return
    results.send(("ready",))

    while True:
        try:
            msg = tasks.recv()
        except EOFError:  # the caller closed the pipe: shut down quietly
            break
        if msg[0] == "exit":
            break
        _, task_id, payload = msg
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            value = fn(rank, world_size, *args, **kwargs)
            try:
                data = _dumps(value, to_cpu=backend == "nccl")
                ok = True
            except Exception as exc:  # noqa: BLE001 - report any pickling failure to the caller
                data = (f"the return value of rank {rank} could not be pickled "
                        f"({type(value).__name__}: {type(exc).__name__}: {exc}); return plain data "
                        f"(numbers, lists, tensors, numpy arrays), not open files, locks or modules")
                ok = False
        except BaseException:  # noqa: BLE001 - every failure must reach the caller
            data = traceback.format_exc()
            ok = False
        sys.stdout.flush()
        sys.stderr.flush()
        print(SENTINEL, flush=True)
        results.send(("result", task_id, ok, data))

    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


if __name__ == "__main__":
    main()
