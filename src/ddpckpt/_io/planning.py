"""Step 1 of writing a checkpoint collectively (:mod:`ddpckpt._io.writing`): who writes
what. :func:`plan_write` makes this rank's :class:`~ddpckpt._io.write_plan.WritePlan`;
:func:`add_ranks` has a local plan write other ranks' files too; :func:`staging_share`
sizes a rank's staging buffer as the plan would fill it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.consistency import check_replicated
from ddpckpt._coord.plan import file_names, plan_owners
from ddpckpt._coord.topology import storage_domains
from ddpckpt._format.manifest import file_to_json
from ddpckpt._format.rankparts import rank_keys
from ddpckpt._format.tensorfile import tensor_nbytes
from ddpckpt._format.tensorwrite import serialize
from ddpckpt._io.shardwrite import ShardWrites, plan_shards
from ddpckpt._io.write_plan import WritePlan, rank_metadata
from ddpckpt._io.writing import storage_errors
from ddpckpt._state.capture import Snapshot
from ddpckpt.storage._location import Location


def plan_write(
    comm: Comm,
    location: Location,
    snapshot: Snapshot,
    header: Mapping[str, Any],
    *,
    overwrite: bool = False,
    storage: str | None = None,
    domains: list[list[int]] | None = None,
    partners: int | None = None,
) -> WritePlan:
    """Decide this rank's part of writing ``snapshot`` to ``location`` (the path the ranks
    agreed on, :meth:`Comm.locate <ddpckpt._coord.comm.Comm.locate>`); collective.

    What may wait until the tensors are copied (comparing the unverified ones, this rank's
    file, the copies for other storage domains) is left to
    :func:`~ddpckpt._io.settling.settle_plan`, which
    :func:`~ddpckpt._io.writing.write_and_commit` runs first.
    """
    location = comm.locate(location)
    path = location.path
    check_replicated(comm, snapshot)
    if domains is None:
        with storage_errors(path):  # creating the parent directory may fail
            domains = storage_domains(comm, location.parent, storage)
    pending = sorted(snapshot.unverified)
    movable = snapshot.balanced | snapshot.unverified  # until the pending ones are compared

    def share() -> tuple[dict[str, int], ShardWrites]:  # this rank's own work
        shards = plan_shards(snapshot, domains, comm.rank, comm.world_size)
        sizes = {n: tensor_nbytes(t) for n, t in snapshot.tensors.items()}
        domain = next(d for d in domains if comm.rank in d)
        return plan_owners(sizes, domain, movable), shards

    owners, shards = comm.alone(share)
    rank_items = [(f"rank{comm.rank}/{n}", t) for n, t in snapshot.rank_tensors.items()]
    rank_bytes = sum(tensor_nbytes(t) for _, t in rank_items) + len(json.dumps(snapshot.rank_state))
    plan = WritePlan(
        comm=comm,
        location=location,
        header=header,
        overwrite=overwrite,
        domains=domains,
        items=[(n, t) for n, t in snapshot.tensors.items() if owners[n] == comm.rank]
        + shards.items,
        order=list(snapshot.tensors),
        needed=sum(tensor_nbytes(t) for t in snapshot.tensors.values()) + shards.nbytes,
        shared_state=snapshot.state,
        movable=movable,
        rank_items=rank_items,
        rank_state=dict(snapshot.rank_state),
        pending=pending,
        may_differ=frozenset(snapshot.may_differ),
        unsynced=dict(snapshot.unsynced),
        checked=[(n, snapshot.tensors[n]) for n in pending if owners[n] != comm.rank],
        shards=shards,
        owned_state=snapshot.owned_state,
        keepers=partners,
    )
    plan.needed += plan.kept * (rank_bytes + 4096)  # the rank files this copy keeps
    return plan


def add_ranks(
    plan: WritePlan, parts: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]
) -> None:
    """Have ``plan`` (a local one: one process writes the whole checkpoint) also write the
    per-rank files of ranks 1, 2, ...: ``parts`` holds each one's encoded per-rank state and
    its tensors, as a rank's :class:`Snapshot` would. The checkpoint is then one of
    ``1 + len(parts)`` ranks, as if each had saved its own (an import of a job's per-rank
    random streams); local."""
    if plan.comm.world_size != 1:
        raise ValueError("add_ranks is for a checkpoint one process writes alone")
    for rank, (state, tensors) in enumerate(parts, start=1):
        items = [(f"rank{rank}/{n}", t) for n, t in tensors.items()]
        blob, entry, _ = serialize(
            file_names(rank)["rank"], items, writer=0, metadata=rank_metadata(state)
        )
        plan.foreign[rank] = blob
        plan.alone[rank] = {
            "rank_keys": rank_keys(state),
            "rank_file": {"name": entry.name, **file_to_json(entry)},
        }
        plan.needed += len(blob) + 4096


def staging_share(snapshot: Snapshot, domains: list[list[int]], rank: int) -> list[torch.Tensor]:
    """The tensors ``rank`` would copy for ``snapshot`` in an asynchronous save (as
    :func:`plan_write` assigns them), for sizing its staging buffer before the first save;
    local."""
    domain = next(d for d in domains if rank in d)
    shards = plan_shards(snapshot, domains, rank, 1)
    sizes = {n: tensor_nbytes(t) for n, t in snapshot.tensors.items()}
    movable = snapshot.balanced | snapshot.unverified
    owners = plan_owners(sizes, domain, movable)
    shared = [
        t for n, t in snapshot.tensors.items() if owners[n] == rank or n in snapshot.unverified
    ]
    return shared + [t for _, t in shards.items] + list(snapshot.rank_tensors.values())
