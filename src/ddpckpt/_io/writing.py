"""Writing a checkpoint collectively: plan who writes what (:mod:`ddpckpt._io.planning`),
then write and commit.

Every rank calls both steps, in order:

1. :func:`~ddpckpt._io.planning.plan_write` checks that every rank holds the same shared
   tensors, finds the storage domains and assigns each tensor to exactly one rank of each
   domain (balanced by bytes; tensors that are not replicated under DDP go to rank 0's
   copy). It returns this rank's :class:`~ddpckpt._io.write_plan.WritePlan`.
2. :func:`write_and_commit` settles what the plan left open (:mod:`ddpckpt._io.settling`:
   comparing the unverified tensors, the copies for other storage domains), then has the
   first rank of each domain create a temporary directory, every rank stream its files
   into it (its per-rank file too), and the first rank write the manifest and rename the
   directory into place.

Between the two, an asynchronous save replaces the plan's tensors (``items``,
``checked``, ``rank_items``) with host copies (:mod:`ddpckpt._io.staging`) and runs step
2 in the background.
"""

from __future__ import annotations

import copy
import errno
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ddpckpt import events
from ddpckpt._coord.plan import Partners, file_names
from ddpckpt._format import filetable
from ddpckpt._format.codec import encode
from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, file_to_json, read_manifest
from ddpckpt._format.manifestfields import file_from_json, tensor_from_json, tensor_to_json
from ddpckpt._format.rankparts import rank_keys
from ddpckpt._format.shardgrid import SHARD_WRITERS, replicas
from ddpckpt._format.shardindex import index_document, index_name
from ddpckpt._format.tensorfile import CHUNK, FileEntry, tensor_nbytes
from ddpckpt._format.tensorwrite import write_file
from ddpckpt._io.progress import Progress
from ddpckpt._io.settling import settle_plan
from ddpckpt._io.shardwrite import expected_pieces, piece_json, piece_key, shard_specs
from ddpckpt._io.write_plan import FILE_METADATA, WritePlan
from ddpckpt._log import get_logger
from ddpckpt._state.zero import merge_owned_state
from ddpckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    InsufficientSpaceError,
    UnsupportedValueError,
)
from ddpckpt.storage._location import Location

_log = get_logger(__name__)


def header_fields(
    step: int | None, epoch: int | None, metrics: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Validate and encode the checkpoint's step, epoch and metrics."""
    for name, number in (("step", step), ("epoch", epoch)):
        if number is not None and (type(number) is not int or number < 0):
            raise TypeError(f"{name} must be a non-negative int or None, got {number!r}")
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


def write_and_commit(plan: WritePlan, attempt: int = 0) -> str:
    """Write this rank's files and commit the checkpoint; collective. Returns its path.

    On any failure anywhere every rank raises the same error, the temporary directory is
    removed and nothing is committed. A retry of the same plan passes the next ``attempt``
    (its messages must not meet the failed attempt's).
    """
    comm, path, store = plan.comm, plan.path, plan.location.storage
    staging = store.commit.staging(store, path, f"{comm.token}-{attempt}", overwrite=plan.overwrite)
    tmp = Location(store, staging)
    settle_plan(plan, attempt)
    try:
        done = comm.run_reduce(
            f"prepare.{attempt}",
            lambda: _prepare(plan, tmp),
            lambda found: all(found[d[0]] for d in plan.domains),
        )
        if done:  # a previous attempt committed, then failed
            return path
        # The leader of each copy writes its manifest: it receives its own ranks' results
        # and the rank files of the other ranks it keeps; no other rank receives any.
        part = comm.run_scatter(
            f"write.{attempt}",
            lambda: _write(plan, tmp),
            lambda found: _results_by_leader(found, plan.partners),
            receive=plan.leader,
        )
        written = None if part is None else _CopyResults.of(part, plan.alone)
        comm.run(f"commit.{attempt}", lambda: _commit(plan, tmp, written))
    except BaseException:
        if plan.leader:
            store.commit.abort(store, staging, path)
        raise
    events.committed(plan.location, plan.header["step"])
    return path


def _results_by_leader(results: list[dict[str, Any]], partners: Partners) -> dict[int, Any]:
    """On rank 0, for each copy's leader: the write results of its own ranks, the rank
    files of the other ranks it keeps (it wrote those files too: ``partners``), the number
    of ranks, and the sections any rank's file holds (the same in every copy). A leader
    receives O(ranks it keeps), never every rank's result."""
    keys = sorted({key for found in results for key in found["rank_keys"]})
    parts = {}
    for index, domain in enumerate(partners.domains):
        mine = set(domain)
        parts[domain[0]] = {
            "world_size": len(results),
            "rank_keys": keys,
            "results": [
                [rank, results[rank] if rank in mine else {"rank_file": results[rank]["rank_file"]}]
                for rank in partners.ranks_kept_by(index)
            ],
        }
    return parts


@dataclass(frozen=True)
class _CopyResults:
    """What a copy's leader knows of the ranks' writes (:func:`_results_by_leader`), with
    the ranks whose files it wrote alone (an import)."""

    world_size: int
    rank_keys: list[str]
    results: dict[int, dict[str, Any]]  # of the ranks whose files this copy holds

    @classmethod
    def of(cls, part: dict[str, Any], alone: dict[int, dict[str, Any]]) -> _CopyResults:
        results = {int(rank): found for rank, found in part["results"]} | alone
        keys = sorted({*part["rank_keys"], *(k for r in alone.values() for k in r["rank_keys"])})
        return cls(part["world_size"] + len(alone), keys, results)


def _committed_by(plan: WritePlan) -> bool:
    """Whether ``plan.path`` holds the checkpoint this very save committed."""
    try:
        return read_manifest(plan.location).id == plan.comm.token
    except CheckpointError:
        return False


def _prepare(plan: WritePlan, tmp: Location) -> bool:
    """Check the target and make the temporary directory; True if already committed."""
    if not plan.leader:
        return False
    path = plan.path
    if _committed_by(plan):
        return True
    store = plan.location.storage
    with storage_errors(path):
        if store.commit.exists(store, path) and not plan.overwrite:
            raise CheckpointExistsError(
                f"{path}: a checkpoint already exists here; pass overwrite=True to replace it, "
                "or save under a new name"
            )
        where = store.parent(path)
        free = store.free_bytes(where)
        reserve = space_reserve(plan.needed, files=3 * len(plan.domain) + plan.kept + 1)
        needed = plan.needed + reserve
        if free is not None and free < needed:
            raise InsufficientSpaceError(
                errno.ENOSPC,
                f"{path}: the checkpoint needs {needed:,} bytes ({_readable(needed)}: "
                f"{plan.needed:,} of files and {reserve:,} to spare for the file system's "
                f"overhead) but only {free:,} bytes ({_readable(free)}) are free in {where}; "
                "free space there (e.g. keep fewer "
                "checkpoints) or save elsewhere. Nothing was written",
            )
        store.commit.begin(store, path, tmp.path, overwrite=plan.overwrite)
    return False


def _write(plan: WritePlan, tmp: Location) -> dict[str, Any]:
    names = file_names(plan.comm.rank)
    files: list[dict[str, Any]] = []
    tensors: dict[str, dict[str, Any]] = {}
    pieces: dict[str, dict[str, Any]] = {}
    shard_of: dict[str, str] = {}  # a shard's key in its file -> the tensor's name

    def keyed(name: str) -> str:
        key = name.removeprefix("model/")
        if name not in plan.shards.pieces:
            return key
        key = piece_key(key, plan.shards.pieces[name])
        shard_of[key] = name
        return key

    model = [(keyed(n), t) for n, t in plan.items if n.startswith("model/")]
    state = [(keyed(n), t) for n, t in plan.items if not n.startswith("model/")]
    with (
        storage_errors(plan.path),
        Progress(f"saving {plan.location.name}", plan.nbytes) as bar,
    ):
        for kind, items in (("model", model), ("state", state)):
            if not items:
                continue
            entry, entries = write_file(
                tmp.join(names[kind]),
                items,
                writer=plan.comm.rank,
                metadata=FILE_METADATA,
                progress=bar.update,
                chunked=shard_of.keys() | _large(items),
            )
            files.append({"name": entry.name, **file_to_json(entry)})
            prefix = "model/" if kind == "model" else ""
            for e in entries:
                if e.key in shard_of:
                    name = shard_of[e.key]
                    pieces[name] = piece_json(plan.shards.pieces[name], e)
                else:
                    tensors[prefix + e.key] = tensor_to_json(e)
        store = tmp.storage
        rank_path = tmp.join(names["rank"])
        if plan.rank_blob is None:  # streamed, as the other files
            rank_file, _ = write_file(
                rank_path, plan.rank_items, writer=plan.comm.rank, metadata=plan.rank_metadata()
            )
        else:  # made for the copies to other domains already
            store.write_new(rank_path.path, plan.rank_blob)
            rank_file = plan.rank_file  # type: ignore[assignment]
        for other, blob in plan.foreign.items():
            store.write_new(tmp.join(file_names(other)["rank"]).path, blob)
        if pieces:  # format 6: this rank's shards are listed in its own index file
            blob = index_document(plan.comm.token, plan.comm.rank, pieces)
            name = index_name(plan.comm.rank)
            store.write_new(tmp.join(name).path, blob)
            index = FileEntry(name, len(blob), xxhash.xxh3_64(blob).hexdigest(), plan.comm.rank)
            files.append({"name": name, **file_to_json(index)})
    return {
        "files": files,
        "tensors": tensors,
        "pieces": len(pieces),
        "owned_state": plan.owned_state,
        "rank_keys": rank_keys(plan.rank_state),
        "rank_file": {"name": rank_file.name, **file_to_json(rank_file)},
    }


def _commit(plan: WritePlan, tmp: Location, written: _CopyResults | None) -> None:
    if not plan.leader:
        return
    assert written is not None, "every copy's leader receives its ranks' results"
    comm, domain, header = plan.comm, plan.domain, plan.header
    ours = [written.results[rank] for rank in domain]
    state = copy.deepcopy(plan.shared_state)
    merge_owned_state(state, [r["owned_state"] for r in ours])
    manifest = Manifest(
        id=comm.token,
        step=header["step"],
        epoch=header["epoch"],
        metrics=header["metrics"],
        world_size=written.world_size,
        state=state,
        rank_keys=written.rank_keys,
        copy={
            "index": plan.domains.index(domain),
            "count": len(plan.domains),
            # which ranks wrote this copy matters only when each node wrote its own
            **({"ranks": domain + sorted(plan.alone)} if len(plan.domains) > 1 else {}),
            **({"partners": plan.keepers} if plan.keepers is not None else {}),
        },
    )
    for rank, result in sorted(written.results.items()):
        mine = rank in domain
        for doc in [*(result["files"] if mine else []), result["rank_file"]]:
            manifest.files[doc["name"]] = file_from_json(
                doc["name"], {**doc, "writer": doc["writer"] if mine else domain[0]}
            )
        for name, doc in (result["tensors"] if mine else {}).items():
            manifest.tensors[name] = tensor_from_json(doc)
    manifest.shards = shard_specs(plan.shards.specs, plan.path)
    manifest.meshes = dict(plan.shards.meshes)
    if any(replicas(r.mesh, r.placements) > SHARD_WRITERS for r in manifest.shards.values()):
        manifest.shard_writers = SHARD_WRITERS  # format 7: the writers the save capped
    pieces, expected = sum(r["pieces"] for r in ours), expected_pieces(manifest.shards)
    if pieces != expected:  # each rank planned alone: what they planned must tile the state
        raise RuntimeError(
            f"{plan.path}: the ranks wrote {pieces} shards of sharded tensors, not the "
            f"{expected} distinct ones; nothing was committed (a bug in ddpckpt: please report)"
        )
    order = {name: i for i, name in enumerate(plan.order)}
    manifest.tensors = dict(
        sorted(manifest.tensors.items(), key=lambda kv: order.get(kv[0], len(order)))
    )
    store = plan.location.storage
    with storage_errors(plan.path):
        if written.world_size > filetable.TABLE_RANKS:  # format 7: a manifest flat in N
            whole = {entry.file for entry in manifest.tensors.values()}
            for name, blob in manifest.files.tabulate(whole, comm.token, comm.rank).items():
                store.write_new(tmp.join(name).path, blob)
        store.write_new(tmp.join(MANIFEST_NAME).path, manifest.to_json(plan.path).encode())
    try:
        store.commit.publish(store, tmp.path, plan.path, overwrite=plan.overwrite)
    except OSError as exc:
        if _committed_by(plan):  # renamed into place; what failed came after
            raise CheckpointWriteError(
                exc.errno,
                f"{plan.path}: the checkpoint is committed, but syncing the directory afterwards "
                f"failed ({exc.strerror or exc}); it may not survive a power loss",
            ) from exc
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise CheckpointExistsError(f"{plan.path}: another save committed here first") from exc
        with storage_errors(plan.path):
            raise
    _log.info("saved checkpoint %s (step %s, %d bytes)", plan.path, header["step"], manifest.nbytes)


@contextmanager
def storage_errors(path: str) -> Iterator[None]:
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
            "was committed, and this save changed no earlier checkpoint",
        ) from exc


def space_reserve(needed: int, files: int) -> int:
    """The free space a checkpoint of ``needed`` bytes in ``files`` files must leave, beyond
    its own bytes; local.

    It scales with the checkpoint: a fixed amount either refuses a small checkpoint on a
    small disk or is too little for a large one. One block (4 KiB) per file covers the
    file system's rounding of each file's last block; 1% of ``needed`` covers what the
    planned size leaves out and grows with it: inodes, extents and directory entries, the
    tensor files' headers and the manifest's entry for every tensor.
    """
    return files * _BLOCK + needed // 100


_BLOCK = 4096


def _readable(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def _large(items: list[tuple[str, torch.Tensor]]) -> set[str]:
    """The keys of the tensors above one :data:`~ddpckpt._format.tensorfile.CHUNK`: each
    gets a digest per chunk, so that a rank that needs only part of it (a checkpoint saved
    whole, loaded into a sharded tensor) reads and verifies only that part."""
    return {key for key, tensor in items if tensor_nbytes(tensor) > CHUNK}
