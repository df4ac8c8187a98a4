"""The collective entry points: :func:`save` and :func:`load`; and the local readers.

``save`` and ``load`` are collective under ``torch.distributed``: every rank calls them,
in the same order, with the same arguments (rank 0's path is used everywhere). They
work unchanged in a single process. ``load_state_dict`` and ``verify`` are local: any
process may call them alone.

Save, on every rank, in order:

1. *capture* the training state (no copies; :mod:`ddpckpt.state`);
2. check that every rank holds the same replicated tensors (names, shapes, dtypes);
3. find the storage domains of the target directory (:mod:`ddpckpt.topology`);
4. plan which rank writes which tensor, balanced by bytes (:mod:`ddpckpt.plan`);
5. the first rank of each domain creates a temporary directory; every rank writes its
   files into it (each file by exactly one process) and fsyncs them;
6. the first rank of each domain writes the manifest and commits the directory with an
   atomic rename (:mod:`ddpckpt.storage`).

A failure on any rank at any step raises the same error on every rank; temporary
directories are removed, and nothing committed earlier is touched.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch import nn

from ._log import get_logger
from .comm import Comm
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    InsufficientSpaceError,
    StateMismatchError,
    UnsupportedValueError,
    error_class,
)
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    file_from_json,
    file_to_json,
    read_manifest,
    tensor_from_json,
    tensor_to_json,
)
from .plan import assign, file_names
from .progress import Progress
from .rng import derive_rng, restore_rng
from .state import (
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
from .storage import commit_dir, free_bytes, remove_tree, temp_dir_for, write_bytes_new
from .tensorfile import (
    TensorEntry,
    TensorFile,
    deserialize,
    dtype_from_name,
    serialize,
    tensor_nbytes,
    write_file,
)
from .topology import storage_domains
from .tree import decode, encode

__all__ = ["CheckpointInfo", "load", "load_state_dict", "save", "verify"]

_log = get_logger(__name__)
_FILE_METADATA = {"format": "pt", "writer": "ddpckpt"}


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
    storage: str | None = None,
    timeout: float | None = None,
) -> str:
    """Write the whole training state to the checkpoint directory ``path``; collective.

    Every rank calls it. ``model`` may be wrapped in DDP, DataParallel or torch.compile;
    ``extra`` maps names to objects with ``state_dict()``/``load_state_dict()`` or to plain
    values (numbers, strings, lists, dicts, tensors). ``metrics`` are scalars (numbers,
    0-d tensors, strings). With ``rng`` every rank's random generators are stored.
    ``storage`` is ``"auto"`` (detect), ``"shared"`` or ``"local"``; see
    :mod:`ddpckpt.topology`. ``timeout`` bounds how long a rank waits for a silent one.

    Raises :class:`CheckpointExistsError` if ``path`` is already a checkpoint (pass
    ``overwrite=True`` to replace it atomically), :class:`UnsupportedValueError` naming the
    key of anything that cannot be stored without pickle, :class:`CheckpointWriteError`
    when storage fails. Returns the checkpoint's path (rank 0's).
    """
    path = os.fspath(path)
    header = _header_fields(step, epoch, metrics)
    with Comm.open("ddpckpt.save", path=path, timeout=timeout) as comm:
        snapshot = comm.run(
            "capture",
            lambda: capture(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                extra=extra,
                rng=rng,
            ),
        )
        return persist(comm, snapshot, header, overwrite=overwrite, storage=storage)


def _header_fields(
    step: int | None, epoch: int | None, metrics: Mapping[str, Any] | None
) -> dict[str, Any]:
    for name, value in (("step", step), ("epoch", epoch)):
        if value is not None and (type(value) is not int or value < 0):
            raise TypeError(f"{name} must be a non-negative int or None, got {value!r}")
    plain: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(key, str) or type(value) not in (int, float, bool, str, type(None)):
            raise UnsupportedValueError(
                f"metrics[{key!r}]: metrics must map strings to numbers, strings, bools or "
                f"None (or one-element tensors), got {type(value).__qualname__}"
            )
        plain[key] = value
    return {"step": step, "epoch": epoch, "metrics": encode(plain, "metrics", {})}


def persist(
    comm: Comm,
    snapshot: Snapshot,
    header: Mapping[str, Any],
    *,
    overwrite: bool = False,
    storage: str | None = None,
    domains: list[list[int]] | None = None,
) -> str:
    """Write ``snapshot`` as the checkpoint at ``comm.path`` and commit it; collective.

    ``header`` holds ``step``, ``epoch`` and (encoded) ``metrics``. ``domains`` are the
    storage domains of the parent directory if already known (else they are probed).
    """
    if comm.path is None:
        raise ValueError("persist needs a Comm opened with a path")
    path = comm.path
    _check_replicated(comm, snapshot)
    if domains is None:
        domains = storage_domains(comm, os.path.dirname(os.path.abspath(path)) or ".", storage)
    domain = next(d for d in domains if comm.rank in d)
    leader = domain[0]
    balanced = {n: tensor_nbytes(t) for n, t in snapshot.tensors.items() if n in snapshot.balanced}
    owners = {**dict.fromkeys(snapshot.tensors, leader), **assign(balanced, domain)}
    names = file_names(comm.rank)
    tmp = temp_dir_for(path, comm.token)

    rank_items = [(f"rank{comm.rank}/{n}", t) for n, t in snapshot.rank_tensors.items()]
    rank_blob, rank_file, rank_entries = serialize(
        names["rank"], rank_items, writer=comm.rank, metadata=_FILE_METADATA
    )
    shared_state = snapshot.state
    values = snapshot.tensors
    foreign: dict[int, bytes] = {}
    if len(domains) > 1:  # every domain gets a full copy of rank 0's state and all rank files
        blobs = comm.all_gather("rank-files", rank_blob)
        if comm.rank == leader:
            foreign = {r: b for r, b in enumerate(blobs) if r not in domain}
        state_json = json.dumps(snapshot.state).encode() if comm.rank == 0 else None
        shared_state = json.loads(comm.broadcast("state", state_json))
        pinned = [(n, t) for n, t in snapshot.tensors.items() if n not in snapshot.balanced]
        blob = serialize("rank0", pinned, writer=0, metadata={})[0] if comm.rank == 0 else None
        rank0 = comm.broadcast("rank0-tensors", blob)
        if comm.rank == leader:
            values = {**snapshot.tensors, **deserialize(rank0, path)}

    def prepare() -> None:
        if comm.rank != leader:
            return
        with _storage_errors(path):
            if os.path.lexists(path) and not overwrite:
                raise CheckpointExistsError(
                    f"{path}: a checkpoint already exists here; pass overwrite=True to "
                    "replace it, or save under a new name"
                )
            needed = sum(tensor_nbytes(t) for t in snapshot.tensors.values())
            needed += comm.world_size * (len(rank_blob) + 4096) + (1 << 20)
            free = free_bytes(os.path.dirname(os.path.abspath(path)))
            if free < needed:
                raise InsufficientSpaceError(
                    errno.ENOSPC,
                    f"{path}: the checkpoint needs about {needed / 2**30:.2f} GiB but only "
                    f"{free / 2**30:.2f} GiB are free there; free space (e.g. keep fewer "
                    "checkpoints) or save elsewhere. Nothing was written",
                )
            os.mkdir(tmp)

    def write() -> dict[str, Any]:
        files: list[dict[str, Any]] = []
        tensors: dict[str, dict[str, Any]] = {}
        mine = [(n, t) for n, t in values.items() if owners[n] == comm.rank]
        share = sum(tensor_nbytes(t) for _, t in mine)
        with _storage_errors(path), Progress(f"saving {os.path.basename(path)}", share) as bar:
            for kind, items in (
                (
                    "model",
                    [(n.removeprefix("model/"), t) for n, t in mine if n.startswith("model/")],
                ),
                ("state", [(n, t) for n, t in mine if not n.startswith("model/")]),
            ):
                if not items:
                    continue
                entry, entries = write_file(
                    os.path.join(tmp, names[kind]),
                    items,
                    writer=comm.rank,
                    metadata=_FILE_METADATA,
                    progress=bar.update,
                )
                files.append({"name": entry.name, **file_to_json(entry)})
                prefix = "model/" if kind == "model" else ""
                tensors.update({prefix + e.key: tensor_to_json(e) for e in entries})
            write_bytes_new(os.path.join(tmp, names["rank"]), rank_blob)
            for other, blob in foreign.items():
                write_bytes_new(os.path.join(tmp, file_names(other)["rank"]), blob)
        return {
            "files": files,
            "tensors": tensors,
            "rank_state": snapshot.rank_state,
            "rank_file": {"name": rank_file.name, **file_to_json(rank_file)},
            "rank_tensors": {e.key: tensor_to_json(e) for e in rank_entries},
        }

    def commit(results: list[dict[str, Any]]) -> None:
        if comm.rank != leader:
            return
        manifest = Manifest(
            id=comm.token,
            step=header["step"],
            epoch=header["epoch"],
            metrics=header["metrics"],
            world_size=comm.world_size,
            state=shared_state,
            ranks=[r["rank_state"] for r in results],
            copy={"index": domains.index(domain), "count": len(domains), "ranks": domain},
        )
        order = {name: i for i, name in enumerate(snapshot.tensors)}
        for rank, result in enumerate(results):
            in_domain = rank in domain
            listed = result["files"] if in_domain else []
            for doc in [*listed, result["rank_file"]]:
                writer = doc["writer"] if in_domain else leader
                manifest.files[doc["name"]] = file_from_json(doc["name"], {**doc, "writer": writer})
            for name, doc in {
                **(result["tensors"] if in_domain else {}),
                **result["rank_tensors"],
            }.items():
                manifest.tensors[name] = tensor_from_json(doc)
        manifest.tensors = dict(
            sorted(manifest.tensors.items(), key=lambda kv: order.get(kv[0], len(order)))
        )
        with _storage_errors(path):
            write_bytes_new(os.path.join(tmp, MANIFEST_NAME), manifest.to_json().encode())
            try:
                commit_dir(tmp, path, overwrite=overwrite)
            except FileExistsError:
                raise CheckpointExistsError(f"{path}: another save committed here first") from None
        _log.info("saved checkpoint %s (step %s, %d bytes)", path, header["step"], manifest.nbytes)

    try:
        comm.run("prepare", prepare)
        results = comm.run_all("write", write)
        comm.run("commit", lambda: commit(results))
    except BaseException:
        if comm.rank == leader:
            remove_tree(tmp)
        raise
    return path


def _check_replicated(comm: Comm, snapshot: Snapshot) -> None:
    """Every rank must hold the same replicated tensors: each is written by one of them."""
    if comm.world_size == 1:
        return
    layout = sorted((n, str(t.dtype), list(t.shape)) for n, t in snapshot.tensors.items())
    digest = xxhash.xxh3_64(json.dumps(layout).encode()).hexdigest()
    digests = comm.run_all("layout", lambda: digest)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise StateMismatchError(
            f"ranks {differing} hold training state whose tensors differ (names, shapes or "
            "dtypes) from rank 0's. ddpckpt.save stores DDP-replicated state once, so the "
            "model, optimizer, scheduler, scaler and extra objects must be the same on every "
            "rank; sharded state (FSDP, ZeRO) is not supported"
        )


@contextmanager
def _storage_errors(path: str) -> Iterator[None]:
    """Report file-system failures as :class:`CheckpointWriteError` naming the checkpoint."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        where = exc.filename or path
        raise CheckpointWriteError(
            exc.errno,
            f"{path}: writing the checkpoint failed at {where}: {exc.strerror or exc}. Nothing "
            "was committed; earlier checkpoints are untouched",
        ) from exc


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

    def for_rank(self, rank: int) -> FileSource:
        source = FileSource(self.path, self.manifest, f"rank{rank}/", self.progress)
        source._files = self._files
        return source

    def _by_file(self) -> dict[str, list[TensorEntry]]:
        if self._entries_by_file is None:
            self._entries_by_file = _entries_by_file(self.manifest)
        return self._entries_by_file

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[self.prefix + name]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.path}: the manifest refers to tensor {self.prefix + name!r} but does "
                "not list it"
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
        tensor = self._files[entry.file].view(entry)
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
    with Comm.open("ddpckpt.load", path=path, timeout=timeout) as comm:
        path = comm.path or path
        manifest = locate(comm, path)
        objects = _Objects(model, optimizer, scheduler, scaler, extra)
        with Progress(f"loading {os.path.basename(path)}", manifest.nbytes) as bar:
            source = FileSource(path, manifest, progress=bar)
            comm.run("check", lambda: _check(manifest, source, objects, strict, path))
            return comm.run(
                "restore", lambda: _restore(manifest, source, objects, strict, rng, path, comm.rank)
            )


def locate(comm: Comm, path: str) -> Manifest:
    """Read the manifest at ``path`` on every rank; collective.

    The decision is the same on every rank: if no rank has a committed checkpoint there,
    :class:`CheckpointNotFoundError` (or the error of an incomplete or corrupt one); if
    some storage domains lack it (node-local disks, a replaced node), they receive a copy
    first (:mod:`ddpckpt.replicate`). Returns this rank's manifest.
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
    from .replicate import repair_copies

    repair_copies(comm, path, [i is not None for i in ids])
    return comm.run("reread", lambda: read_manifest(path))


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
