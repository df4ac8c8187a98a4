"""Snapshots of DTensors as one simulated rank of a mesh would take them (no processes)."""

from __future__ import annotations

import torch

from ddpckpt._state.sharded import MeshLayout, ShardedTensor
from ddpckpt._state.snapshot import Snapshot

SHAPES = [(16, 4), (3, 4), (1, 4), (10,), (0, 3), (7, 5)]  # even, uneven, empty shards
LAYOUTS = [  # mesh, placements, storage domains: 8 ranks
    ((8,), ("S0",), [list(range(8))]),  # FSDP2 on shared storage
    ((2, 4), ("R", "S0"), [list(range(8))]),  # HSDP, shared storage
    ((2, 4), ("R", "S0"), [[0, 1, 2, 3], [4, 5, 6, 7]]),  # HSDP, a disk per replica
    ((4, 2), ("R", "S0"), [[0, 1, 2, 3], [4, 5, 6, 7]]),  # two replicas on each node
    ((2, 2, 2), ("S0", "R", "S0"), [list(range(8))]),  # a dimension split twice
    ((8,), ("R",), [[0, 1, 2], [3, 4, 5, 6, 7]]),  # replicate(): every rank holds all
]


def snapshot_of(layout: MeshLayout, rank: int, shapes=SHAPES) -> Snapshot:
    """``rank``'s snapshot of one DTensor per shape (and an AdamW-like moment of each)."""
    sharded = {}
    for i, shape in enumerate(shapes):
        for kind in ("weight", "exp_avg"):
            size = layout.region(shape, rank)[1]
            sharded[f"t{i}.{kind}"] = ShardedTensor(torch.empty(size), shape, layout)
    return Snapshot(sharded=sharded)
