"""Bulk bytes between ranks, point to point over a gloo group of one call's own.

Rank files and tensors that every storage domain's copy needs (node-local storage) never
travel through the key-value store: each rank sends its bundle straight to the first rank
of every other domain (:func:`send_to_leaders`), on a gloo group made for that transfer
alone (:func:`transfer_group`), so the store carries only small messages whatever the
model's size.

The group is built directly on the store, under keys of its own (deleted when the call
closes), and shut down when the transfer ends: a transfer that failed (a rank that raised, a peer that timed out and closed
its connections) leaves nothing behind for the next one, and torch's own count of the
groups made with ``dist.new_group`` never moves, so the user's groups still match.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpckpt._coord.store import namespace


@contextmanager
def transfer_group(
    store: Any, key: str, rank: int, world_size: int, timeout: float
) -> Iterator[Any]:
    """A gloo group of ``world_size`` ranks, for one transfer; every rank enters it with
    the same ``key`` (unique to the transfer), inside the call's step.

    Its rendezvous and operations time out after ``timeout`` seconds; it is shut down on
    leaving, also on failure.
    """
    if not isinstance(store, dist.Store):  # a client of another kind (a wrapper): adapt it
        store = _Delegating(store)
    prefixed = dist.PrefixStore(_prefix(key), store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout))
    try:
        yield group
    finally:
        group.shutdown()


def rendezvous_keys(key: str, rank: int) -> list[str]:
    """The store keys that transfer ``key``'s rendezvous leaves behind for ``rank``: its
    address, which every other rank reads while its group is made (torch writes
    ``<prefix>/<device>/<rank>``; the group has one device). Delete them once every rank is
    past the transfer's step."""
    return [f"{_prefix(key)}/0/{rank}"]


def _prefix(key: str) -> str:
    return f"{namespace()}/copies/{key}"


def send_to_leaders(comm: Any, domains: list[list[int]], bundle: bytes) -> dict[int, bytes]:
    """Send this rank's ``bundle`` to the first rank of every other storage domain; every
    rank calls it (inside a ``comm.run``, which reports a failure on every rank).

    Returns what this rank received: every rank's bundle outside its domain if it leads
    one, else nothing. Sizes go first, then the bytes, all non-blocking, so no order of
    sends and receives can deadlock.
    """
    domain = next(d for d in domains if comm.rank in d)
    leaders = [d[0] for d in domains if d is not domain]
    senders = [r for d in domains if d is not domain for r in d] if domain[0] == comm.rank else []
    size = torch.tensor([len(bundle)], dtype=torch.int64)
    sizes = {r: torch.zeros(1, dtype=torch.int64) for r in senders}
    with comm.transfer_group("copies") as group:
        _exchange(group, [(size, to) for to in leaders], [(sizes[r], r) for r in senders])
        data = torch.frombuffer(bytearray(bundle), dtype=torch.uint8)
        buffers = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in senders}
        _exchange(group, [(data, to) for to in leaders], [(buffers[r], r) for r in senders])
    return {r: buffers[r].numpy().tobytes() for r in senders}


def _exchange(
    group: Any, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]
) -> None:
    """Post every send and receive at once (the call's ranks), then wait for all of them."""
    works = [group.send([t], to, 0) for t, to in sends]
    works += [group.recv([t], sender, 0) for t, sender in receives]
    for work in works:
        work.wait()


class _Delegating(dist.Store):
    """A torch store over any client with the store's methods (gloo's rendezvous needs one)."""

    def __init__(self, client: Any) -> None:
        super().__init__()
        self._client = client

    def set(self, key: str, value: Any) -> None:
        self._client.set(key, value)

    def get(self, key: str) -> bytes:
        return self._client.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._client.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._client.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._client.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(key)

    def wait(self, keys: list[str], *timeout: timedelta) -> None:
        self._client.wait(keys, *timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.set_timeout(timeout)
