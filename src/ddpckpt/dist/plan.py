"""Which rank writes (or reads) which tensor.

DDP state is replicated, so any rank holding it can write any tensor. Each tensor is
assigned to exactly one rank of a storage domain, largest first to the least-loaded
rank (longest-processing-time scheduling), which keeps every rank's bytes within one
tensor of the mean. Every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

__all__ = ["assign", "file_names"]


def assign(sizes: Mapping[str, int], ranks: Sequence[int]) -> dict[str, int]:
    """Map each tensor name to one of ``ranks``, balancing the bytes."""
    if not ranks:
        raise ValueError("cannot assign tensors to an empty set of ranks")
    heap = [(0, rank) for rank in sorted(ranks)]
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
        "rank": f"rank-{rank:05d}.safetensors",
    }
