"""The exchanges under :class:`~ddpckpt._coord.comm.Comm`: one rank's part of a message
through the store, rank 0's reply, and the waits between them.

Every exchange is numbered within its call (``_exchanges``) and keyed
``<namespace>/<call>/<tag>/<who>``. A rank posts its part under its own key; rank 0 waits
for every part (:meth:`Exchanges._collect`), reads them in one ``multi_get`` and posts one
reply (:meth:`Exchanges._publish`) that every other rank reads
(:meth:`Exchanges._receive`). Waits block in the store, judged by the call's heartbeat
(:mod:`ddpckpt._coord.liveness`), which names a silent rank.

A rank that fails outside an exchange (between steps, or with an exception no step
catches) posts its failure under the call's failure key (:meth:`Exchanges.post_failure`);
every rank's heartbeat looks there once a period while its main thread waits, so the
others raise that rank's error within about a second, not a "stopped responding" after
the whole timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from ddpckpt._coord.failures import (
    combine,
    decode_error,
    describe,
    encode_error,
    timeout_error,
    unwrap,
)
from ddpckpt._coord.liveness import Liveness, Watch
from ddpckpt._coord.store import multi_get, namespace, pack, unpack
from ddpckpt._coord.wire import Mark
from ddpckpt.errors import CheckpointError

T = TypeVar("T")
E = TypeVar("E", bound=Exception)
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
    _settled: bool  # this rank has raised (or is raising) an error every rank of the call raises
    _orphans: list[str]  # keys rank 0 may still read: the last rank to leave deletes them

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
            self._publish(tag, Mark.DATA + pack(payloads))
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
            self._store.set(key, Mark.DATA + payload)  # type: ignore[operator]
            return payload  # type: ignore[return-value]
        self._live.wait(Watch(tag, {src: key}, self._exchanges, gather=False))
        return self._unwrap(self._store.get(key))

    def alone(self, work: Callable[[], T]) -> T:
        """Run ``work``, which this rank does on its own between collective steps (staging
        its share, waiting for its copies).

        If it fails, the ranks still in the call raise its error within a heartbeat
        period (instead of waiting for this rank until the timeout and calling it silent),
        and this rank raises the same error with its own exception chained, as if the
        work had been a step of :meth:`run`. ``KeyboardInterrupt`` and the like are posted
        to the others the same way and raised here unchanged. With one process the
        exception propagates unchanged.
        """
        try:
            return work()
        except Exception as exc:
            if self.world_size == 1 or self._settled:
                raise
            raise self.post_failure(exc) from exc
        except BaseException as exc:
            if self.world_size > 1 and not self._settled:
                self.post_failure(exc)
            raise

    def _collect(
        self, tag: str, payload: bytes, cause: BaseException | None = None
    ) -> list[bytes] | None:
        """Every rank's ``payload`` on rank 0 (``None`` on the others, which post theirs).

        Rank 0 blocks until every rank has posted, or its heartbeat thread has marked the
        silent ranks (then it publishes a timeout naming them and raises it).
        """
        self._exchanges += 1
        if self.rank != LEADER:
            self._store.set(self._key(tag, self.rank), Mark.DATA + payload)
            self._live.posted(self._exchanges, tag)
            return None
        keys = {r: self._key(tag, r) for r in range(1, self.world_size)}
        self._live.wait(Watch(tag, keys, self._exchanges, gather=True))
        blobs = multi_get(self._store, list(keys.values()))
        marked = [r for r, blob in zip(keys, blobs, strict=True) if Mark.wakes(blob)]
        if marked:
            for r in marked:  # no rank posted these: rank 0 deletes them
                self._store.delete_key(keys[r])
            silent = [r for r, blob in zip(keys, blobs, strict=True) if blob[:1] == Mark.SILENT]
            error = self._fail(tag, timeout_error(self.call, self.timeout, silent, tag))
            raise error from cause
        return [payload, *(blob[1:] for blob in blobs)]

    def _publish(self, tag: str, reply: bytes) -> None:
        """Rank 0 answers the exchange ``tag``: ``Mark.DATA`` and data, or an encoded error."""
        key = self._key(tag, "reply")
        self._share(key)
        self._store.set(key, reply)
        if reply[:1] == Mark.ERROR:
            self._settled = True

    def _receive(self, tag: str) -> bytes:
        """Rank 0's answer to the exchange ``tag``; raises the error it sent."""
        key = self._key(tag, "reply")
        self._share(key)
        self._live.wait(Watch(tag, {LEADER: key}, self._exchanges, gather=False))
        reply = self._store.get(key)
        if reply[:1] == Mark.FAILED:  # a posted failure, not rank 0's reply: it may still read both
            self._orphans += [self._key(tag, self.rank), key]
        else:
            self._store.delete_key(self._key(tag, self.rank))  # rank 0 has read it
        return self._unwrap(reply)

    def _unwrap(self, reply: bytes) -> bytes:
        """:func:`unwrap`, noting that an error it raises is one every rank raises."""
        if Mark.raises(reply):
            self._settled = True
        return unwrap(reply)

    def _receive_part(self, tag: str) -> Any:
        """This rank's part of a :meth:`run_scatter` (posted before the reply); deleted once read."""
        key = self._key(tag, f"to{self.rank}")
        part = json.loads(self._store.get(key))
        self._store.delete_key(key)
        return part

    def _fail(self, tag: str, error: CheckpointError) -> CheckpointError:
        """Rank 0's wait ended without every part: tell every rank, also those waiting in
        another exchange. A failure a rank posted wins over the timeout; returns the error
        to raise."""
        blob = self._store.compare_set(self._key("failed", "all"), b"", encode_error(error))
        self._live.mark_failed()
        self._publish(tag, blob)
        return decode_error(blob)

    def everywhere(self, error: E) -> E:
        """Mark ``error`` as one every rank raises at this point of the call (it follows from
        an answer every rank got, e.g. a reduced result), so that leaving the call with it
        is leaving after a failure on every rank (see ``Comm.close``); returns it, to raise."""
        self._settled = True
        return error

    def post_failure(self, exc: BaseException) -> CheckpointError:
        """Post ``exc``, which this rank hit outside an exchange, for every rank still in the
        call; returns the error every rank raises (the first failure posted in the call).

        Every rank's heartbeat looks for it while its main thread waits, so they raise it
        within a heartbeat period instead of naming this rank silent after the timeout.
        """
        error = combine(self.call, {self.rank: describe(exc)})
        blob = self._store.compare_set(self._key("failed", "all"), b"", encode_error(error))
        self._settled = True
        return decode_error(blob)

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
