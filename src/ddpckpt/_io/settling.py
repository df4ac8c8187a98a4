"""The part of a save's plan that may wait until its tensors are copied.

:func:`~ddpckpt._io.planning.plan_write` decides who writes what as if every unverified
tensor (nothing keeps it identical: an EMA in ``extra``, a model without DDP) were the
same on every rank. :func:`settle_plan` then compares them, stores those that differ per
rank, and, when the checkpoint has several storage domains, sends every rank's file to
them. :func:`~ddpckpt._io.writing.write_and_commit` runs it first: on the training thread
for a synchronous save, in the background for an asynchronous one, on its host copies, so
that hashing every byte of an EMA at every save costs the training thread nothing beyond
copying it. Every rank calls it, in the same order (it is collective).
"""

from __future__ import annotations

import json

from ddpckpt._coord.consistency import differing_unverified
from ddpckpt._coord.copies import from_first_leader, send_to_leaders
from ddpckpt._coord.plan import file_names
from ddpckpt._coord.store import pack, unpack
from ddpckpt._format.tensorfile import deserialize
from ddpckpt._format.tensorwrite import serialize
from ddpckpt._io.write_plan import WritePlan


def settle_plan(plan: WritePlan, attempt: int = 0) -> None:
    """Finish ``plan`` (once; a retry passes the next ``attempt``); collective.

    Unverified tensors that differ between ranks are kept per rank: each rank's value in
    its own file, rank 0's in the shared copy, written by each domain's first rank.
    """
    if plan.settled:
        return
    comm = plan.comm
    values = dict(plan.items + plan.checked)
    apart = differing_unverified(
        comm, values, plan.pending, f"unverified.{attempt}", plan.may_differ, plan.unsynced
    )
    if apart:
        own = plan.rank_state["own"] = dict(plan.rank_state.get("own", {}))
        for name in sorted(apart):
            plan.rank_items.append((f"rank{comm.rank}/own/{name}", values[name]))
            own[name] = f"own/{name}"
        plan.movable -= apart
        plan.items = [(n, t) for n, t in plan.items if n not in apart]
        if plan.leader:
            plan.items += [(n, values[n]) for n in sorted(apart)]
    plan.checked = []
    if len(plan.domains) > 1:
        _send_to_domains(plan, values, attempt)
    plan.settled = True


def _send_to_domains(plan: WritePlan, values: dict, attempt: int) -> None:
    """Every domain gets a copy of the shared state, rank 0's (its first rank writes it),
    and the files of the ranks it keeps (``plan.partners``): every rank's, passed around
    the ring of the domains' first ranks with rank 0's shared state; or, with partners,
    its own and its partner domains', and rank 0's shared state by doubling."""
    comm = plan.comm
    name = file_names(comm.rank)["rank"]
    blob, plan.rank_file, _ = serialize(
        name, plan.rank_items, writer=comm.rank, metadata=plan.rank_metadata()
    )
    plan.rank_blob = blob
    shared: list[bytes] = []
    if comm.rank == 0:  # the first rank of its domain: it holds every such tensor
        shards = plan.shards.names  # each domain writes its own ranks' shards
        pinned = [(n, t) for n, t in values.items() if n not in plan.movable | shards]
        state_json = json.dumps(plan.shared_state).encode()
        shared = [state_json, serialize("rank0", pinned, writer=0, metadata={})[0]]
    ring = plan.partners.count is None

    def exchange() -> tuple[dict[int, bytes], bytes | None]:
        received = send_to_leaders(comm, plan.partners, pack([blob, *(shared if ring else [])]))
        if ring or not plan.leader:
            return received, None
        return received, from_first_leader(comm, plan.domains, pack(shared) if shared else None)

    received, fanned = comm.run_transfer(f"copies.{attempt}", exchange)
    parts = {r: unpack(b) for r, b in received.items()}
    plan.foreign = {r: found[0] for r, found in parts.items()}
    if plan.leader and comm.rank != 0:  # it leads a domain without rank 0: it writes rank 0's part
        state_json, rank0 = parts[0][1:] if ring else unpack(fanned)  # type: ignore[arg-type]
        plan.shared_state = json.loads(state_json)
        theirs = deserialize(rank0, plan.path)
        plan.items = [(n, theirs.get(n, t)) for n, t in plan.items]
