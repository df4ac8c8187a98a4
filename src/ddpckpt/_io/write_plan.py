"""What this rank writes for one checkpoint: the :class:`WritePlan` that
:func:`~ddpckpt._io.planning.plan_write` makes, :func:`~ddpckpt._io.settling.settle_plan`
finishes and :func:`~ddpckpt._io.writing.write_and_commit` carries out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.plan import Partners
from ddpckpt._format.rankparts import RANK_STATE_KEY
from ddpckpt._format.tensorfile import FileEntry, tensor_nbytes
from ddpckpt._io.shardwrite import ShardWrites
from ddpckpt.storage._location import Location

FILE_METADATA = {"format": "pt", "writer": "ddpckpt"}  # the header of every file written


@dataclass
class WritePlan:
    """What this rank writes for one checkpoint (see :func:`~ddpckpt._io.planning.plan_write`).

    Until :func:`~ddpckpt._io.settling.settle_plan` has run, ``items`` assumes that the
    ``pending`` tensors (unverified: nothing keeps them identical) are the same on every
    rank, and ``checked`` holds those of them this rank does not write, for comparing.
    """

    comm: Comm
    location: Location  # of the checkpoint (comm.path, resolved)
    header: Mapping[str, Any]
    overwrite: bool
    domains: list[list[int]]
    items: list[tuple[str, torch.Tensor]]  # this rank's shared tensors, by snapshot name
    order: list[str]  # every shared tensor name, in state order
    needed: int  # bytes of one complete copy
    shared_state: dict[str, Any]
    movable: set[str]  # the shared tensors any rank may write (identical on every rank)
    rank_items: list[tuple[str, torch.Tensor]]  # this rank's file: its per-rank tensors,
    rank_state: dict[str, Any]  # and its state, in the file's metadata
    pending: list[str] = field(default_factory=list)
    may_differ: frozenset[str] = frozenset()  # of the pending ones: apart by design, no warning
    unsynced: Mapping[str, str] = field(default_factory=dict)  # Snapshot.unsynced
    checked: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    settled: bool = False
    rank_blob: bytes | None = None  # this rank's file, made to be sent to other domains
    rank_file: FileEntry | None = None  # and its entry
    foreign: dict[int, bytes] = field(default_factory=dict)  # other domains' rank files
    # ranks whose rank files this process writes alone (an import): their write results
    alone: dict[int, dict[str, Any]] = field(default_factory=dict)
    shards: ShardWrites = field(default_factory=ShardWrites)  # sharded state (shardwrite)
    owned_state: dict[str, Any] = field(default_factory=dict)  # Snapshot.owned_state
    keepers: int | None = None  # how many other domains keep a domain's rank files (None: all)

    @property
    def path(self) -> str:
        """The checkpoint's path, as messages name it."""
        return self.location.path

    @property
    def partners(self) -> Partners:
        """Which domains keep whose rank files."""
        return Partners(self.domains, self.keepers)

    @property
    def kept(self) -> int:
        """How many ranks' own files this rank's domain keeps."""
        return self.partners.kept_count(self.domains.index(self.domain))

    @property
    def domain(self) -> list[int]:
        return next(d for d in self.domains if self.comm.rank in d)

    @property
    def leader(self) -> bool:
        return self.domain[0] == self.comm.rank

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for _, t in self.items)

    def rank_metadata(self) -> dict[str, str]:
        return rank_metadata(self.rank_state)


def rank_metadata(state: dict[str, Any]) -> dict[str, str]:
    """The header of a rank's file: its encoded per-rank ``state``."""
    return {**FILE_METADATA, RANK_STATE_KEY: json.dumps(state)}
