"""The exchanges under :class:`~ddpckpt._coord.comm.Comm`: one rank's part of a message
through the store, rank 0's reply, and the waits between them.

Every exchange is numbered within its call (``_exchanges``) and keyed
``<namespace>/<call>/<tag>/<who>``. A rank posts its part under its own key; rank 0 waits
for every part (:meth:`Exchanges._collect`), reads them in one ``multi_get`` and posts one
reply (:meth:`Exchanges._publish`) that every other rank reads
(:meth:`Exchanges._receive`). Waits block in the store, judged by the call's heartbeat
(:mod:`ddpckpt._coord.liveness`), which names a silent rank.
"""

from __future__ import annotations

import json
from typing import Any

from ddpckpt._coord.failures import encode_error, timeout_error, unwrap
from ddpckpt._coord.liveness import Liveness, Watch
from ddpckpt._coord.store import multi_get, namespace, pack, unpack
from ddpckpt.errors import CheckpointError

LEADER = 0


class Exchanges:
    """Messages of one call through the store; :class:`~ddpckpt._coord.comm.Comm` is one."""

    call: str
    timeout: float
    rank: int
    world_size: int
    _store: Any
    _op: int
    _exchanges: int
    _shared_keys: list[str] | None
    _liveness: Liveness | None

    # ------------------------------------------------------------------ primitives

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order, on every rank.

        Every rank receives ``world_size`` payloads: prefer :meth:`run` or
        :meth:`run_gather` where only rank 0 needs them.
        """
        if self.world_size == 1:
            return [payload]
        payloads = self._collect(tag, payload)
        if payloads is not None:
            self._publish(tag, b"K" + pack(payloads))
            return payloads
        return unpack(self._receive(tag))

    def broadcast(self, tag: str, payload: bytes | None, src: int = 0) -> bytes:
        """``src``'s payload on every rank (other ranks pass ``None``)."""
        if self.rank == src and payload is None:
            raise ValueError("the broadcasting rank must pass a payload")
        if self.world_size == 1:
            return payload  # type: ignore[return-value]
        self._exchanges += 1
        key = self._key(tag, f"from{src}")
        self._share(key)
        if self.rank == src:
            self._store.set(key, b"K" + payload)  # type: ignore[operator]
            return payload  # type: ignore[return-value]
        self._live.wait(Watch(tag, {src: key}, self._exchanges, gather=False))
        return unwrap(self._store.get(key))

    def _collect(
        self, tag: str, payload: bytes, cause: BaseException | None = None
    ) -> list[bytes] | None:
        """Every rank's ``payload`` on rank 0 (``None`` on the others, which post theirs).

        Rank 0 blocks until every rank has posted, or its heartbeat thread has marked the
        silent ranks (then it publishes a timeout naming them and raises it).
        """
        self._exchanges += 1
        if self.rank != LEADER:
            self._store.set(self._key(tag, self.rank), b"K" + payload)
            self._live.posted(self._exchanges, tag)
            return None
        keys = {r: self._key(tag, r) for r in range(1, self.world_size)}
        self._live.wait(Watch(tag, keys, self._exchanges, gather=True))
        blobs = multi_get(self._store, list(keys.values()))
        silent = [r for r, blob in zip(keys, blobs, strict=True) if blob[:1] == b"T"]
        if silent:
            for r, blob in zip(keys, blobs, strict=True):
                if blob[:1] in (b"T", b"P"):  # markers: the ranks that posted delete their own
                    self._store.delete_key(keys[r])
            error = timeout_error(self.call, self.timeout, silent, tag)
            self._fail(tag, error)
            raise error from cause
        return [payload, *(blob[1:] for blob in blobs)]

    def _publish(self, tag: str, reply: bytes) -> None:
        """Rank 0 answers the exchange ``tag``: ``b"K"`` and data, or an encoded error."""
        key = self._key(tag, "reply")
        self._share(key)
        self._store.set(key, reply)

    def _receive(self, tag: str) -> bytes:
        """Rank 0's answer to the exchange ``tag``; raises the error it sent."""
        key = self._key(tag, "reply")
        self._share(key)
        self._live.wait(Watch(tag, {LEADER: key}, self._exchanges, gather=False))
        reply = self._store.get(key)
        self._store.delete_key(self._key(tag, self.rank))  # rank 0 has read it
        return unwrap(reply)

    def _receive_part(self, tag: str) -> Any:
        """This rank's part of a :meth:`run_scatter` (posted before the reply); deleted once read."""
        key = self._key(tag, f"to{self.rank}")
        part = json.loads(self._store.get(key))
        self._store.delete_key(key)
        return part

    def _fail(self, tag: str, error: CheckpointError) -> None:
        """Rank 0 timed out: tell every rank, also those waiting in another exchange."""
        blob = encode_error(error)
        self._store.set(self._key("failed", "all"), blob)
        self._live.mark_failed()
        self._publish(tag, blob)

    # ------------------------------------------------------------------ keys

    @property
    def _live(self) -> Liveness:
        """The call's heartbeat: every call with several ranks has one once opened."""
        assert self._liveness is not None, "exchanges need a Comm made by Comm.open"
        return self._liveness

    def _share(self, key: str) -> None:
        """Record a key every rank reads (the same list on every rank), for :meth:`close`."""
        if self._shared_keys is not None and key not in self._shared_keys:
            self._shared_keys.append(key)

    def _key(self, tag: str, who: int | str) -> str:
        return f"{namespace()}/{self._op}/{tag}/{who}"
