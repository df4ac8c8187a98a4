"""Bulk bytes between ranks, point to point over gloo groups of two.

Rank files and tensors that every storage domain's copy needs (node-local storage) never
travel through the key-value store: they go over gloo, so the store carries only small
messages whatever the model's size. Only ranks that exchange bytes are ever connected, by
a group of the two of them (:func:`pair_group`): building it costs each of the two one
address posted and one read, and one connection. :func:`send_to_leaders` passes every
rank's bundle around a ring of the domains' first ranks, so that a save on node-local
storage costs every rank the same few store operations and connections whatever the
number of ranks (a full mesh of every rank, as before, cost each rank an address read and
a connection per other rank).

Groups are built on the store under keys of their own (each rank's address, deleted when
the call closes) and shut down when the transfer ends: a transfer that failed leaves
nothing behind for the next one, and torch's own count of the groups made with
``dist.new_group`` never moves, so the user's groups still match. A rank blocked in a
transfer (building a group, sending, receiving) gives up within a fraction of a second
once a rank of the call has posted a failure (:class:`~ddpckpt._coord.failures.PeerFailure`),
rather than at the timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpckpt._coord.failures import PeerFailure
from ddpckpt._coord.plan import FanOut, Partners
from ddpckpt._coord.store import namespace, pack, unpack

_POLL = 0.25  # seconds between looks at the call's failure key while a transfer waits


@contextmanager
def pair_group(
    store: Any, key: str, rank: int, peer: int, timeout: float, failed: Callable[[], bool]
) -> Iterator[Pair]:
    """A gloo group of ``rank`` and ``peer`` alone, for one transfer between them; both
    enter it with the same ``key`` (unique to the transfer within the job).

    Its rendezvous and operations time out after ``timeout`` seconds, and give up once
    ``failed()`` says a rank of the call failed; it is shut down on leaving, also on failure.
    """
    low, high = sorted((rank, peer))
    watching = _Watching(store, failed)  # referenced here: torch holds no Python reference
    prefixed = dist.PrefixStore(_prefix(f"{key}/{low}-{high}"), watching)
    group = dist.ProcessGroupGloo(prefixed, int(rank == high), 2, timedelta(seconds=timeout))
    try:
        yield Pair(group, int(peer == high), failed)
    finally:
        group.shutdown()


def rendezvous_keys(key: str, rank: int, peer: int) -> list[str]:
    """The store keys that the pair group ``key`` of ``rank`` and ``peer`` leaves behind for
    ``rank``: its address, which the peer reads while the group is made (torch writes
    ``<prefix>/<device>/<rank in the group>``; the group has one device). Delete them once
    both are past the transfer's step."""
    low, high = sorted((rank, peer))
    return [f"{_prefix(f'{key}/{low}-{high}')}/0/{int(rank == high)}"]


def _prefix(key: str) -> str:
    return f"{namespace()}/copies/{key}"


class Pair:
    """One end of a :func:`pair_group`: sends to and receives from the other end."""

    def __init__(self, group: Any, peer: int, failed: Callable[[], bool]) -> None:
        self.group, self.peer, self._failed = group, peer, failed

    def send(self, tensor: torch.Tensor) -> Any:
        return self.group.send([tensor], self.peer, 0)

    def recv(self, tensor: torch.Tensor) -> Any:
        return self.group.recv([tensor], self.peer, 0)

    def send_bytes(self, data: bytes) -> None:
        """``data`` (not empty), its size first; :meth:`recv_bytes` on the other end."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.finish([self.send(size), self.send(payload)])

    def recv_bytes(self) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        self.finish([self.recv(size)])
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.finish([self.recv(payload)])
        return payload.numpy().tobytes()

    def finish(self, works: Sequence[Any]) -> None:
        """Wait for ``works``; give up with :class:`PeerFailure` once the call has failed."""
        finish(works, self._failed)


def finish(works: Sequence[Any], failed: Callable[[], bool]) -> None:
    """Wait for every gloo work of ``works``; give up with :class:`PeerFailure` once
    ``failed()`` (asked every quarter second) says a rank of the call failed.

    A gloo wait cannot be interrupted, and a work is not marked complete before it is
    waited for: a helper thread waits, until the group's timeout at most.
    """
    outcome: list[BaseException] = []
    done = threading.Event()

    def wait() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as exc:  # handed to the caller below
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, name="ddpckpt-transfer", daemon=True).start()
    while not done.wait(_POLL):
        if failed():
            raise PeerFailure("another rank failed during this transfer")
    if outcome:
        raise outcome[0]


def send_to_leaders(comm: Any, partners: Partners, bundle: bytes) -> dict[int, bytes]:
    """Send this rank's ``bundle`` to the first rank of every storage domain that keeps
    its files (``partners``); every rank calls it (inside a ``comm.run_transfer`` step,
    which reports a failure on every rank at once).

    Returns what this rank received: the bundle of every rank of the domains whose files
    its domain keeps, if it leads one, else nothing. The ranks of a domain hand their
    bundles to its first rank. With partners of every domain, the first ranks pass each
    domain's bundles around their ring (``D - 1`` rounds); with ``k`` partners each sends
    its domain's bundles to the ``k`` after it and receives from the ``k`` before it
    (``k`` rounds, ``2k`` groups, whatever the number of domains).
    """
    domains = partners.domains
    index = next(i for i, d in enumerate(domains) if comm.rank in d)
    domain = domains[index]
    leader = domain[0]
    with ExitStack() as groups:
        if comm.rank != leader:
            groups.enter_context(comm.pair("copies", leader)).send_bytes(bundle)
            return {}
        bundles = {comm.rank: bundle}
        for member in domain[1:]:
            bundles[member] = groups.enter_context(comm.pair("copies", member)).recv_bytes()
        leaders = [d[0] for d in domains]
        mine = pack([bundles[r] for r in domain])
        if partners.count is None:
            sets = _around_ring(comm, groups, leaders, mine)
            found = {i: sets[i] for i in partners.kept_by(index)[1:]}
        else:
            found = _to_partners(comm, groups, leaders, mine, partners)
    received: dict[int, bytes] = {}
    for other, data in found.items():
        received.update(zip(domains[other], unpack(data), strict=True))
    return received


def _to_partners(
    comm: Any, groups: ExitStack, leaders: list[int], mine: bytes, partners: Partners
) -> dict[int, bytes]:
    """The ``mine`` of the leaders of the domains whose files this leader's domain keeps,
    by domain index; each leader calls it. In round ``s`` every leader sends to the
    leader ``s`` after it and receives from the one ``s`` before it. Links are built in
    one order on every rank (lowest pair of ranks first), so no leader waits for a link
    that waits for another."""
    count, index = len(leaders), leaders.index(comm.rank)
    peers = {leaders[(index + s) % count] for s in partners.shifts}
    peers |= {leaders[(index - s) % count] for s in partners.shifts}
    links = {}
    for peer in sorted(peers, key=lambda p: (min(p, comm.rank), max(p, comm.rank))):
        links[peer] = groups.enter_context(comm.pair("partners", peer))
    found = {}
    for shift in partners.shifts:
        after, before = leaders[(index + shift) % count], leaders[(index - shift) % count]
        found[(index - shift) % count] = _swap(links[after], links[before], mine)
    return found


def from_first_leader(comm: Any, domains: list[list[int]], data: bytes | None) -> bytes | None:
    """Rank 0's ``data`` at the first rank of every storage domain, by doubling
    (:class:`~ddpckpt._coord.plan.FanOut`: ``ceil(log2 D)`` rounds for ``D`` domains, no
    rank sending more than once a round); every rank calls it, rank 0 with ``data``.
    Returns it where received (and on rank 0), else ``None``."""
    fan = FanOut(0, tuple(d[0] for d in domains if d[0] != 0))
    with ExitStack() as groups:
        for part in fan.part(comm.rank):  # in round order: matching parts share a round
            link = groups.enter_context(comm.pair(f"shared{part.round}", part.peer))
            if part.role == "receive":
                data = link.recv_bytes()
            else:
                link.send_bytes(data)
    return data


def _swap(forward: Pair, back: Pair, data: bytes) -> bytes:
    """Send ``data`` over ``forward`` while receiving what comes over ``back``."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    incoming = torch.zeros(1, dtype=torch.int64)
    sent = [forward.send(size), forward.send(payload)]
    back.finish([back.recv(incoming)])
    buffer = torch.empty(int(incoming), dtype=torch.uint8)
    back.finish([back.recv(buffer), *sent])
    return buffer.numpy().tobytes()


def _around_ring(comm: Any, groups: ExitStack, leaders: list[int], mine: bytes) -> list[bytes]:
    """Every leader's ``mine``, in the order of ``leaders``; each of them calls it.

    ``len(leaders) - 1`` rounds: in each, a leader passes the set it got last to the next
    leader and gets one from the previous. The ring's links are built in at most three
    waves (alternate links, and the closing one of an odd ring), so no leader waits for a
    link that waits for another.
    """
    count, index = len(leaders), leaders.index(comm.rank)
    sets: list[bytes | None] = [None] * count
    sets[index] = mine
    if count == 1:
        return sets  # type: ignore[return-value]
    after, before = leaders[(index + 1) % count], leaders[(index - 1) % count]
    waves = {after: _wave(index, count), before: _wave((index - 1) % count, count)}
    links = {
        peer: groups.enter_context(comm.pair("ring", peer))
        for peer in sorted(waves, key=waves.__getitem__)
    }
    forward, back = links[after], links[before]  # one link when two leaders
    for step in range(count - 1):
        out, into = (index - step) % count, (index - step - 1) % count
        sets[into] = _swap(forward, back, sets[out])  # type: ignore[arg-type]
    return sets  # type: ignore[return-value]


def _wave(link: int, count: int) -> int:
    """When link ``link`` of a ring of ``count`` is built: alternate links in waves 0 and
    1, the link closing a ring of odd length last."""
    if count % 2 and link == count - 1:
        return 2
    return link % 2


class _Watching(dist.Store):
    """A torch store over any client with the store's methods (gloo's rendezvous needs one),
    whose waits give up once the call has failed."""

    def __init__(self, client: Any, failed: Callable[[], bool]) -> None:
        super().__init__()
        self._client = client
        self._failed = failed

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
        """Look for ``keys`` (never a blocking wait: one that times out logs a warning in
        torch), giving up once the call has failed."""
        limit = time.monotonic() + (timeout[0].total_seconds() if timeout else 300.0)
        pause, looked = 0.0005, time.monotonic()
        while not self._client.check(keys):
            now = time.monotonic()
            if now > limit:
                raise TimeoutError(f"timed out after {timeout} waiting for {keys}")
            if now - looked > _POLL:
                if self._failed():
                    raise PeerFailure("another rank failed while this transfer was set up")
                looked = now
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.set_timeout(timeout)
