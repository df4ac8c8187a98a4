"""Which rank writes (or reads) which tensor.

Every storage domain gets a full copy of the checkpoint. A tensor identical on every rank
(parameters DDP keeps replicated) can be written by any rank: each is assigned to exactly
one rank of the domain, largest first to the least-loaded rank (longest-processing-time
scheduling), which keeps every rank's bytes within one tensor of the mean. Every other
tensor is written by the domain's first rank, which holds rank 0's values. The plan is
a pure function of its inputs, so every rank computes the same one without exchanging it.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

from ddpckpt._format.rankparts import rank_file_name

K = TypeVar("K", bound=Hashable)


def plan_owners(
    sizes: Mapping[str, int],
    domains: Sequence[Sequence[int]],
    movable: Collection[str],
    loads: Sequence[Mapping[int, int]] | None = None,
) -> list[dict[str, int]]:
    """For each storage domain, which of its ranks writes each tensor of ``sizes`` (bytes).

    Tensors in ``movable`` are balanced over the domain's ranks (:func:`assign`), counting
    the bytes ``loads`` (one mapping per domain) already gives each rank; the others go to
    the domain's first rank.
    """
    movable_sizes = {name: size for name, size in sizes.items() if name in movable}
    return [
        {**dict.fromkeys(sizes, domain[0]),
         **assign(movable_sizes, domain, loads[d] if loads else None)}
        for d, domain in enumerate(domains)
    ]  # fmt: skip


def assign_shards(
    shards: Mapping[K, tuple[int, Sequence[int]]], domains: Sequence[Sequence[int]]
) -> list[tuple[dict[K, int], dict[int, int]]]:
    """For each storage domain, which rank writes each shard, and the bytes each rank got.

    ``shards`` maps a shard to its bytes and the ranks holding it (its replicas); each is
    written by one holder in the domain, largest first to the least-loaded holder. Raises
    :class:`LookupError` naming a shard no rank of some domain holds.
    """
    plans = []
    for domain in domains:
        members, loads = set(domain), dict.fromkeys(domain, 0)
        owners: dict[K, int] = {}
        for key in sorted(shards, key=lambda k: (-shards[k][0], repr(k))):
            size, holders = shards[key]
            candidates = [r for r in holders if r in members]
            if not candidates:
                raise LookupError(key)
            owner = min(candidates, key=lambda r: (loads[r], r))
            owners[key] = owner
            loads[owner] += max(size, 1)
        plans.append((owners, loads))
    return plans


def assign(
    sizes: Mapping[str, int], ranks: Sequence[int], loads: Mapping[int, int] | None = None
) -> dict[str, int]:
    """Map each tensor name to one of ``ranks``, balancing the bytes (counting ``loads``,
    the bytes each rank writes already)."""
    if not ranks:
        raise ValueError("cannot assign tensors to an empty set of ranks")
    heap = [((loads or {}).get(rank, 0), rank) for rank in sorted(ranks)]
    heapq.heapify(heap)
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        heapq.heappush(heap, (load + max(sizes[name], 1), rank))
    return owners


def file_names(rank: int) -> dict[str, str]:
    """The data files ``rank`` writes: model weights, other state, per-rank state."""
    return {
        "model": f"model-{rank:05d}.safetensors",
        "state": f"state-{rank:05d}.safetensors",
        "rank": rank_file_name(rank),
    }
