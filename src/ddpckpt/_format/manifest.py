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
import math
import os
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
    check_int,
    load_json,
    read_small,
)
from ddpckpt._format.codec import JSON
from ddpckpt._format.filetable import (
    DIGEST,
    FileTable,
    digest_field,
    file_entry,
    file_to_json,
    tables_from_json,
)
from ddpckpt._format.runfiles import describe_path
from ddpckpt._format.sections import layout_version
from ddpckpt._format.shardgrid import MeshRanks
from ddpckpt._format.shardindex import ShardIndex
from ddpckpt._format.shards import ShardedEntry, chunk_count
from ddpckpt._format.tensorfile import CHUNK, FileEntry, TensorEntry, checked_layout
from ddpckpt._version import __version__
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedValueError,
)
from ddpckpt.storage import storage_for
from ddpckpt.storage._commit import register_relocation
from ddpckpt.storage._layout import MANIFEST

FORMAT_NAME = "ddpckpt"
# The newest version this library reads. A checkpoint is written with the oldest version that
# describes it: 3 puts per-rank state in the rank files (ddpckpt._format.rankparts), 4 the
# named layout of several models and optimizers (ddpckpt._format.sections), 5 sharded
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

    def shard_index(self, path: str) -> ShardIndex:
        """Where the pieces of this checkpoint's sharded tensors are (format 6), for the
        checkpoint at ``path``; local."""
        count = self.copy.get("count", 1)
        domain = self.copy.get("ranks") if count > 1 else None
        return ShardIndex(
            path, self.id, self.shards, self.meshes, self.files, domain, self.shard_writers
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
            **({"meshes": _meshes_to_json(self.meshes)} if self.meshes else {}),
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
        key: _tensor_entry(key, entry, where, files)
        for key, entry in fields.mapping("tensors").items()
    }
    ranks = fields.sequence("ranks")
    if len(ranks) > world_size or not all(isinstance(r, dict) for r in ranks):
        raise fields.error(f"is not a list of at most {world_size} JSON objects", "ranks")
    rank_keys = fields.sequence("rank_keys", None)
    if rank_keys is not None and not all(isinstance(k, str) for k in rank_keys):
        raise fields.error("holds a value that is not a string", "rank_keys")
    meshes = _meshes(fields.mapping("meshes", None) or {}, where, world_size)
    shards = _shards_from_json(fields.mapping("shards", None) or {}, where, files, tensors, meshes)
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
        copy=_copy(fields.mapping("copy", None) or {}, where, world_size),
        created=fields.number("created"),
        library_version=fields.text("library_version"),
        torch_version=fields.text("torch_version"),
        host=fields.text("host", ""),
        format_version=version,
    )


def _tensor_entry(key: str, doc: Any, where: str, files: FileTable) -> TensorEntry:
    fields = Fields(doc, where, lambda: f"manifest entry of tensor {key[:200]!r}")
    file = fields.text("file")
    if file not in files:
        raise fields.error(f"names {file[:200]!r}, a file the manifest does not list", "file")
    dtype, shape, begin, end = checked_layout(fields, files[file].size)
    return TensorEntry(
        file, fields.text("key", max_length=1 << 16), dtype, shape, begin, end,
        digest_field(fields, "xxh3_64"), _chunk_digests(fields, end - begin),
    )  # fmt: skip


def _chunk_digests(fields: Fields, nbytes: int) -> tuple[str, ...]:
    """A whole tensor's digest per :data:`CHUNK` (optional; written for tensors above one
    chunk since 2026-11-28): exactly one per chunk of its bytes, or none."""
    found = fields.value("chunks", None)
    if found is None:
        return ()
    if not isinstance(found, list) or len(found) != chunk_count(nbytes, CHUNK):
        raise fields.error(f"is not one digest per {CHUNK} bytes of the tensor", "chunks")
    if not all(isinstance(c, str) and DIGEST.fullmatch(c) for c in found):
        raise fields.error("holds a value that is not an xxh3-64 digest", "chunks")
    return tuple(found)


def _copy(doc: Any, where: str, world_size: int) -> dict[str, Any]:
    """Which copy of a checkpoint this is (node-local storage keeps one per node)."""
    fields = Fields(doc, where, "manifest field 'copy'")
    if not doc:
        return {}
    count = fields.integer("count", 1, MAX_RANKS, 1)
    copy = {"index": fields.integer("index", 0, count - 1, 0), "count": count}
    if "partners" in doc:  # a node's copy keeping some ranks' own files (format 3 and on)
        copy["partners"] = fields.integer("partners", 1, MAX_RANKS)
    if "ranks" in doc:
        ranks = fields.sequence("ranks")
        copy["ranks"] = [
            check_int(r, 0, world_size - 1, lambda p: fields.error(p, "ranks")) for r in ranks
        ]
        if len(set(copy["ranks"])) != len(copy["ranks"]):
            raise fields.error("lists a rank twice", "ranks")
    return copy


def _meshes_to_json(meshes: dict[str, MeshRanks]) -> dict[str, list[list[int]]]:
    return {key: [list(run) for run in mesh.runs] for key, mesh in meshes.items()}


def _meshes(doc: dict[str, Any], where: str, world_size: int) -> dict[str, MeshRanks]:
    """The rank orders of the meshes of sharded tensors (format 6): runs of ranks."""
    fields = Fields(doc, where, "manifest field 'meshes'")

    meshes = {}
    for key in doc:

        def bad(problem: str, key: str = key) -> CorruptCheckpointError:
            return fields.error(problem, key)

        pairs = []
        for run in fields.sequence(key):
            if not (isinstance(run, list) and len(run) == 2):
                raise bad("is not a list of [first rank, count] pairs")
            first = check_int(run[0], 0, world_size - 1, bad)
            pairs.append((first, check_int(run[1], 1, world_size - first, bad)))
        covered = 0  # every mesh lists every rank of the job once (ddpckpt._state.dtensor)
        for first, count in sorted(pairs):
            if first != covered:
                raise bad(f"does not list each of the {world_size} ranks once")
            covered += count
        if covered != world_size:
            raise bad(f"does not list each of the {world_size} ranks once")
        meshes[key] = MeshRanks(tuple(pairs))
    return meshes


def _shards_from_json(
    doc: dict[str, Any],
    where: str,
    files: FileTable,
    tensors: dict[str, TensorEntry],
    meshes: dict[str, MeshRanks],
) -> dict[str, ShardedEntry]:
    """The sharded tensors: of format 5 each checked to tile its tensor, with every piece
    inside a file the manifest lists; of format 6 each naming a mesh whose ranks it lists,
    as many as the mesh has (the pieces are checked where read, ddpckpt._format.shardindex)."""
    shards = {}
    for name, record in doc.items():
        entry = ShardedEntry.from_json(record, f"{where} (sharded tensor {name[:200]!r})")
        if name in tensors:
            raise CorruptCheckpointError(
                f"{where}: malformed manifest: tensor {name[:200]!r} is listed whole and sharded"
            )
        if entry.indexed and (
            entry.ranks not in meshes or len(meshes[entry.ranks]) != math.prod(entry.mesh)
        ):
            raise CorruptCheckpointError(
                f"{where}: malformed manifest: sharded tensor {name[:200]!r} names no mesh of "
                f"{math.prod(entry.mesh)} ranks the manifest lists"
            )
        for piece in entry.pieces:
            file = files.get(piece.entry.file)
            if file is None or piece.entry.end > file.size:
                raise CorruptCheckpointError(
                    f"{where}: malformed manifest: a shard of {name[:200]!r} lies outside the "
                    f"files it lists ({piece.entry.file[:200]!r})"
                )
        shards[name] = entry
    return shards


def file_from_json(name: str, doc: dict[str, Any]) -> FileEntry:
    """A file entry from this job's own ranks (a manifest read is parsed by ``_parse``)."""
    return FileEntry(name, int(doc["size"]), str(doc["xxh3_64"]), int(doc["writer"]))


def tensor_to_json(entry: TensorEntry) -> dict[str, Any]:
    doc = {
        "file": entry.file,
        "key": entry.key,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "offsets": [entry.begin, entry.end],
        "xxh3_64": entry.digest,
    }
    if entry.chunks:  # optional: a reader that knows no "chunks" verifies the whole digest
        doc["chunks"] = list(entry.chunks)
    return doc


def tensor_from_json(doc: dict[str, Any]) -> TensorEntry:
    """A tensor entry from this job's own ranks (a manifest read is parsed by ``_parse``)."""
    return TensorEntry(
        file=str(doc["file"]),
        key=str(doc["key"]),
        dtype=str(doc["dtype"]),
        shape=tuple(int(d) for d in doc["shape"]),
        begin=int(doc["offsets"][0]),
        end=int(doc["offsets"][1]),
        digest=str(doc["xxh3_64"]),
        chunks=tuple(str(c) for c in doc.get("chunks", ())),
    )


def manifest_path(path: str) -> str:
    return os.path.join(path, MANIFEST_NAME)


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the checkpoint directory ``path``.

    Raises :class:`~ddpckpt.errors.CheckpointNotFoundError` if ``path`` does not exist or
    is no checkpoint (a run directory, one of its files, an unrelated directory: the
    message says which), :class:`~ddpckpt.errors.IncompleteCheckpointError` if it is a
    checkpoint directory without a manifest (an interrupted save),
    :class:`~ddpckpt.errors.CorruptCheckpointError` if the manifest cannot be parsed or is
    no regular file.
    """
    storage = storage_for(path)
    if not storage.is_dir(path):
        if storage.exists(path):
            raise CheckpointNotFoundError(describe_path(path) or _describe_file(path))
        raise CheckpointNotFoundError(f"{path}: no checkpoint at this path")
    try:
        text = read_small(manifest_path(path), MAX_MANIFEST_BYTES, "manifest")
    except FileNotFoundError:
        what = describe_path(path)
        if what is not None:
            raise CheckpointNotFoundError(what) from None
        raise IncompleteCheckpointError(
            f"{path}: has no {MANIFEST_NAME}; the save that created it did not finish"
        ) from None
    return Manifest.from_json(text, path)


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
