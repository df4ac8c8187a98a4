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

import dataclasses
import json
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ddpckpt._format.boundary import (
    MAX_MANIFEST_BYTES,
    MAX_RANKS,
    Fields,
    check_file_name,
    load_json,
    read_small,
)
from ddpckpt._format.codec import JSON
from ddpckpt._format.filetable import FileTable, file_entry, file_to_json, tables_from_json
from ddpckpt._format.manifestfields import (
    copy_from_json,
    meshes_from_json,
    meshes_to_json,
    shards_from_json,
    tensor_entry,
    tensor_to_json,
)
from ddpckpt._format.runfiles import describe_path
from ddpckpt._format.shardgrid import MeshRanks
from ddpckpt._format.shardindex import ShardIndex
from ddpckpt._format.shards import ShardedEntry
from ddpckpt._format.statelayout import layout_version
from ddpckpt._format.tensorfile import TensorEntry
from ddpckpt._version import __version__
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedValueError,
)
from ddpckpt.storage._commit import register_relocation
from ddpckpt.storage._layout import MANIFEST
from ddpckpt.storage._location import Location

FORMAT_NAME = "ddpckpt"
# The newest version this library reads. A checkpoint is written with the oldest version that
# describes it: 3 puts per-rank state in the rank files (ddpckpt._format.rankparts), 4 the
# named layout of several models and optimizers (ddpckpt._format.statelayout), 5 sharded
# tensors (ddpckpt._format.shards), 6 their pieces in the writers' index files
# (ddpckpt._format.shardindex), 7 the files of a job of many ranks in file tables
# (ddpckpt._format.filetable) and at most shard_writers replicas writing a shard's tensors
# (ddpckpt._format.shardgrid.SHARD_WRITERS).
FORMAT_VERSION = 7
RANK_FILES_VERSION = 3
SHARDS_VERSION = 5
SHARD_INDEX_VERSION = 6
FILE_TABLES_VERSION = 7
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
    meshes: dict[str, MeshRanks] = field(default_factory=dict)  # format 6: their meshes' ranks
    shard_writers: int | None = None  # format 7: the most replicas of a shard that write it
    files: FileTable = field(default_factory=FileTable)  # format 7: some in file tables
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
        if any(s.indexed for s in self.shards.values()):
            shards = SHARD_INDEX_VERSION
        tables = FILE_TABLES_VERSION if self.files.tables or self.shard_writers else 0
        return max(layout_version(self.state), rank_files, shards, tables)

    @property
    def nbytes(self) -> int:
        """The bytes of all its files (of format 7 without reading a table)."""
        return self.files.nbytes

    def shard_index(self, location: Location) -> ShardIndex:
        """Where the pieces of this checkpoint's sharded tensors are (format 6), for the
        checkpoint at ``location``; local."""
        count = self.copy.get("count", 1)
        domain = self.copy.get("ranks") if count > 1 else None
        return ShardIndex(
            location, self.id, self.shards, self.meshes, self.files, domain, self.shard_writers
        )

    def to_json(self, where: str) -> str:
        """The manifest's text; ``where`` names the checkpoint in the error of one too big
        to be read back."""
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
            "files": {name: file_to_json(f) for name, f in sorted(self.files.inline.items())},
            **({"file_tables": self.files.tables_to_json()} if self.files.tables else {}),
            "tensors": {name: tensor_to_json(t) for name, t in self.tensors.items()},
            **({"shards": {n: s.to_json() for n, s in self.shards.items()}} if self.shards else {}),
            **({"meshes": meshes_to_json(self.meshes)} if self.meshes else {}),
            **({"shard_writers": self.shard_writers} if self.shard_writers else {}),
        }
        text = _with_checksum(doc)
        if len(text) > MAX_MANIFEST_BYTES:  # what could not be read back is not written
            raise UnsupportedValueError(
                f"{where}: the manifest would be {len(text)} bytes, over the {MAX_MANIFEST_BYTES} a "
                "checkpoint's manifest may have: store large values (long lists, big dicts) "
                "as tensors"
            )
        return text

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse and check a manifest (see :func:`_parse`); ``where`` names the checkpoint."""
        doc = load_json(text, where, "manifest", limit=MAX_MANIFEST_BYTES)
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
    if type(version) is not int or version < 1:
        raise CorruptCheckpointError(f"{where}: malformed manifest: format_version missing")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: written with format version {version} by ddpckpt "
            f"{str(doc.get('library_version'))[:40]}; this ddpckpt ({__version__}) reads up to "
            f"version {FORMAT_VERSION}. Upgrade ddpckpt to load it."
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
    """The manifest ``doc`` as a :class:`Manifest`, every field checked (types, ranges,
    file names, each tensor's range against its file's size) before anything uses it."""
    fields = Fields(doc, where, "manifest")
    version = _check_version(doc, where)
    world_size = fields.integer("world_size", 1, MAX_RANKS)
    token = fields.text("id", "")
    inline = {
        name: file_entry(check_file_name(name, where), entry, where, world_size)
        for name, entry in fields.mapping("files").items()
    }
    files = tables_from_json(
        fields.mapping("file_tables", None) if version >= FILE_TABLES_VERSION else None,
        where, inline, token, world_size,
    )  # fmt: skip
    tensors = {
        key: tensor_entry(key, entry, where, files)
        for key, entry in fields.mapping("tensors").items()
    }
    ranks = fields.sequence("ranks")
    if len(ranks) > world_size or not all(isinstance(r, dict) for r in ranks):
        raise fields.error(f"is not a list of at most {world_size} JSON objects", "ranks")
    rank_keys = fields.sequence("rank_keys", None)
    if rank_keys is not None and not all(isinstance(k, str) for k in rank_keys):
        raise fields.error("holds a value that is not a string", "rank_keys")
    meshes = meshes_from_json(fields.mapping("meshes", None) or {}, where, world_size)
    shards = shards_from_json(fields.mapping("shards", None) or {}, where, files, tensors, meshes)
    return Manifest(
        id=token,
        step=fields.integer("step", default=None, optional=True),
        epoch=fields.integer("epoch", default=None, optional=True),
        metrics=fields.mapping("metrics", None) or {},
        world_size=world_size,
        state=fields.mapping("state"),
        ranks=ranks,
        rank_keys=rank_keys,
        tensors=tensors,
        shards=shards,
        meshes=meshes,
        shard_writers=(
            fields.integer("shard_writers", 1, MAX_RANKS, None)
            if version >= FILE_TABLES_VERSION
            else None
        ),
        files=files,
        copy=copy_from_json(fields.mapping("copy", None) or {}, where, world_size),
        created=fields.number("created"),
        library_version=fields.text("library_version"),
        torch_version=fields.text("torch_version"),
        host=fields.text("host", ""),
        format_version=version,
    )


def read_manifest(location: Location) -> Manifest:
    """Read and validate the manifest of the checkpoint directory ``location``, bound to it
    (its file tables are read from there).

    Raises :class:`~ddpckpt.errors.CheckpointNotFoundError` if ``location`` does not exist
    or is no checkpoint (a run directory, one of its files, an unrelated directory: the
    message says which), :class:`~ddpckpt.errors.IncompleteCheckpointError` if it is a
    checkpoint directory without a manifest (an interrupted save),
    :class:`~ddpckpt.errors.CorruptCheckpointError` if the manifest cannot be parsed or is
    no regular file.
    """
    storage, path = location.storage, location.path
    if not storage.is_dir(path):
        if storage.exists(path):
            raise CheckpointNotFoundError(describe_path(location) or _describe_file(path))
        raise CheckpointNotFoundError(f"{path}: no checkpoint at this path")
    try:
        text = read_small(location.join(MANIFEST_NAME), MAX_MANIFEST_BYTES, "manifest")
    except FileNotFoundError:
        what = describe_path(location)
        if what is not None:
            raise CheckpointNotFoundError(what) from None
        raise IncompleteCheckpointError(
            f"{path}: has no {MANIFEST_NAME}; the save that created it did not finish"
        ) from None
    return manifest_at(text, location)


def manifest_at(text: str | bytes, location: Location) -> Manifest:
    """Parse and check ``text``, the manifest of the checkpoint at ``location``, bound to it
    (its file tables are read from there)."""
    manifest = Manifest.from_json(text, location.path)
    manifest.files.bind(location)
    return manifest


def _describe_file(path: str) -> str:
    """The message for a file named where a checkpoint directory was expected."""
    if path.endswith(".safetensors"):
        return (
            f"{path}: a safetensors file (tensors only), not a ddpckpt checkpoint directory; "
            "read it with safetensors.torch.load_file (`ddpckpt import` converts torch.save "
            "files and Lightning .ckpt files)"
        )
    return (
        f"{path}: is a file, not a ddpckpt checkpoint directory (a directory holding "
        f"{MANIFEST_NAME}); if it is a torch.save file or a Lightning .ckpt file, "
        "`ddpckpt import` converts it"
    )


def relocated(manifest: bytes, prefix: str, where: str) -> bytes:
    """``manifest`` with every object name under ``prefix/``: what an object-store
    replacement written under ``D/prefix`` commits as ``D``'s manifest
    (:class:`ddpckpt.storage.ManifestLastCommit`)."""
    parsed = Manifest.from_json(manifest, where)
    parsed.files = parsed.files.relocated(prefix)
    parsed.tensors = {
        key: dataclasses.replace(entry, file=f"{prefix}/{entry.file}")
        for key, entry in parsed.tensors.items()
    }
    return parsed.to_json(where).encode()


register_relocation(relocated)
