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
from collections.abc import Collection, Mapping, Sequence

from ddpckpt._format.rankparts import rank_file_name


def plan_owners(
    sizes: Mapping[str, int], domain: Sequence[int], movable: Collection[str]
) -> dict[str, int]:
    """Which of ``domain``'s ranks writes each tensor of ``sizes`` (bytes), for the storage
    domain of the calling rank (every domain's plan is the same function of its ranks).

    Tensors in ``movable`` are balanced over the domain's ranks (:func:`assign`); the
    others go to the domain's first rank.
    """
    movable_sizes = {name: size for name, size in sizes.items() if name in movable}
    return {**dict.fromkeys(sizes, domain[0]), **assign(movable_sizes, domain)}


def assign(sizes: Mapping[str, int], ranks: Sequence[int]) -> dict[str, int]:
    """Map each tensor name to one of ``ranks``, balancing the bytes."""
    if not ranks:
        raise ValueError("cannot assign tensors to an empty set of ranks")
    # all start at 0, ties to the lowest rank: only the len(sizes) lowest can get a tensor
    heap = [(0, rank) for rank in heapq.nsmallest(len(sizes), ranks)]
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
