"""The checkpoint manifest: ``manifest.json``, written last, whose presence commits a checkpoint.

A checkpoint is a directory::

    manifest.json                       this file
    model-00000.safetensors ...         model weights (canonical keys), one file per writer
    state-00000.safetensors ...         optimizer, scheduler, scaler and extra tensors
    rank-00000.safetensors ...          per-rank state and tensors (RNG ...), one file per rank

The manifest holds the format version, the library and torch versions, step, epoch and
metrics, the encoded non-tensor state (see :mod:`ddpckpt._format.codec`), the sections of
per-rank state (the state itself is in the rank files: :mod:`ddpckpt._format.rankparts`),
and for every shared tensor its file, byte range, dtype, shape and digest (a sharded one:
each of its shards, :mod:`ddpckpt._format.shards`), and for every file its size, digest
and the rank that wrote it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ddpckpt._format.codec import JSON
from ddpckpt._format.sections import layout_version
from ddpckpt._format.shards import ShardedEntry
from ddpckpt._format.tensorfile import FileEntry, TensorEntry
from ddpckpt._version import __version__
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ddpckpt.storage import storage_for
from ddpckpt.storage._base import MANIFEST

FORMAT_NAME = "ddpckpt"
# The newest version this library reads. A checkpoint is written with the oldest version that
# describes it: 3 puts per-rank state in the rank files (ddpckpt._format.rankparts), 4 the
# named layout of several models and optimizers (ddpckpt._format.sections), 5 sharded
# tensors (ddpckpt._format.shards).
FORMAT_VERSION = 5
RANK_FILES_VERSION = 3
SHARDS_VERSION = 5
MANIFEST_NAME = MANIFEST


@dataclass
class Manifest:
    """Everything about a checkpoint except the tensor bytes."""

    id: str = ""
    step: int | None = None
    epoch: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    state: dict[str, JSON] = field(default_factory=dict)
    ranks: list[dict[str, JSON]] = field(default_factory=list)  # format 2: every rank's state
    rank_keys: list[str] | None = None  # format 3: the sections in the rank files (rankparts)
    rank_parts: dict[int, dict[str, JSON]] = field(default_factory=dict, repr=False, compare=False)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    shards: dict[str, ShardedEntry] = field(default_factory=dict)  # format 5: sharded tensors
    files: dict[str, FileEntry] = field(default_factory=dict)
    copy: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    library_version: str = __version__
    torch_version: str = torch.__version__
    host: str = field(default_factory=platform.node)
    # 0 until written or read: then the version it was written with (derived, not compared)
    format_version: int = field(default=0, compare=False)

    def oldest_version(self) -> int:
        """The oldest format version that describes this manifest (what it is written with)."""
        rank_files = RANK_FILES_VERSION if self.rank_keys is not None else 0
        shards = SHARDS_VERSION if self.shards else 0
        return max(layout_version(self.state), rank_files, shards)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version or self.oldest_version(),
            "id": self.id,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "host": self.host,
            "step": self.step,
            "epoch": self.epoch,
            "metrics": self.metrics,
            "world_size": self.world_size,
            "copy": self.copy,
            "state": self.state,
            "ranks": self.ranks if self.rank_keys is None else [],
            **({} if self.rank_keys is None else {"rank_keys": self.rank_keys}),
            "files": {name: file_to_json(f) for name, f in sorted(self.files.items())},
            "tensors": {name: tensor_to_json(t) for name, t in self.tensors.items()},
            **({"shards": {n: s.to_json() for n, s in self.shards.items()}} if self.shards else {}),
        }
        return _with_checksum(doc)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({exc})") from exc
        if isinstance(doc, dict):
            _check_version(doc, where)
            claimed = doc.pop(_CHECKSUM_KEY, None)
            if claimed != _digest(doc):
                raise CorruptCheckpointError(
                    f"{where}: {MANIFEST_NAME} fails its checksum: the manifest is corrupt"
                )
        return _parse(doc, where)


_CHECKSUM_KEY = "manifest_xxh3_64"


def _check_version(doc: dict[str, Any], where: str) -> int:
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: malformed manifest: not a ddpckpt manifest")
    version = doc.get("format_version")
    if type(version) is not int:
        raise CorruptCheckpointError(f"{where}: malformed manifest: format_version missing")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: written with format version {version} by ddpckpt "
            f"{doc.get('library_version')}; this ddpckpt ({__version__}) reads up to version "
            f"{FORMAT_VERSION}. Upgrade ddpckpt to load it."
        )
    return version


def _digest(doc: dict[str, Any]) -> str:
    body = json.dumps(doc, indent=1, allow_nan=False)
    return xxhash.xxh3_64(body.encode()).hexdigest()


def _with_checksum(doc: dict[str, Any]) -> str:
    """The manifest's JSON with a last field holding the digest of the JSON without it.

    Reading re-serialises the parsed document the same way, which reproduces the text
    exactly (key order is kept and floats print round-trip exact).
    """
    return json.dumps({**doc, _CHECKSUM_KEY: _digest(doc)}, indent=1, allow_nan=False)


def _parse(doc: Any, where: str) -> Manifest:
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed manifest: {what}")

    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    version = _check_version(doc, where)
    try:
        files = {name: file_from_json(name, f) for name, f in doc["files"].items()}
        tensors = {name: tensor_from_json(t) for name, t in doc["tensors"].items()}
        shards = _shards_from_json(doc.get("shards", {}), where)
        manifest = Manifest(
            id=str(doc.get("id", "")),
            step=doc.get("step"),
            epoch=doc.get("epoch"),
            metrics=dict(doc.get("metrics") or {}),
            world_size=int(doc["world_size"]),
            state=dict(doc["state"]),
            ranks=list(doc["ranks"]),
            rank_keys=None if doc.get("rank_keys") is None else list(doc["rank_keys"]),
            tensors=tensors,
            shards=shards,
            files=files,
            copy=dict(doc.get("copy") or {}),
            created=float(doc["created"]),
            library_version=str(doc["library_version"]),
            torch_version=str(doc["torch_version"]),
            host=str(doc.get("host", "")),
            format_version=version,
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from exc
    for name, tensor in tensors.items():
        if tensor.file not in files:
            raise bad(f"tensor {name!r} refers to unlisted file {tensor.file!r}")
    for name, sharded in shards.items():
        if name in tensors:
            raise bad(f"tensor {name!r} is listed both whole and sharded")
        for piece in sharded.pieces:
            if piece.entry.file not in files:
                raise bad(f"a shard of {name!r} refers to unlisted file {piece.entry.file!r}")
    return manifest


def _shards_from_json(doc: Any, where: str) -> dict[str, ShardedEntry]:
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: malformed manifest: shards not a JSON object")
    return {
        str(name): ShardedEntry.from_json(record, f"{where} (sharded tensor {name!r})")
        for name, record in doc.items()
    }


def file_to_json(entry: FileEntry) -> dict[str, Any]:
    return {"size": entry.size, "xxh3_64": entry.digest, "writer": entry.writer}


def file_from_json(name: str, doc: dict[str, Any]) -> FileEntry:
    return FileEntry(name, int(doc["size"]), str(doc["xxh3_64"]), int(doc["writer"]))


def tensor_to_json(entry: TensorEntry) -> dict[str, Any]:
    return {
        "file": entry.file,
        "key": entry.key,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "offsets": [entry.begin, entry.end],
        "xxh3_64": entry.digest,
    }


def tensor_from_json(doc: dict[str, Any]) -> TensorEntry:
    return TensorEntry(
        file=str(doc["file"]),
        key=str(doc["key"]),
        dtype=str(doc["dtype"]),
        shape=tuple(int(d) for d in doc["shape"]),
        begin=int(doc["offsets"][0]),
        end=int(doc["offsets"][1]),
        digest=str(doc["xxh3_64"]),
    )


def manifest_path(path: str) -> str:
    return os.path.join(path, MANIFEST_NAME)


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the checkpoint directory ``path``.

    Raises :class:`~ddpckpt.errors.CheckpointNotFoundError` if ``path`` does not exist,
    :class:`~ddpckpt.errors.IncompleteCheckpointError` if it exists without a manifest
    (an interrupted save), :class:`~ddpckpt.errors.CorruptCheckpointError` if the
    manifest cannot be parsed.
    """
    storage = storage_for(path)
    if not storage.is_dir(path):
        if storage.exists(path):
            raise CheckpointNotFoundError(
                f"{path}: is a file, not a ddpckpt checkpoint directory; to convert a "
                "torch.save file run `ddpckpt import`"
            )
        raise CheckpointNotFoundError(f"{path}: no checkpoint at this path")
    try:
        text = storage.read(manifest_path(path))
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{path}: has no {MANIFEST_NAME}; the save that created it did not finish"
        ) from None
    return Manifest.from_json(text, path)
