"""Checkpoints that survive crashes: the training state, atomic verified files, sharded checkpoints.

This is the storage half of fault-tolerant training (notebook 12); :mod:`course_lib.fault` has the other
half (how often clusters fail, fault plans and restarts, goodput), built on this one.

* **The full training state** (:func:`training_state` / :func:`restore_training_state`): model,
  optimizer, learning-rate scheduler, gradient scaler, step, the data position
  (:class:`ResumableSampler`) and the RNG states of torch, numpy and Python (:func:`rng_state`). Leave
  one out and the resumed run drifts from the uninterrupted one; keep all and it is bitwise identical.
* **Atomic, verified saves** (:func:`atomic_save`, :class:`CheckpointManager`): write a temporary file,
  flush, ``fsync``, ``rename`` (POSIX rename replaces atomically), ``fsync`` the directory; then write a
  manifest with each file's SHA-256 and size, *last*, the same way: a checkpoint without a manifest never
  finished. Loading verifies every file and falls back to the newest intact checkpoint; the last ``k``
  are kept.
* **Sharded checkpoints** (:func:`save_sharded` / :func:`load_sharded`): every rank writes its own
  ZeRO/FSDP shard in parallel, addressed by global offsets, so a checkpoint saved on N ranks loads on M
  (the idea of ``torch.distributed.checkpoint``'s metadata and its load planner). Before a restart the
  ranks verify it in parallel too, each hashing the files it wrote (:func:`verify_collective`,
  :func:`agreed_latest`).

All files are written with ``torch.save`` and read with ``torch.load(weights_only=True)``: tensors,
numbers, strings and containers only, so a checkpoint file cannot run code when it is loaded (numpy's
RNG state is kept as a tensor for that reason). A file that holds anything else (an object put in
``extra``) is refused with a message that says so.

This module imports nothing else of ``course_lib``: storage does not depend on what is stored.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

__all__ = [
    "CheckpointError", "rng_state", "set_rng_state", "ResumableSampler", "training_state",
    "restore_training_state", "atomic_save", "file_sha256", "CheckpointManager", "save_collective",
    "agreed_latest", "verify_collective", "save_sharded", "load_sharded", "ShardedCheckpoint",
]

#: The on-disk format's name and version, written into every manifest and training state and checked
#: when one is read. It keeps the name of the module that first wrote it (this storage was part of
#: ``course_lib.fault`` until it became its own module): renaming it would make every existing
#: checkpoint unreadable.
FORMAT = "course_lib.fault/1"
MANIFEST = "MANIFEST.json"
_CHUNK = 4 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated, corrupted, or belongs to another model."""


# ============================================================================ what a checkpoint holds

def rng_state() -> dict:
    """The RNG states of torch's CPU generator, numpy and Python, and under ``"cuda"`` the states of
    every CUDA device's generator (``torch.cuda.get_rng_state_all()``, a list in device order) when this
    process uses CUDA. "Uses": CUDA is available *and* initialised; a process that never touched a GPU
    has drawn nothing from them, and asking would initialise CUDA (and take GPU memory) for nothing."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    # numpy's state as a tensor and numbers, so that torch.load(weights_only=True) can read it back
    state = {"torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned. CUDA states are restored when CUDA is available here
    (before CUDA's first use they wait until it starts, as ``torch.cuda.manual_seed`` does); a GPU
    run's checkpoint resumed on a CPU-only machine keeps only the other states. Raises
    :class:`CheckpointError` when the checkpoint holds another number of CUDA devices than are visible."""
    missing = {"torch", "numpy", "python"} - set(state)
    if missing:
        raise CheckpointError(f"the RNG state lacks {sorted(missing)}; save it with rng_state()")
    if "cuda" in state and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(state["cuda"]) != n:
            raise CheckpointError(f"the checkpoint holds the RNG states of {len(state['cuda'])} CUDA "
                                  f"device(s) but this process sees {n}; resume with the same GPUs "
                                  "visible (CUDA_VISIBLE_DEVICES) as the run that saved it")
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    if isinstance(npst, dict):
        npst = (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["gauss"])
    np.random.set_state(npst)                         # a tuple: numpy's own form, as older checkpoints hold
    random.setstate(tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumableSampler:
    """Shuffled mini-batches of ``range(n)``, epoch after epoch, that can stop and resume mid-epoch.

    Epoch ``e``'s order is ``torch.randperm(n)`` from a generator seeded with ``seed + e`` (its own
    generator: the global RNG is untouched), so the order is a function of ``(seed, epoch)`` and the
    *position* is the only state to save. With ``num_replicas > 1`` every global batch of ``batch_size``
    indices is cut into equal contiguous parts and replica ``rank`` gets part ``rank`` (data parallelism).

    ``next_batch()`` returns a ``LongTensor`` of indices; ``state_dict()`` / ``load_state_dict()``
    save and restore ``epoch`` and ``position``. The last incomplete batch of an epoch is dropped.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, num_replicas: int = 1):
        for name, v in (("n", n), ("batch_size", batch_size), ("num_replicas", num_replicas)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ResumableSampler: {name} must be a positive int, got {v!r}")
        if batch_size > n:
            raise ValueError(f"ResumableSampler: batch_size={batch_size} is larger than the data set "
                             f"(n={n}); use batch_size <= n")
        if batch_size % num_replicas:
            raise ValueError(f"ResumableSampler: batch_size={batch_size} must be divisible by "
                             f"num_replicas={num_replicas} (each replica gets an equal part)")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler: rank must be in [0, {num_replicas}), got {rank!r}")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, int(seed), bool(shuffle)
        self.rank, self.num_replicas = rank, num_replicas
        self.epoch, self.position = 0, 0
        self._order = None

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            # Indices on the CPU, drawn by a CPU generator: the same order on every machine (a CUDA
            # generator draws other numbers); they index a tensor on any device.
            if self.shuffle:
                g = torch.Generator(device="cpu").manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.n, generator=g, device="cpu")
            else:
                order = torch.arange(self.n, device="cpu")
            self._order = (self.epoch, order)
        return self._order[1]

    def next_batch(self) -> torch.Tensor:
        """The next batch of indices (this replica's part of it); moves to the next epoch when due."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._epoch_order()
        lo = self.position * self.batch_size
        part = self.batch_size // self.num_replicas
        self.position += 1
        return order[lo + self.rank * part: lo + (self.rank + 1) * part].clone()

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        mine = {k: getattr(self, k) for k in ("seed", "n", "batch_size", "shuffle")}
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            diff = ", ".join(f"{k}: checkpoint {theirs[k]!r}, sampler {mine[k]!r}"
                             for k in mine if mine[k] != theirs[k])
            raise CheckpointError(f"the sampler state belongs to another data order ({diff}); build "
                                  f"the sampler with the same n, batch_size, seed and shuffle")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def training_state(model: torch.nn.Module, optimizer, *, step: int, scheduler=None, scaler=None,
                   sampler=None, extra: dict | None = None) -> dict:
    """Everything the rest of a training run depends on, as one picklable dict.

    ``model`` and ``optimizer`` are required; ``scheduler`` (``torch.optim.lr_scheduler``), ``scaler``
    (``torch.amp.GradScaler`` or the course's loss scalers) and ``sampler`` (anything with
    ``state_dict()``) are saved when given. The RNG states of torch, numpy and Python, and those of the
    CUDA devices when this process uses CUDA (:func:`rng_state`), are always saved.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be the number of optimizer steps done (an int >= 0), got {step!r}")
    return {
        "format": FORMAT, "step": step,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
        "rng": rng_state(), "extra": dict(extra or {}),
    }


def _check_model_keys(saved: dict, model: torch.nn.Module) -> None:
    mine = model.state_dict()
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    shapes = sorted(f"{k}: checkpoint {tuple(saved[k].shape)}, model {tuple(mine[k].shape)}"
                    for k in set(mine) & set(saved)
                    if torch.is_tensor(saved[k]) and saved[k].shape != mine[k].shape)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if shapes:
            parts.append(f"shape mismatches {shapes[:8]}")
        raise CheckpointError("the checkpoint was saved from a different model: " + "; ".join(parts)
                              + ". Build the same model (same sizes) before restoring.")


def restore_training_state(state: dict, model: torch.nn.Module, optimizer, *, scheduler=None,
                           scaler=None, sampler=None) -> int:
    """Load what :func:`training_state` saved into live objects and the RNGs; return the step.

    Raises :class:`CheckpointError` naming the mismatched keys when the checkpoint is from another
    model, and when an object is given whose state the checkpoint lacks.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"not a course_lib.checkpoint training state (format {state.get('format') if isinstance(state, dict) else type(state).__name__!r}); "
                              f"save it with training_state()")
    _check_model_keys(state["model"], model)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("sampler", sampler)):
        if obj is not None and state.get(name) is None:
            raise CheckpointError(f"the checkpoint has no {name} state, but a {name} was given to restore; "
                                  f"save it with training_state(..., {name}=...)")
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the optimizer state does not fit this optimizer ({exc}); build the "
                              f"optimizer over the same parameters with the same groups") from exc
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    return int(state["step"])


# ============================================================================ atomic, verified files

def _fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename in it survives a power loss. Some file systems (several
    network file systems, Windows) cannot fsync a directory: that is said once per directory, with the
    reason, as a warning (the rename is still atomic for readers; only its durability is not promised)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError as exc:
        _warn_fsync(path, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        _warn_fsync(path, exc)
    finally:
        os.close(fd)


_FSYNC_WARNED: set[str] = set()


def _warn_fsync(path: Path, exc: OSError) -> None:
    if str(path) not in _FSYNC_WARNED:
        _FSYNC_WARNED.add(str(path))
        warnings.warn(f"cannot fsync directory {path} ({exc}); renames there are atomic but may not survive "
                      "a power loss on this file system", RuntimeWarning, stacklevel=3)


def _atomic_write_bytes(data: bytes, path: Path, on_chunk: Callable[[int], None] | None = None) -> str:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            view = memoryview(data)
            for lo in range(0, len(view), _CHUNK):
                chunk = view[lo:lo + _CHUNK]
                f.write(chunk)
                digest.update(chunk)
                if on_chunk is not None:
                    on_chunk(lo + len(chunk))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)          # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)            # make the rename itself durable
    return digest.hexdigest()


def atomic_save(obj: Any, path, on_chunk: Callable[[int], None] | None = None) -> tuple[str, int]:
    """``torch.save(obj)`` to ``path`` atomically: temporary file, flush, fsync, rename, fsync of the
    directory. Returns ``(sha256 hex, bytes)``. A crash at any moment leaves either the previous file
    or the new one, never half of one. ``on_chunk(bytes_written)`` is called after every 4 MiB written
    (for progress, and for tests that crash in the middle)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return _atomic_write_bytes(data, Path(path), on_chunk), len(data)


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointManager:
    """Checkpoints in ``directory/step_00000042/``, each with a ``MANIFEST.json`` written last.

    Args:
        directory: where checkpoints live (created). On several machines it must be a shared file system.
        keep_last: how many complete checkpoints to keep (older ones are deleted after each commit);
            keep at least 2 so that a corrupted newest one has a fallback.
        on_event: optional ``callable(event, **info)`` called at ``"file-written"`` (``name``),
            ``"before-manifest"`` and ``"committed"`` (``step``): progress reports, and the place where
            tests inject a crash in the middle of a save.

    ``save(step, state)`` writes one file ``state.pt`` and commits it; sharded saves write their files
    with :meth:`write_file` on every rank and commit once (:func:`save_sharded`). ``latest()`` is the
    newest checkpoint that verifies; ``load()`` loads it; ``verify(step)`` raises
    :class:`CheckpointError` naming the file that is missing, truncated or corrupted.
    """

    def __init__(self, directory, keep_last: int = 3, on_event: Callable[..., None] | None = None):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1 (2 or more leaves a fallback), got {keep_last!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.on_event = on_event
        self.skipped: list[tuple[int, str]] = []   # (step, why) of checkpoints latest() passed over

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, keep_last={self.keep_last}, steps={self.steps()})"

    def _event(self, event: str, **info) -> None:
        if self.on_event is not None:
            self.on_event(event, **info)

    def path(self, step: int) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return self.directory / f"step_{step:08d}"

    # ---------------------------------------------------------------- writing
    def write_file(self, step: int, name: str, obj: Any) -> tuple[str, int]:
        """Atomically write one file of checkpoint ``step``; return ``(sha256, bytes)``. Not visible to
        :meth:`latest` until :meth:`commit`."""
        if "/" in name or name.startswith(".") or name == MANIFEST:
            raise ValueError(f"checkpoint file name {name!r}: use a plain name like 'state.pt'")
        d = self.path(step)
        d.mkdir(parents=True, exist_ok=True)
        sha, nbytes = atomic_save(obj, d / name)
        self._event("file-written", name=name, step=step)
        return sha, nbytes

    def commit(self, step: int, files: dict[str, dict], world_size: int = 1, meta: dict | None = None) -> Path:
        """Write the manifest (``files``: name -> {"sha256", "bytes", ...}) atomically: from now on the
        checkpoint exists. Then delete all but the newest ``keep_last`` checkpoints."""
        d = self.path(step)
        for name in files:
            if not (d / name).is_file():
                raise CheckpointError(f"cannot commit step {step}: {d / name} was not written")
        self._event("before-manifest", step=step)
        manifest = {"format": FORMAT, "step": step, "world_size": world_size, "created": time.time(),
                    "files": files, "meta": dict(meta or {})}
        _atomic_write_bytes(json.dumps(manifest, indent=1).encode(), d / MANIFEST)
        self._event("committed", step=step)
        self.prune()
        return d

    def save(self, step: int, state: Any, meta: dict | None = None) -> Path:
        """One-file checkpoint: write ``state.pt``, then commit."""
        sha, nbytes = self.write_file(step, "state.pt", state)
        return self.commit(step, {"state.pt": {"sha256": sha, "bytes": nbytes}}, meta=meta)

    def prune(self) -> list[int]:
        """Delete committed checkpoints older than the newest ``keep_last`` and unfinished ones older
        than the newest committed one; return the deleted steps."""
        steps = self.steps()
        keep = set(steps[-self.keep_last:])
        newest = steps[-1] if steps else -1
        deleted = []
        for d in sorted(self.directory.glob("step_*")):
            try:
                s = int(d.name[5:])
            except ValueError:
                continue
            committed = (d / MANIFEST).is_file()
            if (committed and s not in keep) or (not committed and s < newest):
                shutil.rmtree(d, ignore_errors=True)
                deleted.append(s)
        return deleted

    # ---------------------------------------------------------------- reading
    def steps(self) -> list[int]:
        """Steps that have a manifest (committed; not yet verified), oldest first."""
        out = []
        for d in self.directory.glob("step_*"):
            if (d / MANIFEST).is_file():
                try:
                    out.append(int(d.name[5:]))
                except ValueError:
                    pass
        return sorted(out)

    def manifest(self, step: int) -> dict:
        d = self.path(step)
        m = d / MANIFEST
        if not m.is_file():
            what = "does not exist" if not d.exists() else "has no MANIFEST.json: the save never finished"
            raise CheckpointError(f"checkpoint {d} {what}")
        try:
            manifest = json.loads(m.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{m}: unreadable manifest ({exc})") from exc
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{m}: not a course_lib.checkpoint manifest")
        return manifest

    def verify(self, step: int, names: Iterable[str] | None = None) -> dict:
        """Check the files of checkpoint ``step`` against the manifest (size, then SHA-256): every file, or
        only those in ``names`` (what one rank verifies in :func:`verify_collective`); return the
        manifest. Raises :class:`CheckpointError` naming the first bad file."""
        manifest = self.manifest(step)
        d = self.path(step)
        files = manifest["files"]
        if names is not None:
            wanted = set(names)
            unknown = sorted(wanted - set(files))
            if unknown:
                raise CheckpointError(f"checkpoint step {step} has no file {unknown[0]!r}; it has {sorted(files)}")
            files = {name: info for name, info in files.items() if name in wanted}
        for name, info in files.items():
            f = d / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (the manifest lists it)")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{f}: truncated or extended: {size} bytes, the manifest says "
                                      f"{info['bytes']}")
            sha = file_sha256(f)
            if sha != info["sha256"]:
                raise CheckpointError(f"{f}: corrupted: SHA-256 {sha[:12]}... differs from the "
                                      f"manifest's {info['sha256'][:12]}...")
        return manifest

    def latest(self) -> int | None:
        """The newest checkpoint that verifies, or ``None``. Broken ones are skipped with a warning
        and listed in ``self.skipped``."""
        self.skipped = []
        for step in reversed(self.steps()):
            try:
                self.verify(step)
                return step
            except CheckpointError as exc:
                self.skipped.append((step, str(exc)))
                warnings.warn(f"skipping checkpoint step {step}: {exc}", RuntimeWarning, stacklevel=2)
        return None

    def load(self, step: int | None = None, name: str = "state.pt") -> Any:
        """Verify and load file ``name`` of checkpoint ``step`` (default: :meth:`latest`)."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"no intact checkpoint in {self.directory}"
                                      + (f" (skipped: {self.skipped})" if self.skipped else ""))
        manifest = self.verify(step)
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint step {step} has no file {name!r}; it has "
                                  f"{sorted(manifest['files'])}")
        return _load(self.path(step) / name)


def _load(path: Path):
    """``torch.load`` of a verified checkpoint file, tensors and plain data only (no code runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: holds an object that is not a tensor, a number, a string or a "
                              f"container of them, so it is not loaded (a pickle can run code); keep "
                              f"such values out of the checkpoint or save their state_dict() "
                              f"({str(err).splitlines()[0][:200]})") from err


# ============================================================================ sharded checkpoints

def _shard_name(rank: int, world_size: int) -> str:
    return f"shard_{rank:05d}_of_{world_size:05d}.pt"


def save_collective(manager: CheckpointManager, step: int, files: dict[str, Any], *, group=None,
                    meta: dict | None = None) -> dict:
    """One checkpoint written by all ranks of ``group`` at once: every rank atomically writes its own
    ``files`` (name -> object; names must differ between ranks), the ranks exchange checksums, rank 0
    commits the manifest, and all wait for the commit (a barrier). The manifest records each file's
    writer (``"rank"``, its rank in ``group``): that rank verifies it again before a restart
    (:func:`verify_collective`). Collective.

    Returns this rank's ``{"seconds", "bytes", "total_bytes"}``.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    mine = []
    for name, obj in files.items():
        obj, index = obj if isinstance(obj, _Indexed) else (obj, None)
        sha, nbytes = manager.write_file(step, name, obj)
        mine.append((name, sha, nbytes, index))
    world = dist.get_world_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    entries = [e for per_rank in gathered for e in per_rank]
    writers = {e[0]: r for r, per_rank in enumerate(gathered) for e in per_rank}
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"save_collective: two ranks wrote the same file name ({sorted(names)}); give "
                         f"per-rank files per-rank names (e.g. f'rank_{{rank}}.pt')")
    if dist.get_rank(group) == 0:
        table = {}
        for name, sha, nbytes, index in entries:
            table[name] = {"sha256": sha, "bytes": nbytes, "rank": writers[name]}
            if index is not None:
                table[name]["index"] = index
        manager.commit(step, table, world_size=world, meta=meta)
    dist.barrier(group=group)
    return {"seconds": time.perf_counter() - t0, "bytes": sum(e[2] for e in mine),
            "total_bytes": sum(e[2] for e in entries)}


class _Indexed(tuple):
    """(object, index): a shard file and the pieces it holds, for the manifest."""


def _verifiers(manifest: dict, world_size: int) -> dict[str, int]:
    """``{file name: rank}``: which rank of a ``world_size``-rank group verifies each file of a checkpoint.
    The rank that wrote it, as the manifest records (:func:`save_collective`); a file without a writer
    (:meth:`CheckpointManager.save`) by its place in name order. Both modulo ``world_size``, so that a
    checkpoint saved on N ranks and checked on M spreads its files over the M."""
    return {name: int(info.get("rank", k)) % world_size
            for k, (name, info) in enumerate(sorted(manifest["files"].items()))}


def verify_collective(manager: CheckpointManager, step: int, *, group=None) -> dict:
    """Verify checkpoint ``step`` with every rank of ``group`` at once, each file hashed once: every rank
    checks the files it wrote (:func:`_verifiers`; size, then SHA-256, as
    :meth:`CheckpointManager.verify`), then the ranks exchange their verdicts (one ``all_gather_object``).
    A sharded checkpoint's hashing is split ``world_size`` ways instead of done by one rank: at a 175B
    model's 2-3 TB of shards, one rank hashing every file would dominate a restart.

    Returns the manifest on every rank, or raises :class:`CheckpointError` on every rank, naming each bad
    file and the rank that found it (``"rank 1 of 4: .../shard_00001_of_00004.pt: corrupted: ..."``).
    Collective: every rank of ``group`` must call it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    manifest, problem = None, None
    try:
        manifest = manager.manifest(step)
        mine = [name for name, r in _verifiers(manifest, world).items() if r == rank]
        manager.verify(step, mine)
    except (CheckpointError, OSError) as exc:   # every rank must reach the exchange below, bad files or not
        problem = str(exc)
    verdicts = [None] * world
    dist.all_gather_object(verdicts, problem, group=group)
    found: dict[str, list[int]] = {}                 # the same problem seen by several ranks is said once
    for r, text in enumerate(verdicts):
        if text is not None:
            found.setdefault(text, []).append(r)
    if found:
        raise CheckpointError("; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
                                        f"{world}: {text}" for text, ranks in found.items()))
    return manifest


def agreed_latest(manager: CheckpointManager, *, group=None) -> int | None:
    """The newest intact checkpoint, the same on every rank of ``group``: rank 0 lists the committed steps
    (broadcast), then, from the newest, all ranks verify each one together (:func:`verify_collective`:
    every rank hashes the files it wrote) until one verifies on every rank. Broken ones are skipped, listed
    in ``manager.skipped`` on every rank and warned about on rank 0, naming the bad file and the rank that
    found it. ``None`` when there is none. Collective."""
    import torch.distributed as dist

    steps = [manager.steps() if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(steps, src=src, group=group)
    manager.skipped = []
    for step in reversed(steps[0]):
        try:
            verify_collective(manager, step, group=group)
            return step
        except CheckpointError as exc:
            manager.skipped.append((step, str(exc)))
            if dist.get_rank(group) == 0:
                warnings.warn(f"skipping checkpoint step {step}: {exc}", RuntimeWarning, stacklevel=2)
    return None


def save_sharded(manager: CheckpointManager, step: int, state: dict, *, group=None,
                 meta: dict | None = None) -> dict:
    """Every rank of ``group`` writes its own shard file in parallel; rank 0 commits the manifest.

    ``state`` (per rank): ``{"shards": {key: (start, tensor)}, "lengths": {key: numel}, "replicated":
    {...}, "local": {...}}``: ``shards`` are this rank's pieces of global flat vectors (what
    :meth:`course_lib.zero.ZeRO.sharded_state_dict` returns), ``replicated`` is equal on every rank
    (rank 0's copy is used), ``local`` is this rank's own (RNG states, sampler position). The manifest
    records each file's checksum and which pieces it holds, so that :func:`load_sharded` reads only
    the files a rank needs. Collective: every rank of ``group`` must call it.

    Returns this rank's ``{"seconds", "bytes", "total_bytes"}``.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for key in ("shards", "lengths"):
        if key not in state:
            raise ValueError(f"save_sharded: state needs {key!r} (see ZeRO.sharded_state_dict)")
    payload = {"shards": {k: v[1] for k, v in state["shards"].items()},
               "starts": {k: int(v[0]) for k, v in state["shards"].items()},
               "lengths": dict(state["lengths"]), "replicated": state.get("replicated"),
               "local": state.get("local"), "rank": rank, "world_size": world}
    index = {k: [int(v[0]), int(v[1].numel())] for k, v in state["shards"].items()}
    return save_collective(manager, step, {_shard_name(rank, world): _Indexed((payload, index))},
                           group=group, meta=meta)


class ShardedCheckpoint:
    """A verified sharded checkpoint opened for reading (from :func:`load_sharded`).

    ``fetch(key, start, stop)`` assembles values ``[start, stop)`` of the global vector ``key`` from
    the files that hold them (each file read once, on first use); ``replicated`` is rank 0's
    replicated dict; ``local(rank)`` the local dict saved by ``rank`` (``None`` if the checkpoint had
    fewer ranks); ``world_size`` the number of ranks that saved it.
    """

    def __init__(self, manager: CheckpointManager, step: int, manifest: dict):
        self.manager, self.step, self.manifest = manager, step, manifest
        self.world_size = manifest["world_size"]
        self._files: dict[str, dict] = {}
        self.files_read: list[str] = []

    def _file(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = _load(self.manager.path(self.step) / name)
            self.files_read.append(name)
        return self._files[name]

    @property
    def replicated(self):
        return self._file(_shard_name(0, self.world_size))["replicated"]

    def local(self, rank: int):
        name = _shard_name(rank, self.world_size)
        return self._file(name)["local"] if name in self.manifest["files"] else None

    def length(self, key: str) -> int:
        return int(self._file(_shard_name(0, self.world_size))["lengths"][key])

    def fetch(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop:
            raise ValueError(f"fetch({key!r}, {start}, {stop}): need 0 <= start <= stop")
        out, filled = None, 0
        for name, info in sorted(self.manifest["files"].items()):
            if key not in info["index"]:
                continue
            lo, n = info["index"][key]
            a, b = max(start, lo), min(stop, lo + n)
            if a >= b:
                continue
            t = self._file(name)["shards"][key]
            if out is None:
                out = torch.empty(stop - start, dtype=t.dtype, device=t.device)   # as loaded: the CPU
            out[a - start:b - start] = t[a - lo:b - lo]
            filled += b - a
        if filled != stop - start:
            raise CheckpointError(f"checkpoint step {self.step} does not cover {key}[{start}:{stop}] "
                                  f"({filled} of {stop - start} values found): saved from a different "
                                  f"model, or a shard is missing")
        return out


def load_sharded(manager: CheckpointManager, step: int | None = None, *, group=None) -> ShardedCheckpoint:
    """Open the newest intact sharded checkpoint (or ``step``) on every rank of ``group``: the ranks
    verify it together, each the shard files it wrote (:func:`agreed_latest`, or :func:`verify_collective`
    for a given ``step``), then every rank reads only the shard files that hold the pieces it asks
    :meth:`ShardedCheckpoint.fetch` for. Collective."""
    if step is None:
        step = agreed_latest(manager, group=group)   # verified by all ranks, each file once
        if step is None:
            raise CheckpointError(f"no intact checkpoint in {manager.directory}")
        return ShardedCheckpoint(manager, step, manager.manifest(step))
    return ShardedCheckpoint(manager, step, verify_collective(manager, step, group=group))
