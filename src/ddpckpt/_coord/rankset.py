"""A set of ranks as an answer the ranks receive: sorted, disjoint ``[start, stop)`` spans.

The ranks of a node are consecutive, so a set of whole nodes (those whose fast tier holds a
step, say) takes one span per run of nodes: an answer naming it stays a few numbers long at
any number of ranks, where a list of the ranks grew to tens of kilobytes per rank (and
gigabytes through rank 0's store in all) at thousands of ranks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSet:
    """Ranks as sorted, disjoint, non-adjacent ``[start, stop)`` spans."""

    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        """The set of ``ranks`` (any order, repeats allowed)."""
        spans: list[list[int]] = []
        for rank in sorted(set(ranks)):
            if spans and spans[-1][1] == rank:
                spans[-1][1] = rank + 1
            else:
                spans.append([rank, rank + 1])
        return cls(tuple((a, b) for a, b in spans))

    @classmethod
    def from_json(cls, value: list[list[int]]) -> RankSet:
        """The set :meth:`to_json` wrote (sent by rank 0 of the same job)."""
        return cls(tuple((int(a), int(b)) for a, b in value))

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.spans]

    def __len__(self) -> int:
        return sum(b - a for a, b in self.spans)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect.bisect_right(self.spans, (rank, float("inf"))) - 1
        return i >= 0 and self.spans[i][0] <= rank < self.spans[i][1]

    def mask(self, world_size: int) -> list[bool]:
        """``[r in self for r in range(world_size)]``, in O(world_size)."""
        have = [False] * world_size
        for a, b in self.spans:
            have[a:b] = [True] * (min(b, world_size) - a)
        return have
