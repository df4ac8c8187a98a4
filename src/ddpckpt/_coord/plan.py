"""Which rank writes (or reads) which tensor.

Every storage domain gets a full copy of the checkpoint. A tensor identical on every rank
(parameters DDP keeps replicated) can be written by any rank: each is assigned to exactly
one rank of the domain, largest first to the least-loaded rank (longest-processing-time
scheduling), which keeps every rank's bytes within one tensor of the mean. Every other
tensor is written by the domain's first rank, which holds rank 0's values. The plan is
a pure function of its inputs, so every rank computes the same one without exchanging it.

A file one rank holds that other ranks lack (a repair, :mod:`ddpckpt._coord.replicate`)
reaches them by doubling (:class:`FanOut`): every rank that has it passes it on to one that
lacks it, round after round, so ``R`` receivers are served in ``ceil(log2(R + 1))`` rounds
and no rank sends more than once a round.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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
    """Map each tensor name to one of ``ranks`` (in increasing order, as a storage domain
    lists them), balancing the bytes; in time of the tensors, not of the ranks."""
    if not ranks:
        raise ValueError("cannot assign tensors to an empty set of ranks")
    # all start at 0, ties to the lowest rank: only the len(sizes) lowest can get a tensor
    heap = [(0, rank) for rank in ranks[: len(sizes)]]
    heapq.heapify(heap)
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        heapq.heappush(heap, (load + max(sizes[name], 1), rank))
    return owners


@dataclass(frozen=True)
class Transfer:
    """One rank's part in one round of a :class:`FanOut`."""

    round: int
    role: Literal["send", "receive"]
    peer: int  # the rank it sends to, or receives from


@dataclass(frozen=True)
class FanOut:
    """How a file ``holder`` has reaches every one of ``receivers`` (distinct ranks, the
    holder not among them), the same plan on every rank.

    Ranks are lined up as ``[holder, *receivers]``; in round ``k`` the first ``2**k`` of
    the line, who have the file, send it to the next ``2**k``. Invariants (tested at
    thousands of receivers): each receiver receives once, from a rank that had it in an
    earlier round; a rank takes part at most once a round; :attr:`rounds` is
    ``ceil(log2(R + 1))``; a rank's own part (:meth:`part_at`) is computed in
    ``O(log R)`` from its place in the line, without listing the others'. Ranks that carry out their parts in round order (file by
    file, in one order) cannot wait on each other in a circle: matching parts share a
    round.
    """

    holder: int
    receivers: tuple[int, ...]

    @property
    def rounds(self) -> int:
        return len(self.receivers).bit_length()

    def part(self, rank: int) -> list[Transfer]:
        """What ``rank`` does, in round order (nothing if it is neither holder nor receiver)."""
        if rank == self.holder:
            return self.part_at(0)
        if rank not in self.receivers:
            return []
        return self.part_at(self.receivers.index(rank) + 1)

    def part_at(self, place: int) -> list[Transfer]:
        """:meth:`part` of the rank at ``place`` in the line (0: the holder; ``i + 1``:
        ``receivers[i]``; any other number: a rank outside it, which does nothing), in
        ``O(log R)``."""
        line = len(self.receivers) + 1
        if not 0 <= place < line:
            return []
        parts = []
        if place:
            k = place.bit_length() - 1  # the round in which the line reaches it
            parts.append(Transfer(k, "receive", self._at(place - (1 << k))))
        k = place.bit_length()
        while place + (1 << k) < line:
            parts.append(Transfer(k, "send", self._at(place + (1 << k))))
            k += 1
        return parts

    def _at(self, place: int) -> int:
        return self.holder if place == 0 else self.receivers[place - 1]


@dataclass(frozen=True)
class Partners:
    """Which storage domains keep a copy of which ranks' own files (node-local storage).

    Every domain keeps its own ranks' files and those of the ``count`` domains before it
    in the ring of domains (``None``: of every domain, what a durable save on node-local
    storage keeps; the fast tier keeps ``FastTier.partners``). A domain's files then
    survive the loss of any ``count`` domains; a save costs each domain ``count``
    transfers, in ``count`` rounds, whatever the number of domains. Pure: every rank
    computes the same answers alone.
    """

    domains: Sequence[Sequence[int]]
    count: int | None = None

    @property
    def shifts(self) -> range:
        """The distances, along the ring, of the domains a domain sends its files to."""
        many = len(self.domains) - 1
        return range(1, (many if self.count is None else min(self.count, many)) + 1)

    def keepers(self, index: int) -> list[int]:
        """The indexes of the domains keeping copies of domain ``index``'s files (itself
        first)."""
        return [index, *((index + s) % len(self.domains) for s in self.shifts)]

    def kept_by(self, index: int) -> list[int]:
        """The indexes of the domains whose files domain ``index`` keeps (itself first)."""
        return [index, *((index - s) % len(self.domains) for s in self.shifts)]

    def kept_count(self, index: int) -> int:
        """How many ranks' own files domain ``index``'s copy holds."""
        return sum(len(self.domains[i]) for i in self.kept_by(index))

    def ranks_kept_by(self, index: int) -> list[int]:
        """The ranks whose own files domain ``index``'s copy holds, in rank order."""
        return sorted(r for i in self.kept_by(index) for r in self.domains[i])


def file_names(rank: int) -> dict[str, str]:
    """The data files ``rank`` writes: model weights, other state, per-rank state."""
    return {
        "model": f"model-{rank:05d}.safetensors",
        "state": f"state-{rank:05d}.safetensors",
        "rank": rank_file_name(rank),
    }
