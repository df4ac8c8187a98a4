"""The sharded part of a save: which shards this rank writes, and their manifest records.

Called from :mod:`ddpckpt._io.writing` on every rank. DTensor shards
(``Snapshot.sharded``) are written once per storage domain: each distinct shard by one of
the ranks holding it in that domain, balanced by bytes
(:func:`ddpckpt._coord.plan.assign_shards`, a pure function every rank computes alike
from the meshes and placements). ZeRO's optimizer state (``Snapshot.owned``) exists on
one rank only, which writes it. The first rank of each domain then builds each sharded
tensor's record from every rank's pieces (:func:`shard_records`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._coord.plan import assign_shards
from ddpckpt._format.shards import Piece, ShardedEntry
from ddpckpt._format.tensorfile import CHUNK, TensorEntry, dtype_name, tensor_nbytes
from ddpckpt._state.snapshot import Snapshot
from ddpckpt.errors import UnsupportedValueError


@dataclass
class ShardWrites:
    """This rank's part of the sharded state (see :func:`plan_shards`)."""

    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> its offsets
    loads: list[dict[int, int]] | None = None  # per domain: bytes of shards each rank writes
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # records without pieces
    nbytes: int = 0  # of all the shards, of every rank, in one copy (about, for ZeRO's)

    @property
    def names(self) -> set[str]:
        """The names of this rank's items: never another rank's values to send it."""
        return {name for name, _ in self.items}


def plan_shards(
    snapshot: Snapshot, domains: list[list[int]], rank: int, world_size: int
) -> ShardWrites:
    """What ``rank`` writes of ``snapshot``'s sharded state; the same plan on every rank.

    Raises :class:`UnsupportedValueError` when a storage domain (a node with its own disk)
    lacks some shard: sharded state is then only complete on storage all ranks share.
    """
    plan = ShardWrites(items=list(snapshot.owned.items()))
    plan.nbytes = sum(tensor_nbytes(t) for t in snapshot.owned.values()) * world_size
    if snapshot.owned_state and len(domains) > 1:
        raise UnsupportedValueError(
            "ZeroRedundancyOptimizer keeps each parameter's state on one rank, so a node "
            "cannot write a complete copy to its own disk; save to storage every node shares "
            "(sharing='shared')"
        )
    shards: dict[tuple[str, tuple[int, ...]], tuple[int, list[int]]] = {}
    for name, shard in snapshot.sharded.items():
        itemsize = shard.local.element_size()
        plan.nbytes += math.prod(shard.shape) * itemsize
        layout = shard.layout
        plan.specs[name] = {"dtype": dtype_name(shard.local.dtype, name), "shape": list(shard.shape),
                            "mesh": list(layout.shape), "placements": list(layout.placements),
                            "chunk": CHUNK}  # fmt: skip
        for (offsets, size), holders in shard.holders():
            shards[(name, offsets)] = (math.prod(size) * itemsize, holders)
    try:
        plans = assign_shards(shards, domains)
    except LookupError as exc:
        name, offsets = exc.args[0]
        raise UnsupportedValueError(
            f"{name}: no rank of one node holds its shard at {list(offsets)}, so that node "
            "cannot write a complete copy to its own disk; save to storage every node shares "
            "(sharing='shared'), or replicate the shards within each node (HSDP)"
        ) from None
    owners, _ = next(p for p, d in zip(plans, domains, strict=True) if rank in d)
    plan.loads = [loads for _, loads in plans]
    for name, shard in snapshot.sharded.items():
        offsets, size = shard.layout.region(shard.shape, rank)
        if math.prod(size) and owners[(name, offsets)] == rank:
            plan.items.append((name, shard.local))
            plan.pieces[name] = offsets
    return plan


def piece_key(key: str, offsets: tuple[int, ...]) -> str:
    """The key of a shard in its data file: the tensor's key and the shard's offsets."""
    return f"{key}@{','.join(str(o) for o in offsets)}"


def piece_json(offsets: tuple[int, ...], entry: TensorEntry) -> dict[str, Any]:
    """A written shard as a rank reports it to the manifest's writer."""
    return Piece(offsets, entry).to_json()


def shard_records(
    specs: dict[str, dict[str, Any]], pieces: list[dict[str, Any]], where: str
) -> dict[str, ShardedEntry]:
    """Each sharded tensor's record from its spec and the pieces every rank wrote (each
    rank's ``{name: piece}``), checked as a reader checks it: a plan that left a gap fails
    here, before anything is committed."""
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
    for part in pieces:
        for name, piece in part.items():
            found[name].append(piece)
    return {
        name: ShardedEntry.from_json(
            {**spec, "pieces": sorted(found[name], key=lambda p: p["offsets"])}, where
        )
        for name, spec in specs.items()
    }
