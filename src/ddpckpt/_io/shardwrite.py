"""The sharded part of a save: which shards this rank writes, and their manifest records.

Called from :mod:`ddpckpt._io.writing` on every rank. DTensor shards
(``Snapshot.sharded``) are written once per storage domain: each distinct shard by one of
the ranks holding it in that domain (its replicas there). The replicas of a shard hold the
same region of every tensor of its mesh, so each computes the same assignment alone, with
no exchange: those tensors, largest first, each to the least-loaded replica (by bytes;
ties to the first). A rank decides only for its own shards, so planning costs it
O(T log k) for T sharded tensors and k replicas, whatever the number of ranks N (plus,
with several storage domains, one coordinate per rank of its own domain and mesh), never
O(N·T). ZeRO's optimizer state (``Snapshot.owned``) exists on one rank only, which writes
it. The assignment is :func:`ddpckpt._format.shardgrid.assign`, the rule a reader
recomputes to find a shard's writer: each writer lists its shards in its own index file
(:mod:`ddpckpt._format.shardindex`), and the manifest keeps only each tensor's record
without them (:func:`shard_specs`), so no rank gathers every rank's shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._format.shardgrid import (
    SHARD_WRITERS,
    MeshRanks,
    Pattern,
    assign,
    holders_by_key,
    nonempty_shards,
    pattern,
    region_at,
)
from ddpckpt._format.shards import Piece, ShardedEntry
from ddpckpt._format.tensorfile import CHUNK, TensorEntry, dtype_name, tensor_nbytes
from ddpckpt._state.sharded import MeshLayout, ShardedTensor
from ddpckpt._state.snapshot import Snapshot
from ddpckpt.errors import UnsupportedValueError


@dataclass
class ShardWrites:
    """This rank's part of the sharded state (see :func:`plan_shards`)."""

    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> its offsets
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # records without pieces
    meshes: dict[str, MeshRanks] = field(default_factory=dict)  # their ranks, by digest
    nbytes: int = 0  # of all the shards, of every rank, in one copy (about, for ZeRO's)

    @property
    def names(self) -> set[str]:
        """The names of this rank's items: never another rank's values to send it."""
        return {name for name, _ in self.items}


def plan_shards(
    snapshot: Snapshot, domains: list[list[int]], rank: int, world_size: int
) -> ShardWrites:
    """What ``rank`` writes of ``snapshot``'s sharded state; every rank computes its own part
    of the same plan (see the module docstring).

    Raises :class:`UnsupportedValueError` when ``rank``'s storage domain (a node with its
    own disk) lacks some shard: sharded state is then only complete on storage all ranks
    share. Every rank of that domain raises it.
    """
    plan = ShardWrites(items=list(snapshot.owned.items()))
    plan.nbytes = sum(tensor_nbytes(t) for t in snapshot.owned.values()) * world_size
    if snapshot.owned_state and len(domains) > 1:
        raise UnsupportedValueError(
            "ZeroRedundancyOptimizer keeps each parameter's state on one rank, so a node "
            "cannot write a complete copy to its own disk; save to storage every node shares "
            "(sharing='shared')"
        )
    replicas = _Replicas(next(d for d in domains if rank in d) if len(domains) > 1 else None)
    mine: dict[tuple[Any, ...], list[tuple[int, str, tuple[int, ...]]]] = {}
    for name in sorted(snapshot.sharded):
        shard = snapshot.sharded[name]
        itemsize = shard.local.element_size()
        plan.nbytes += math.prod(shard.shape) * itemsize
        layout = shard.layout
        plan.specs[name] = {"dtype": dtype_name(shard.local.dtype, name), "shape": list(shard.shape),
                            "mesh": list(layout.shape), "placements": list(layout.placements),
                            "chunk": CHUNK, "ranks": layout.ranks.digest}  # fmt: skip
        if layout.ranks.digest not in plan.meshes:
            plan.meshes[layout.ranks.digest] = layout.ranks.runs
        replicas.check_complete(name, shard)
        offsets, size = region_at(
            shard.shape, layout.shape, layout.placements, layout.coordinate(rank)
        )
        if math.prod(size):
            mine.setdefault(_pattern(layout), []).append(
                (math.prod(size) * itemsize, name, offsets)
            )
    for shards in mine.values():
        layout = snapshot.sharded[shards[0][1]].layout
        count, slot = replicas.slots(layout, rank)
        owners = assign(((nbytes, name) for nbytes, name, _ in shards), count, SHARD_WRITERS)
        for _, name, offsets in shards:
            if owners[name] == slot:
                plan.items.append((name, snapshot.sharded[name].local))
                plan.pieces[name] = offsets
    return plan


def _pattern(layout: MeshLayout) -> Pattern:
    """What decides which ranks are a shard's replicas (:func:`~ddpckpt._format.shardgrid.pattern`)."""
    return pattern(layout.ranks.digest, layout.shape, layout.placements)


class _Replicas:
    """The replicas of a shard that may write it: every rank holding it when all ranks
    share one storage domain; else those of ``domain``, grouped once per mesh."""

    def __init__(self, domain: list[int] | None) -> None:
        self.domain = domain
        # per mesh layout (ranks, shape, which dims replicate): shard key -> the domain's
        # ranks holding it, by replica index
        self._groups: dict[tuple[Any, ...], dict[tuple[int, ...], list[int]]] = {}

    def _grouped(self, layout: MeshLayout) -> dict[tuple[int, ...], list[int]]:
        key = _pattern(layout)
        groups = self._groups.get(key)
        if groups is None:
            members = ((m, layout.coordinate(m)) for m in self.domain or ())
            groups = self._groups[key] = holders_by_key(layout.shape, layout.placements, members)
        return groups

    def slots(self, layout: MeshLayout, rank: int) -> tuple[int, int]:
        """How many replicas of ``rank``'s shard may write it, and which of them it is."""
        coordinate = layout.coordinate(rank)
        if self.domain is None:  # every replica shares the storage
            return layout.replicas, layout.replica_index(coordinate)
        holders = self._grouped(layout)[layout.shard_key(coordinate)]
        return len(holders), holders.index(rank)

    def check_complete(self, name: str, shard: ShardedTensor) -> None:
        """Raise if this domain's ranks do not hold every non-empty shard of ``shard``."""
        if self.domain is None:
            return
        layout = shard.layout
        held = 0
        for holders in self._grouped(layout).values():
            coordinate = layout.coordinate(holders[0])
            held += bool(
                math.prod(region_at(shard.shape, layout.shape, layout.placements, coordinate)[1])
            )
        if held == nonempty_shards(shard.shape, layout.shape, layout.placements):
            return
        members = set(self.domain)
        offsets = next(box[0] for box, ranks in shard.holders() if not members & set(ranks))
        raise UnsupportedValueError(
            f"{name}: no rank of one node holds its shard at {list(offsets)}, so that node "
            "cannot write a complete copy to its own disk; save to storage every node shares "
            "(sharing='shared'), or replicate the shards within each node (HSDP)"
        )


def piece_key(key: str, offsets: tuple[int, ...]) -> str:
    """The key of a shard in its data file: the tensor's key and the shard's offsets."""
    return f"{key}@{','.join(str(o) for o in offsets)}"


def piece_json(offsets: tuple[int, ...], entry: TensorEntry) -> dict[str, Any]:
    """A written shard as a rank reports it to the manifest's writer."""
    return Piece(offsets, entry).to_json()


def shard_specs(specs: dict[str, dict[str, Any]], where: str) -> dict[str, ShardedEntry]:
    """Each sharded tensor's manifest record (format 6: no pieces), checked as a reader
    checks it."""
    return {name: ShardedEntry.from_json(spec, where) for name, spec in specs.items()}


def expected_pieces(specs: dict[str, ShardedEntry]) -> int:
    """How many pieces the ranks of one copy write in all: one per distinct non-empty shard."""
    return sum(record.shard_count for record in specs.values())
