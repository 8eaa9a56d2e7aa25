"""Stress test: notebook 04's JAX data-parallel workload, repeated until a deadline, several processes at once.

Why it exists: with more simulated CPU devices than cores, XLA:CPU (jaxlib 0.10) deadlocks in a
collective now and then (under this load, every process within two minutes): all but one device wait
in the rendezvous for a participant that never starts (see ``course_lib.launch.jax_cpu_devices``). The fix gives XLA's
thread pool a spare thread per device and two more (``NPROC = 2 n + 2``) and turns XNNPACK off. This
script shows both sides on the same workload: by default with the fix; with ``--without-fix`` the
pool is sized to exactly the devices (``NPROC = n``) and XNNPACK left on, as jaxlib does by itself.

Each process runs, until ``--seconds`` have passed, exactly what notebook 04 runs on 4 devices: 100
calls of the "trap" gradient (``shard_map`` + ``pmean``), 5 of the fixed one (``pcast`` + ``pmean``),
and one ``fori_loop`` of 100 ``pmean`` steps. A watchdog thread ends a process whose loop makes no
progress for 30 s and reports it as a hang (XLA's own collective timeout would end it later anyway).

    python benchmarks/stress_jax_collectives.py                      # 3 processes x 300 s, with the fix
    python benchmarks/stress_jax_collectives.py --without-fix --seconds 120
    python benchmarks/stress_jax_collectives.py --devices 8         # notebooks 00 and 03 use 8

Not part of ``make test`` (minutes of CPU); the figures are in ``jax_cpu_devices``' docstring.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

STALL_S = 30


def worker(seconds: float, devices: int) -> None:
    """One process: notebook 04's JAX cells in a loop; prints launches and collective calls."""
    import threading
    from functools import partial

    import numpy as np

    from course_lib import compat
    from course_lib.launch import jax_cpu_devices

    devs = jax_cpu_devices(devices, collective_timeout_s=4 * STALL_S)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    def loss_fn(w, X, y):
        return jnp.mean((X @ w - y) ** 2)

    grad_fn = jax.grad(loss_fn)
    mesh = Mesh(np.array(devs), axis_names=("data",))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    def dp_grad_trap(w, X_shard, y_shard):
        return jax.lax.pmean(grad_fn(w, X_shard, y_shard), "data")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    def dp_grad(w, X_shard, y_shard):
        w = compat.pcast(w, "data", to="varying")
        return jax.lax.pmean(grad_fn(w, X_shard, y_shard), "data")

    @jax.jit
    def dp_train(w, X, y):
        return jax.lax.fori_loop(0, 100, lambda i, w: w - 0.1 * dp_grad(w, X, y), w)

    kx, kn = jax.random.split(jax.random.PRNGKey(0))
    X = jax.random.normal(kx, (16 * devices, 4))
    y = X @ jnp.array([1.0, -2.0, 3.0, 0.5]) + 0.1 * jax.random.normal(kn, (16 * devices,))
    progress = {"launches": 0, "calls": 0, "t": time.monotonic()}

    def watchdog():
        while True:
            time.sleep(2)
            stalled = time.monotonic() - progress["t"]
            if stalled > STALL_S:
                print(f"HANG after {progress['launches']} launches ({progress['calls']} collectives): "
                      f"no progress for {stalled:.0f} s", flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        w = jnp.zeros(4)
        for _ in range(100):
            w = w - 0.1 * dp_grad_trap(w, X, y)
        for _ in range(5):
            w = w - 0.1 * dp_grad(w, X, y)
        dp_train(jnp.zeros(4), X, y).block_until_ready()
        w.block_until_ready()
        progress["launches"] += 106
        progress["calls"] += 205
        progress["t"] = time.monotonic()
    print(f"OK {progress['launches']} launches ({progress['calls']} collectives)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3, help="processes at once (load on the cores)")
    p.add_argument("--devices", type=int, default=4, help="simulated JAX devices per process")
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--without-fix", action="store_true",
                   help="NPROC = devices and XNNPACK on: jaxlib's own configuration (expect hangs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.seconds, args.devices)
        return 0
    env = dict(os.environ)
    env.pop("NPROC", None)
    if args.without_fix:  # jax_cpu_devices keeps what the caller set
        env["NPROC"] = str(args.devices)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=true").strip()
    cmd = [sys.executable, __file__, "--worker", "--seconds", str(args.seconds), "--devices", str(args.devices)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(args.processes)]
    hangs = launches = 0
    for pr in procs:
        out = pr.communicate(timeout=args.seconds + 10 * STALL_S)[0].strip().splitlines()
        line = out[-1] if out else f"exit {pr.returncode} without a report"
        print(("without the fix: " if args.without_fix else "with the fix: ") + line)
        hangs += not line.startswith("OK")
        counted = re.search(r"(\d+) launches", line)
        launches += int(counted.group(1)) if counted else 0
    print(f"{args.processes} processes x {args.devices} devices on {os.cpu_count()} cores, "
          f"{args.seconds:g} s: {launches:,} launches, {hangs} hang(s) or failure(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
