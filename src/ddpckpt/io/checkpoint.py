"""The collective entry points :func:`save` and :func:`load`, and the local readers.

``save`` and ``load`` are collective under ``torch.distributed``: every rank calls them,
in the same order, with the same arguments (rank 0's path is used everywhere). They
work unchanged in a single process. ``load_state_dict`` and ``verify`` are local: any
process may call them alone.

Saving captures the training state (:mod:`ddpckpt.state.capture`), plans and writes it
collectively (:mod:`ddpckpt.io.writing`), optionally from host copies in the background
(:mod:`ddpckpt.io.staging`, :mod:`ddpckpt.io.background`). Loading finds the checkpoint on
every rank (repairing node-local copies, :mod:`ddpckpt.dist.replicate`), checks every object
against it, then copies memory-mapped, checksum-verified tensors into the live objects.

A failure on any rank at any step raises the same error on every rank; nothing committed
earlier is touched.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpckpt._log import get_logger
from ddpckpt.dist.comm import Comm
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    error_class,
)
from ddpckpt.format.codec import decode
from ddpckpt.format.manifest import Manifest, read_manifest
from ddpckpt.format.tensorfile import TensorEntry, TensorFile, can_read_into, dtype_from_name
from ddpckpt.io.background import PendingSave, Persister
from ddpckpt.io.progress import Progress
from ddpckpt.io.staging import Fence, StagingPool
from ddpckpt.io.writing import WritePlan, header_fields, plan_write, write_and_commit
from ddpckpt.state.capture import (
    Snapshot,
    capture,
    check_model,
    check_optimizer,
    extra_kind,
    restore_model,
    restore_optimizer,
    restore_rank_buffers,
    restore_stateful,
)
from ddpckpt.state.rng import derive_rng, restore_rng

__all__ = ["CheckpointInfo", "PendingSave", "load", "load_state_dict", "save", "verify"]

_log = get_logger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` returns: the checkpoint's metadata and its plain ``extra`` values."""

    path: str
    step: int | None
    epoch: int | None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    created: float = 0.0
    library_version: str = ""
    torch_version: str = ""

    @classmethod
    def from_manifest(cls, path: str, manifest: Manifest, extra: dict[str, Any]) -> CheckpointInfo:
        return cls(
            path=path,
            step=manifest.step,
            epoch=manifest.epoch,
            metrics=decode(manifest.metrics, _no_tensors(path), where=path),
            extra=extra,
            world_size=manifest.world_size,
            created=manifest.created,
            library_version=manifest.library_version,
            torch_version=manifest.torch_version,
        )


def _no_tensors(where: str) -> Callable[[str], torch.Tensor]:
    def fail(name: str) -> torch.Tensor:
        raise CorruptCheckpointError(f"{where}: metrics refer to a tensor ({name})")

    return fail


# =========================================================================== save


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    rng: bool = True,
    async_save: bool | str = False,
    storage: str | None = None,
    timeout: float | None = None,
) -> str | PendingSave:
    """Write the whole training state to the checkpoint directory ``path``; collective.

    Every rank calls it. ``model`` may be wrapped in DDP, DataParallel or torch.compile;
    ``extra`` maps names to objects with ``state_dict()``/``load_state_dict()`` or to plain
    values (numbers, strings, lists, dicts, tensors). ``metrics`` are scalars (numbers,
    0-d tensors, strings). With ``rng`` every rank's random generators are stored.
    ``storage`` is ``"auto"`` (detect), ``"shared"`` or ``"local"``; see
    :mod:`ddpckpt.dist.topology`. ``timeout`` bounds how long a rank waits for a silent one.

    ``async_save=True`` returns as soon as this rank's share of the state is copied to host
    memory (:mod:`ddpckpt.io.staging`); writing and committing go on in the background and the
    returned :class:`PendingSave` waits for them. ``async_save="overlap"`` returns sooner:
    parameters and optimizer state are copied while the next forward and backward run,
    and the ``step()`` of ``optimizer`` (required) and of every optimizer in ``extra``
    waits for that copy. Either way the checkpoint holds the state as of this call. The
    returned handle reports this save's own outcome (``done()``, ``wait()``,
    ``exception()``). The next save or load waits for the previous asynchronous save and
    raises its error if it failed and nobody had asked its handle.

    Raises :class:`CheckpointExistsError` if ``path`` is already a checkpoint (pass
    ``overwrite=True`` to replace it atomically), :class:`UnsupportedValueError` naming the
    key of anything that cannot be stored without pickle, :class:`CheckpointWriteError`
    when storage fails. Returns the checkpoint's path (rank 0's).
    """
    overlap = async_mode(async_save, optimizer)
    _PERSISTER.join()
    header = header_fields(step, epoch, metrics)
    comm = Comm.open("ddpckpt.save", path=os.fspath(path), timeout=timeout)
    handed_off = False

    def settle_then_capture() -> Snapshot:
        _PERSISTER.raise_unseen()  # in a collective step: every rank raises if one does
        return capture(
            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extra=extra,
            rng=rng,
        )  # fmt: skip

    try:
        snapshot = comm.run("capture", settle_then_capture)
        plan = plan_write(comm, snapshot, header, overwrite=overwrite, storage=storage)
        if not async_save:
            return write_and_commit(plan)
        start_background(
            plan, snapshot, pool=_POOL, persister=_PERSISTER, overlap=overlap, optimizer=optimizer
        )
        handed_off = True
        return PendingSave(plan.path, _PERSISTER.latest)  # type: ignore[arg-type]  # just submitted
    finally:
        if not handed_off:
            comm.close()


_POOL = StagingPool()
_PERSISTER = Persister()


def release_async_buffers() -> None:
    """Wait for the asynchronous save in flight, then free the host buffer that
    asynchronous saves reuse; the next one allocates it again.

    Local: any rank may call it at any time, and it raises nothing: a failed save is raised
    by its handle and, on every rank, by the next save or load. A :class:`Checkpointer` has
    a buffer of its own, which :meth:`Checkpointer.close` frees.
    """
    _PERSISTER.join()
    _POOL.release()


def async_mode(async_save: bool | str, optimizer: torch.optim.Optimizer | None) -> bool:
    """Validate ``async_save``; True for the overlap mode."""
    if async_save not in (False, True, "overlap"):
        raise ValueError(f"async_save must be False, True or 'overlap', got {async_save!r}")
    if async_save == "overlap" and optimizer is None:
        raise ValueError(
            "async_save='overlap' needs optimizer=, whose step() waits for the snapshot"
        )
    return async_save == "overlap"


def start_background(
    plan: WritePlan,
    snapshot: Snapshot,
    *,
    pool: StagingPool,
    persister: Persister,
    overlap: bool,
    optimizer: torch.optim.Optimizer | None,
    persist: Callable[[WritePlan], object] = write_and_commit,
) -> None:
    """Stage ``plan``'s tensors and persist them in the background; closes ``plan.comm``.

    Call ``persister.join()`` before: the pool's previous copies must be written. With
    ``overlap`` the tensors that only known optimizers' ``step()`` writes (parameters and
    moments of ``optimizer`` and of every optimizer passed in ``extra``) are copied in the
    background too, and each of those optimizers' next ``step()`` waits for the copies;
    everything else (buffers, an EMA copy, parameters no known optimizer steps) is copied
    before returning. The optimizers come from ``snapshot.stepped_by``; ``optimizer`` is
    the ``optimizer=`` of the save, which the overlap mode requires.
    """
    deferred = _changes_only_in_step(snapshot) if overlap else None
    steppers = {
        id(o): o for n, _ in plan.items if deferred and deferred(n) for o in snapshot.stepped_by[n]
    }
    plan.items, fence = pool.stage(plan.items, defer=deferred)
    for stepper in steppers.values():
        fence_before_step(stepper, fence)

    def job() -> None:
        try:
            fence.wait()
            persist(plan)
        finally:
            plan.comm.close()

    persister.submit(job, os.path.basename(plan.path))


def _changes_only_in_step(snapshot: Snapshot) -> Callable[[str], bool]:
    """Tensors that nothing but the ``step()`` of optimizers we can fence writes."""
    return lambda name: bool(snapshot.stepped_by.get(name))


_fences: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Fence]] = weakref.WeakKeyDictionary()


def fence_before_step(optimizer: torch.optim.Optimizer, fence: Fence) -> None:
    """Make ``optimizer.step()`` wait for ``fence`` (a hook registered once per optimizer)."""
    if optimizer not in _fences:
        pending: list[Fence] = []
        _fences[optimizer] = pending

        def wait_for_snapshot(*_: object) -> None:
            while pending:
                pending.pop().wait()

        optimizer.register_step_pre_hook(wait_for_snapshot)
    _fences[optimizer].append(fence)


# =========================================================================== load


class FileSource:
    """Tensors of a checkpoint on this rank's storage: memory-mapped, verified on read."""

    def __init__(
        self, path: str, manifest: Manifest, prefix: str = "", progress: Progress | None = None
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.prefix = prefix
        self.progress = progress
        self._files: dict[str, TensorFile] = {}
        self._entries_by_file: dict[str, list[TensorEntry]] | None = None
        self.own: dict[str, str] = {}  # shared name -> this rank's own copy (see own_tensors)

    def for_rank(self, rank: int) -> FileSource:
        source = FileSource(self.path, self.manifest, f"rank{rank}/", self.progress)
        source._files = self._files
        return source

    def _by_file(self) -> dict[str, list[TensorEntry]]:
        if self._entries_by_file is None:
            self._entries_by_file = _entries_by_file(self.manifest)
        return self._entries_by_file

    def entry(self, name: str) -> TensorEntry:
        key = self.own.get(name, self.prefix + name)
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.path}: the manifest refers to tensor {key!r} but does not list it"
            ) from None

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        entry = self.entry(name)
        return dtype_from_name(entry.dtype, self.path), entry.shape

    def get(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.entry(name)
        if entry.file not in self._files:
            size = self.manifest.files[entry.file].size
            mapped = TensorFile(os.path.join(self.path, entry.file), size)
            mapped.check_header(self._by_file()[entry.file])
            self._files[entry.file] = mapped
        file = self._files[entry.file]
        if like is not None and can_read_into(like, entry):
            tensor = file.read_into(entry, like)
        else:
            tensor = file.view(entry)
        if self.progress is not None:
            self.progress.update(entry.nbytes)
        return tensor


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: MutableMapping[str, Any] | None = None,
    strict: bool = True,
    rng: bool = True,
    timeout: float | None = None,
) -> CheckpointInfo:
    """Restore the checkpoint at ``path`` into the live objects; collective.

    Every rank calls it after building its model, optimizer etc. (before or after
    wrapping in DDP or torch.compile). Tensors are read from memory-mapped files and
    copied into the live tensors, so they land on each rank's own devices. Every byte
    read is verified against its checksum.

    Objects not passed are left alone; an object passed but absent from the checkpoint
    is an error naming it. Stateful ``extra`` objects get ``load_state_dict``; plain
    values are written back into the ``extra`` mapping and returned in
    :attr:`CheckpointInfo.extra`. With ``rng`` each rank's random generators are restored
    (ranks the checkpoint has no state for get a deterministic derived state and a
    warning). ``strict=False`` loads the model keys that match and warns about the rest.

    Every check runs before anything is modified. Raises
    :class:`CheckpointNotFoundError`, :class:`StateMismatchError` (listing every
    difference), :class:`CorruptCheckpointError` (naming the file); a checksum error found
    while copying may leave the objects partly updated: load another checkpoint.
    """
    path = os.fspath(path)
    _PERSISTER.join()
    with Comm.open("ddpckpt.load", path=path, timeout=timeout) as comm:
        comm.run("previous save", _PERSISTER.raise_unseen)  # every rank raises if one does
        path = comm.path or path
        manifest = locate(comm, path)
        objects = _Objects(model, optimizer, scheduler, scaler, extra)
        with Progress(f"loading {os.path.basename(path)}", manifest.nbytes) as bar:
            source = FileSource(path, manifest, progress=bar)
            source.own = own_tensors(manifest, comm.rank, path)
            comm.run("check", lambda: _check(manifest, source, objects, strict, path))
            return comm.run(
                "restore", lambda: _restore(manifest, source, objects, strict, rng, path, comm.rank)
            )


def locate(comm: Comm, path: str) -> Manifest:
    """Read the manifest at ``path`` on every rank; collective.

    The decision is the same on every rank: if no rank has a committed checkpoint there,
    :class:`CheckpointNotFoundError` (or the error of an incomplete or corrupt one); if
    some storage domains lack it (node-local disks, a replaced node), they receive a copy
    first (:mod:`ddpckpt.dist.replicate`). Returns this rank's manifest.
    """
    found: dict[str, Manifest] = {}

    def read() -> dict[str, Any]:
        try:
            found["manifest"] = read_manifest(path)
        except CheckpointNotFoundError:
            return {"missing": True}
        except CorruptCheckpointError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"id": found["manifest"].id}

    statuses = comm.run_all("locate", read)
    ids = [s.get("id") for s in statuses]
    present = [i for i in ids if i is not None]
    if not present:
        errors = [s for s in statuses if "error" in s]
        if errors:
            raise error_class(errors[0]["error"])(errors[0]["message"])
        raise CheckpointNotFoundError(f"{path}: no checkpoint at this path")
    if len(set(present)) > 1:
        listing = ", ".join(f"rank {r}: {i}" for r, i in enumerate(ids) if i is not None)
        raise CorruptCheckpointError(
            f"{path}: ranks see different checkpoints under this name ({listing}); node-local "
            "copies from different runs? Remove the stale ones"
        )
    if all(i is not None for i in ids):
        return found["manifest"]
    from ddpckpt.dist.replicate import repair_copies

    repair_copies(comm, path, [i is not None for i in ids])
    return comm.run("reread", lambda: read_manifest(path))


def own_tensors(manifest: Manifest, rank: int, path: str) -> dict[str, str]:
    """Where ``rank``'s own values are of the shared tensors that differed between ranks at
    save time (parameters DDP ignores, a model without DDP ...): shared name -> stored name.

    A rank that did not exist at save time gets none: it loads rank 0's, with a warning.
    """
    if rank < manifest.world_size:
        own = manifest.ranks[rank].get("own", {})
        return {name: f"rank{rank}/{stored}" for name, stored in own.items()}
    if any("own" in r for r in manifest.ranks):
        _log.warning(
            "%s: saved with %d ranks, some state per rank (it differed between ranks); rank %d "
            "has none stored and starts from rank 0's",
            path,
            manifest.world_size,
            rank,
        )
    return {}


@dataclass
class _Objects:
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: Any
    extra: MutableMapping[str, Any] | None


def _check(
    manifest: Manifest, source: FileSource, objects: _Objects, strict: bool, path: str
) -> None:
    state = manifest.state
    present = [k for k in ("model", "optimizer", "scheduler", "scaler") if k in state]
    for name in ("optimizer", "scheduler", "scaler"):
        if getattr(objects, name) is not None and name not in state:
            raise StateMismatchError(
                f"{path}: you passed {name}= but the checkpoint has no {name} state (it holds: "
                f"{', '.join(present)}); leave {name}= out or load a checkpoint saved with one"
            )
    check_model(objects.model, state["model"], source, path, strict)
    if objects.optimizer is not None:
        check_optimizer(objects.optimizer, objects.model, state["optimizer"], path)
    stored_extra = state.get("extra", {})
    for name, obj in (objects.extra or {}).items():
        if name not in stored_extra:
            raise StateMismatchError(
                f"{path}: extra[{name!r}] is not in the checkpoint (it has: "
                f"{', '.join(sorted(stored_extra)) or 'no extra state'})"
            )
        stored, now = stored_extra[name]["kind"], extra_kind(obj)
        if stored != now:
            raise StateMismatchError(
                f"{path}: extra[{name!r}] was saved as {_KINDS[stored]}, but the object passed "
                f"now ({type(obj).__qualname__}) is {_KINDS[now]}"
            )


_KINDS = {
    "value": "a plain value",
    "stateful": "an object with state_dict() shared by all ranks",
    "per_rank": "per-rank state (PerRank, a StatefulDataLoader ...)",
}


def _restore(
    manifest: Manifest,
    source: FileSource,
    objects: _Objects,
    strict: bool,
    rng: bool,
    path: str,
    rank: int,
) -> CheckpointInfo:
    state = manifest.state
    restore_model(objects.model, state["model"], source, path, strict)
    if any("model_buffers" in r for r in manifest.ranks):
        if rank < manifest.world_size and "model_buffers" in manifest.ranks[rank]:
            encoded = manifest.ranks[rank]["model_buffers"]
            restore_rank_buffers(objects.model, encoded, source.for_rank(rank), path)
        else:
            _log.warning(
                "%s: saved with %d ranks and per-rank buffers (broadcast_buffers=False); rank %d "
                "has none stored and starts from rank 0's buffers",
                path,
                manifest.world_size,
                rank,
            )
    if objects.optimizer is not None:
        restore_optimizer(objects.optimizer, objects.model, state["optimizer"], source, path)
    for name in ("scheduler", "scaler"):
        if getattr(objects, name) is not None:
            restore_stateful(getattr(objects, name), state[name], source, path)
    values: dict[str, Any] = {}
    for name, entry in state.get("extra", {}).items():
        if entry["kind"] == "value":
            values[name] = decode(entry["state"], lambda n: source.get(n).clone(), where=path)
    for name, obj in (objects.extra or {}).items():
        entry = state["extra"][name]
        if entry["kind"] == "stateful":
            restore_stateful(obj, entry, source, path)
        elif entry["kind"] == "per_rank":
            owner = _per_rank_owner(manifest, name, rank, path)
            own = {"state": manifest.ranks[owner]["extra"][name]}
            restore_stateful(obj, own, source.for_rank(owner), path)
        else:
            objects.extra[name] = values[name]  # type: ignore[index]
    if rng:
        _restore_rng(manifest, source, path, rank)
    _log.info("loaded checkpoint %s (step %s)", path, manifest.step)
    return CheckpointInfo.from_manifest(path, manifest, values)


def _per_rank_owner(manifest: Manifest, name: str, rank: int, path: str) -> int:
    """Whose saved per-rank state ``rank`` loads: its own, or rank 0's if it has none."""
    if rank < manifest.world_size:
        if name not in manifest.ranks[rank].get("extra", {}):
            raise CorruptCheckpointError(
                f"{path}: no per-rank state of extra[{name!r}] for rank {rank}"
            )
        return rank
    _log.warning(
        "%s: saved with %d ranks, so rank %d has no extra[%r] state of its own; it starts from rank 0's",
        path,
        manifest.world_size,
        rank,
        name,
    )
    return 0


def _restore_rng(manifest: Manifest, source: FileSource, path: str, rank: int) -> None:
    with_rng = [r for r, s in enumerate(manifest.ranks) if "rng" in s]
    if not with_rng:
        _log.warning(
            "%s: the checkpoint holds no RNG state; random generators left as they are", path
        )
        return
    if rank < manifest.world_size:
        if "rng" not in manifest.ranks[rank]:
            raise CorruptCheckpointError(f"{path}: no RNG state stored for rank {rank}")
        rank_source = source.for_rank(rank)
        state = decode(
            manifest.ranks[rank]["rng"], lambda n: rank_source.get(n).clone(), where=path
        )
        restore_rng(state, f"{path} (rank {rank})")
        return
    rank0 = source.for_rank(with_rng[0])
    base = decode(manifest.ranks[with_rng[0]]["rng"], lambda n: rank0.get(n).clone(), where=path)
    _log.warning(
        "%s: saved with %d ranks, so rank %d has no stored RNG state; seeding its generators "
        "deterministically from rank %d's state and its rank number",
        path,
        manifest.world_size,
        rank,
        with_rng[0],
    )
    restore_rng(derive_rng(base, rank), f"{path} (derived for rank {rank})")


# =========================================================================== local readers


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model weights of a checkpoint as plain CPU tensors under canonical keys.

    Not collective: any process may call it, e.g. inference code without an optimizer.
    The tensors are private copies (verified while read); tied weights stay the same
    tensor object. Works with ``model.load_state_dict`` of the unwrapped model.
    """
    path = os.fspath(path)
    manifest = read_manifest(path)
    source = FileSource(path, manifest)
    section = manifest.state["model"]
    weights: dict[str, Any] = {key: source.get(f"model/{key}").clone() for key in section["keys"]}
    for alias, key in section["aliases"].items():
        weights[alias] = weights[key]
    if "extra_state" in section:
        weights.update(decode(section["extra_state"], lambda n: source.get(n).clone(), where=path))
    return weights


def find_problems(path: str | os.PathLike[str]) -> list[str]:
    """Every integrity problem of the checkpoint at ``path`` (empty if it verifies); local."""
    path = os.fspath(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return [str(exc)]
    return _file_problems(path, manifest)


def _file_problems(path: str, manifest: Manifest) -> list[str]:
    problems: list[str] = []
    by_file = _entries_by_file(manifest)
    for name, file in sorted(manifest.files.items()):
        try:
            mapped = TensorFile(os.path.join(path, name), file.size)
            mapped.check_header(by_file.get(name, []))
            if mapped.digest() != file.digest:
                problems.append(f"{os.path.join(path, name)}: file checksum mismatch (corrupt)")
            for entry in by_file.get(name, []):
                mapped.view(entry)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def _entries_by_file(manifest: Manifest) -> dict[str, list[TensorEntry]]:
    by_file: dict[str, list[TensorEntry]] = {name: [] for name in manifest.files}
    for entry in manifest.tensors.values():
        by_file.setdefault(entry.file, []).append(entry)
    return by_file


def verify(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check every file and tensor of a checkpoint against its checksums; local.

    Raises :class:`CheckpointNotFoundError`, :class:`IncompleteCheckpointError` or
    :class:`CorruptCheckpointError` (listing every bad file); returns the checkpoint's
    metadata when everything verifies.
    """
    path = os.fspath(path)
    manifest = read_manifest(path)
    problems = _file_problems(path, manifest)
    if problems:
        raise CorruptCheckpointError(
            f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )
    return CheckpointInfo.from_manifest(path, manifest, {})
