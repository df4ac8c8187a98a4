"""The entries of a manifest beside its ``state``: each tensor's, to JSON and back, the
sharded tensors, their meshes' ranks and which copy of a checkpoint it is; as read from a
manifest (:mod:`ddpckpt._format.manifest`), every field checked before anything uses it.
"""

from __future__ import annotations

import math
from typing import Any

from ddpckpt._format.boundary import MAX_RANKS, Fields, check_int
from ddpckpt._format.filetable import DIGEST, FileTable, digest_field
from ddpckpt._format.shardgrid import MeshRanks
from ddpckpt._format.shards import ShardedEntry, chunk_count
from ddpckpt._format.tensorfile import CHUNK, FileEntry, TensorEntry, checked_layout
from ddpckpt.errors import CorruptCheckpointError


def tensor_entry(key: str, doc: Any, where: str, files: FileTable) -> TensorEntry:
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


def copy_from_json(doc: Any, where: str, world_size: int) -> dict[str, Any]:
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


def meshes_to_json(meshes: dict[str, MeshRanks]) -> dict[str, list[list[int]]]:
    return {key: [list(run) for run in mesh.runs] for key, mesh in meshes.items()}


def meshes_from_json(doc: dict[str, Any], where: str, world_size: int) -> dict[str, MeshRanks]:
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


def shards_from_json(
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
    """A file entry from this job's own ranks (a manifest read is parsed by
    :meth:`~ddpckpt._format.manifest.Manifest.from_json`)."""
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
    """A tensor entry from this job's own ranks (a manifest read is parsed by
    :meth:`~ddpckpt._format.manifest.Manifest.from_json`)."""
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
