"""Reading a checkpoint on this process's storage, with no other rank involved.

:class:`FileSource` hands out a checkpoint's tensors (memory-mapped, verified on read) to
the collective :func:`ddpckpt.load` and to the restore functions of :mod:`ddpckpt._state`;
:func:`load_state_dict`, :func:`verify` and :func:`find_problems` are local: any process
may call them alone (inference code, the command line).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt import _observe
from ddpckpt._format.codec import decode
from ddpckpt._format.manifest import Manifest, read_manifest
from ddpckpt._format.rankparts import fill_rank_parts
from ddpckpt._format.reshard import Box, overlap, plan_reads
from ddpckpt._format.sections import StateSections
from ddpckpt._format.shardindex import ShardIndex, is_index_file
from ddpckpt._format.shards import Piece, ShardedEntry
from ddpckpt._format.tensorfile import CHUNK, FileEntry, TensorEntry, can_read_into, dtype_from_name
from ddpckpt._format.tensorread import TensorFile
from ddpckpt._io.progress import Progress
from ddpckpt._observe import Access
from ddpckpt.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ddpckpt.storage._location import Location, locate


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`ddpckpt.load` returns: the checkpoint's metadata and plain ``extra`` values.

    :func:`ddpckpt.verify` and :meth:`Checkpointer.info() <ddpckpt.Checkpointer.info>`
    return it too (with ``extra`` empty).

    Attributes:
        path: The checkpoint's path.
        step: The step it was saved with, or ``None``.
        epoch: The epoch it was saved with, or ``None``.
        metrics: The metrics it was saved with.
        extra: The plain (not stateful) ``extra`` values loaded.
        world_size: How many ranks saved it.
        created: When it was saved (seconds since the epoch).
        library_version: The ddpckpt version that wrote it.
        torch_version: The torch version that wrote it.
    """

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
            metrics=read_metrics(manifest, path),
            extra=extra,
            world_size=manifest.world_size,
            created=manifest.created,
            library_version=manifest.library_version,
            torch_version=manifest.torch_version,
        )


def read_metrics(manifest: Manifest, path: str) -> dict[str, Any]:
    """The metrics of the checkpoint at ``path``, decoded; :class:`CorruptCheckpointError`
    if they are no mapping or refer to a tensor (metrics are plain scalars, stored in the
    manifest). :func:`ddpckpt.load` calls it before it changes any object."""

    def fail(name: str) -> torch.Tensor:
        raise CorruptCheckpointError(f"{path}: metrics refer to a tensor ({name})")

    metrics = decode(manifest.metrics, fail, where=path)
    if not isinstance(metrics, dict):
        raise CorruptCheckpointError(f"{path}: the metrics are no mapping")
    return metrics


class FileSource:
    """Tensors of a checkpoint on this rank's storage: memory-mapped, verified on read."""

    def __init__(
        self,
        location: Location,
        manifest: Manifest,
        prefix: str = "",
        progress: Progress | None = None,
    ) -> None:
        self.location, self.path = location, location.path
        self.manifest = manifest
        self.prefix = prefix
        self.progress = progress
        self._files: dict[str, TensorFile] = {}
        self._entries_by_file: dict[str, list[TensorEntry]] | None = None
        self.index = manifest.shard_index(location)
        self._indexed = any(record.indexed for record in manifest.shards.values())
        self._nbytes: int | None = None  # of all the checkpoint's files, once asked
        self.own: dict[str, str] = {}  # shared name -> this rank's own copy (see own_tensors)

    def for_rank(self, rank: int) -> FileSource:
        source = FileSource(self.location, self.manifest, f"rank{rank}/", self.progress)
        source._files, source.index, source._nbytes = self._files, self.index, self._nbytes
        return source

    def _in_file(self, name: str) -> list[TensorEntry]:
        """Every tensor entry of the data file ``name``: the manifest's whole tensors and
        shards, and the shards its writer's index lists (format 6)."""
        if self._entries_by_file is None:
            self._entries_by_file = _entries_by_file(self.manifest, None)
        found = self._entries_by_file.get(name, [])
        if not self._indexed:
            return found  # no index to look up (which would read the writer's file table)
        writer = self.manifest.files[name].writer
        if self.index.file_of(writer) is None:
            return found
        pieces = self.index.index(writer).values()
        return found + [p.entry for p in pieces if p.entry.file == name]

    def pieces(self, name: str, record: ShardedEntry, region: Box) -> list[Piece]:
        """The pieces of the sharded ``name`` that overlap ``region`` (:func:`_pieces_of`)."""
        return _pieces_of(self.prefix + name, record, self.index, region)

    def entry(self, name: str) -> TensorEntry:
        key = self.own.get(name, self.prefix + name)
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.path}: the manifest refers to tensor {key!r} but does not list it"
            ) from None

    def sharded(self, name: str) -> ShardedEntry | None:
        """The record of ``name`` if it is stored as shards."""
        return self.manifest.shards.get(self.prefix + name)

    def meta(self, name: str, region: Box | None = None) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape of the tensor ``name``, once its file (a sharded tensor's: the
        files of its pieces) is opened and checked: a caller may allocate that much, since
        the files hold the bytes. Of a sharded tensor of format 6, the files of the pieces
        that overlap ``region`` (and the index files listing them), none without one:
        opening every piece's would read every writer's index on every rank."""
        record = self.sharded(name)
        if record is None:
            entry = self.entry(name)
            self._file(entry)
            return dtype_from_name(entry.dtype, self.path), entry.shape
        pieces = record.pieces
        if record.indexed:
            inside = region is not None and _inside(region, record.shape)
            pieces = tuple(self.pieces(name, record, region)) if inside else ()  # type: ignore[arg-type]
            if self._nbytes is None:  # summed once: a load asks for every tensor
                self._nbytes = self.manifest.nbytes
            if record.nbytes > self._nbytes:
                raise CorruptCheckpointError(
                    f"{self.path}: sharded tensor {name[:200]!r} has {record.nbytes} bytes, more "
                    f"than all the checkpoint's files ({self._nbytes})"
                )
        for piece in pieces:
            self._file(piece.entry)
        return dtype_from_name(record.dtype, self.path), record.shape

    def _file(self, entry: TensorEntry) -> TensorFile:
        """The file holding ``entry``, opened once; its size and header are checked against
        the manifest before any tensor is read from it."""
        if entry.file not in self._files:
            size = self.manifest.files[entry.file].size
            mapped = TensorFile(self.location.join(entry.file), size)
            mapped.check_header(self._in_file(entry.file))
            self._files[entry.file] = mapped
        return self._files[entry.file]

    def get(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        record = self.sharded(name)
        if record is not None:  # assembled whole, into ``like`` if it fits
            dtype, shape = self.meta(name)
            if like is not None and (like.dtype, tuple(like.shape)) == (dtype, shape):
                target = like
            else:
                target = torch.empty(shape, dtype=dtype)
            self.read_region(name, target, ((0,) * len(shape), shape))
            return target
        entry = self.entry(name)
        file = self._file(entry)
        if like is not None and can_read_into(like, entry):
            tensor = file.read_into(entry, like)
        else:
            tensor = file.view(entry)
        if self.progress is not None:
            self.progress.update(entry.nbytes)
        return tensor

    def read_region(self, name: str, target: torch.Tensor, region: Box) -> None:
        """Copy ``region`` of the stored ``name`` into ``target`` (see
        :meth:`TensorSource.read_region`): of a sharded tensor only the chunks of the
        shards that overlap it are read (:func:`~ddpckpt._format.reshard.plan_reads`), each
        verified; of a tensor stored whole, the chunks around the region where its manifest
        has a digest per chunk (tensors above one chunk, since 2026-11-28), else all of it,
        mapped and verified whole."""
        record = self.sharded(name)
        if record is not None:
            dtype = dtype_from_name(record.dtype, self.path)
            pieces = [(p.entry, p.offsets, p.shape) for p in self.pieces(name, record, region)]
            self._read_pieces(pieces, dtype, record.chunk, target, region)
            return
        entry = self.entry(name)
        if entry.chunks and entry.shape:
            dtype = dtype_from_name(entry.dtype, self.path)
            self._read_pieces([(entry, (0,) * len(entry.shape), entry.shape)], dtype, CHUNK,
                              target, region)  # fmt: skip
            return
        whole = self.get(name)
        target.copy_(whole[tuple(slice(o, o + n) for o, n in zip(*region, strict=True))])

    def _read_pieces(
        self,
        pieces: list[tuple[TensorEntry, tuple[int, ...], tuple[int, ...]]],
        dtype: torch.dtype,
        chunk: int,
        target: torch.Tensor,
        region: Box,
    ) -> None:
        """Copy ``region`` of a tensor stored as ``pieces`` (entry, offsets, shape; each with
        a digest per ``chunk`` bytes) into ``target``, reading only the chunks that overlap
        it (:func:`~ddpckpt._format.reshard.plan_reads`), each verified."""
        boxes = [(offsets, shape) for _, offsets, shape in pieces]
        for read in plan_reads(boxes, region, itemsize=dtype.itemsize, chunk=chunk):
            entry, _, piece_shape = pieces[read.piece]
            data = self._file(entry).read_chunks(entry, *read.chunks, chunk)
            row_bytes = math.prod(piece_shape[1:]) * dtype.itemsize
            start = read.rows[0] * row_bytes - read.chunks[0] * chunk
            count = read.rows[1] - read.rows[0]
            shape = (count, *piece_shape[1:]) if piece_shape else ()
            rows = data[start : start + count * row_bytes].view(dtype).reshape(shape)
            target[read.target].copy_(rows[read.source])
            if self.progress is not None:
                self.progress.update(len(data))


def _inside(region: Box, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` lies in a tensor of ``shape`` (a live tensor of another shape is
    reported by the load's checks, not read)."""
    offsets, extent = region
    return len(offsets) == len(shape) and all(
        o >= 0 and o + n <= s for o, n, s in zip(offsets, extent, shape, strict=True)
    )


def chosen_model(path: str, stored: StateSections, model: str | None) -> str:
    """The name of the model to read: ``model``, or the only one; else an error naming them."""
    models = stored.models
    if model is None and len(models) == 1:
        return next(iter(models))
    if model not in models:
        names = ", ".join(repr(n) for n in models) or "none"
        raise StateMismatchError(
            f"{path}: pass model=NAME to choose the weights to read (its models: {names}; "
            "with ddpckpt export: --model NAME)"
            if model is None
            else f"{path}: has no model {model!r} (its models: {names})"
        )
    return model


def load_state_dict(path: str | os.PathLike[str], model: str | None = None) -> dict[str, Any]:
    """The model weights of a checkpoint as plain CPU tensors under canonical keys; local.

    Not collective: any one process may call it, e.g. inference code without an
    optimizer. The tensors are private copies (verified while read); tied weights stay the
    same tensor object. The keys have no ``module.`` or ``_orig_mod.`` prefix, so the
    result fits ``model.load_state_dict`` of the unwrapped model.

    Args:
        path: A committed checkpoint directory (or URL).
        model: The name of the model to read; needed for a checkpoint of several models
            (a :class:`~ddpckpt.TrainingState`).

    Returns:
        Parameter and buffer names mapped to tensors (and the model's extra state).

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        StateMismatchError: ``model`` is needed or names no model of the checkpoint.
        CorruptCheckpointError: A tensor does not match its checksum.
    """
    path = _observe.place(path, "load_state_dict", Access.READ)
    location = locate(path)
    manifest = read_manifest(location)
    stored = StateSections.from_json(manifest.state, path)
    model = chosen_model(path, stored, model)
    section, prefix = stored.models[model], stored.layout.model_prefix(model)
    source = FileSource(location, manifest)
    weights: dict[str, Any] = {key: _private(source, prefix + key) for key in section.keys}
    for alias, key in section.aliases.items():
        weights[alias] = weights[key]
    if section.extra_state is not None:
        weights.update(decode(section.extra_state, lambda n: source.get(n).clone(), where=path))
    return weights


def _private(source: FileSource, name: str) -> torch.Tensor:
    """The tensor ``name`` in memory of its own (a sharded one is assembled so already)."""
    tensor = source.get(name)
    return tensor if source.sharded(name) is not None else tensor.clone()


def find_problems(location: Location) -> list[str]:
    """Every integrity problem of the checkpoint at ``location`` (empty if it verifies);
    local."""
    try:
        manifest = read_manifest(location)
    except CheckpointError as exc:
        return [str(exc)]
    return _file_problems(location, manifest)


def _file_problems(location: Location, manifest: Manifest) -> list[str]:
    path = location.path
    problems = fill_rank_parts(manifest, location)  # the rank files' tensors join the index
    try:
        StateSections.from_json(manifest.state, path)  # what load parses, checked here too
    except CorruptCheckpointError as exc:
        problems.append(str(exc))
    files = manifest.files.readable(problems)  # a damaged file table is one problem
    pieces, unlisted = _indexed_pieces(location, manifest, files, problems)
    unlisted |= manifest.files.unreadable_ranks()  # their shards' indexes are unknown
    by_file = _entries_by_file(manifest, pieces)
    chunks = {p.entry.key: manifest.shards[n].chunk for n, ps in pieces.items() for p in ps}
    # a whole tensor's chunk digests are per CHUNK bytes
    for name, file in sorted(files.items()):
        if is_index_file(name) or name in manifest.files.tables or file.writer in unlisted:
            continue  # read and verified as read; or its shards are unknown
        try:
            mapped = TensorFile(location.join(name), file.size)
            mapped.check_header(by_file.get(name, []))
            if mapped.digest() != file.digest:
                problems.append(f"{os.path.join(path, name)}: file checksum mismatch (corrupt)")
            for entry in by_file.get(name, []):
                mapped.view(entry)
                problems += mapped.chunk_problems(entry, chunks.get(entry.key, CHUNK))
        except CheckpointError as exc:
            problems.append(str(exc))
    return list(dict.fromkeys(problems))  # a damaged table is met once per file it lists


def _indexed_pieces(
    location: Location, manifest: Manifest, files: dict[str, FileEntry], problems: list[str]
) -> tuple[dict[str, list[Piece]], set[int]]:
    """Every shard of the checkpoint and the ranks whose shard index could not be read
    (their data files cannot be checked against it): each index read once, each problem
    (a damaged index, a shard no index lists) added to ``problems``."""
    index = manifest.shard_index(location)
    found = _listed_pieces(manifest)
    unlisted = set()
    for name, file in files.items():
        if is_index_file(name):
            rank = file.writer
            try:
                for tensor, piece in index.index(rank).items():
                    found.setdefault(tensor, []).append(piece)
            except CheckpointError as exc:
                problems.append(str(exc))
                unlisted.add(rank)
    for name, record in manifest.shards.items():  # every shard listed, where it should be
        if record.indexed and not unlisted:
            try:
                _pieces_of(name, record, index)
            except CheckpointError as exc:
                problems.append(str(exc))
    return found, unlisted


def all_pieces(location: Location, manifest: Manifest) -> dict[str, list[Piece]]:
    """Every piece of every sharded tensor of the checkpoint at ``location``, of format 6
    read from every writer's index (what the tools that list or compare shards need);
    local."""
    return _all_pieces(manifest, manifest.shard_index(location))


def _all_pieces(manifest: Manifest, index: ShardIndex) -> dict[str, list[Piece]]:
    return {name: _pieces_of(name, record, index) for name, record in manifest.shards.items()}


def _pieces_of(
    name: str, record: ShardedEntry, index: ShardIndex, region: Box | None = None
) -> list[Piece]:
    """The pieces of the sharded ``name`` that overlap ``region`` (all without one), in
    offset order: of format 6 from the index files of the ranks that wrote them (only
    those), of format 5 from the manifest."""
    if region is None:
        region = ((0,) * len(record.shape), record.shape)
    if record.indexed:
        return sorted(index.pieces(name, region), key=lambda p: p.offsets)
    return [p for p in record.pieces if overlap((p.offsets, p.shape), region) is not None]


def _listed_pieces(manifest: Manifest) -> dict[str, list[Piece]]:
    """The pieces the manifest itself lists (format 5's)."""
    return {n: list(r.pieces) for n, r in manifest.shards.items() if not r.indexed}


def _entries_by_file(
    manifest: Manifest, pieces: dict[str, list[Piece]] | None
) -> dict[str, list[TensorEntry]]:
    """Every tensor entry of each data file: whole tensors, and the shards in ``pieces``
    (by default those the manifest lists: format 5's)."""
    if pieces is None:
        pieces = _listed_pieces(manifest)
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in manifest.tensors.values():
        by_file.setdefault(entry.file, []).append(entry)
    for parts in pieces.values():
        for piece in parts:
            by_file.setdefault(piece.entry.file, []).append(piece.entry)
    return by_file


def verify(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check every file and tensor of a checkpoint against its checksums; local.

    Args:
        path: A checkpoint directory (or URL).

    Returns:
        The checkpoint's metadata, when everything verifies.

    Raises:
        CheckpointNotFoundError: No checkpoint at ``path``.
        IncompleteCheckpointError: The manifest or a file it lists is missing.
        CorruptCheckpointError: Bytes do not match their checksums (lists every bad file).
    """
    path = _observe.place(path, "verify", Access.READ)
    location = locate(path)
    manifest = read_manifest(location)
    problems = _file_problems(location, manifest)
    if problems:
        raise CorruptCheckpointError(
            f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )
    return CheckpointInfo.from_manifest(path, manifest, {})
