"""Telling a slow rank from a dead one: heartbeats, and judging what a rank waits for.

Ranks inside a ddpckpt call heartbeat: a thread per call and rank, on a second store
connection, writes the rank's heartbeat record once per period and judges what its main
thread waits for (a :class:`Watch`). Rank 0 reads the records of the ranks it still waits
for in one ``multi_get``; the others read rank 0's (or the broadcaster's) only. So
liveness costs O(ranks) store operations per period in all.

A rank that makes no progress for ``timeout`` seconds is named: the judging thread writes
a marker into the key its main thread waits on, which wakes it. So a slow but alive
writer is never timed out, while a killed one (or ranks waiting for each other in
different exchanges) is, within ``timeout`` plus two heartbeat periods (a period is
``min(1 s, timeout / 8)``: at most 1.25x); a rank silent since the wait began (one that
never arrived) is judged right at its deadline, ``timeout`` after the wait began.

The judging thread also looks for a failure another rank posted in the call (one
``check`` per period, see :meth:`ddpckpt._coord.exchange.Exchanges.post_failure`) and
wakes its main thread with it. While rank 0 waits for ranks that have not entered the call
at all, it says which, once, after ``notice`` seconds.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ddpckpt._coord.failures import encode_error, rank_list, timeout_error
from ddpckpt._coord.store import StoreGroup, StoreTimeout, multi_get, namespace
from ddpckpt._coord.wire import Mark
from ddpckpt._log import get_logger

_log = get_logger(__name__)
MAX_PERIOD = 1.0  # seconds between heartbeats (and liveness checks) at most
_SLACK = 0.01  # seconds past a deadline at which to judge it
_FEW = 8  # ranks whose heartbeat records are looked for by halving rather than the roster


@dataclass
class Beat:
    """One call's heartbeat on one rank, as the store holds it (``"op alive work posted failed tag"``).

    A rank's record holds an entry per call open on it (an asynchronous save's call stays
    open while the training thread makes others); readers look at the entry of their call.
    """

    op: int
    alive: int
    work: int
    posted: int  # exchanges of call ``op`` this rank has posted its part of
    failed: int  # 1 if the rank raised an error for every rank in call ``op``
    posted_tag: int = 0  # tag_code of the last exchange posted: tells mismatched ones apart

    @classmethod
    def find(cls, record: bytes, op: int) -> Beat | None:
        """Call ``op``'s entry in a rank's heartbeat ``record``, if the call is open there."""
        for entry in record.split(b";"):
            fields = [int(x) for x in entry.split()]
            if fields and fields[0] == op:
                return cls(*fields)
        return None

    def encode(self) -> bytes:
        """This entry as it appears in the rank's heartbeat record."""
        fields = (self.op, self.alive, self.work, self.posted, self.failed, self.posted_tag)
        return " ".join(str(f) for f in fields).encode()


@dataclass
class Watch:
    """What the main thread is blocked on, for the heartbeat thread to judge.

    ``keys`` maps each rank to the key it must set; ``exchange`` is the exchange's number
    in the call. A rank makes progress while its marker (``work`` counter for ranks the
    leader gathers from, ``alive`` counter for a rank others wait on) changes within the
    timeout; the clock of every rank starts when the wait starts.
    """

    tag: str
    keys: dict[int, str]
    exchange: int
    gather: bool
    started: float = field(default_factory=time.monotonic)
    seen: dict[int, tuple[Any, float]] = field(default_factory=dict)
    posted: set[int] = field(default_factory=set)  # ranks seen to have posted: not read again
    noticed: bool = False  # rank 0 said which ranks it waits for

    def silent(self, rank: int, marker: Any, now: float, timeout: float) -> bool:
        """Whether ``rank``'s progress ``marker`` (``None``: unknown) has not changed for
        more than ``timeout`` seconds."""
        last = self.seen.get(rank)
        if last is None:
            last = self.seen[rank] = (marker, self.started)
        elif marker is not None and marker != last[0]:
            last = self.seen[rank] = (marker, now)
        return now - last[1] > timeout


class Liveness:
    """One call's heartbeat on this rank, and the judge of what the call's main thread waits for.

    :meth:`start` adds the call to the rank's heartbeat record and starts the thread that
    writes the record every period and judges the current :class:`Watch`; the main thread
    blocks in :meth:`wait`; :meth:`stop` ends the thread when the call closes.
    ``failed_key`` is the call's key where a failure for every rank is posted; ``notice``
    the seconds after which rank 0 names the ranks that have not entered the call.
    """

    def __init__(
        self,
        group: StoreGroup,
        op: int,
        call: str,
        timeout: float,
        failed_key: str,
        notice: float = float("inf"),
    ) -> None:
        self.group = group
        self.call = call
        self.timeout = timeout
        self.notice = notice
        self.beat = Beat(op, 0, 0, 0, 0)
        self.period = min(MAX_PERIOD, timeout / 8)
        self._failed_key = failed_key
        self._store: Any = None
        self._blocking = False
        self._stop = threading.Event()
        self._waiting = threading.Event()
        self._watch: Watch | None = None
        self._thread: threading.Thread | None = None

    def start(self, store: Any, watcher: Any | None, own_connection: bool) -> None:
        """Beat every period on ``watcher`` (else ``store``, the main thread's connection).

        Waits on a connection of the call's own (``own_connection``) can block until the
        heartbeat thread wakes them; otherwise :meth:`wait` judges between short slices.
        """
        self._store = store
        self._blocking = watcher is not None and own_connection
        client = watcher or store
        with self.group._lock:
            self.group._open[self.beat.op] = self.beat

        def beat() -> None:
            try:
                while True:
                    self.beat.alive += 1
                    if not self._waiting.is_set():
                        self.beat.work += 1
                    client.set(beat_key(self.group.rank), self.group.beat_record())
                    if not self.group._enrolled:
                        self._enroll(client)
                    watch = self._watch
                    if watch is not None:
                        self._judge(client, watch)
                    if self._stop.wait(self._pause(watch)):
                        return
            except RuntimeError as exc:  # the store went away: the waiting main thread sees it
                _log.warning("ddpckpt heartbeat of rank %d stopped: %s", self.group.rank, exc)

        self._thread = threading.Thread(target=beat, name="ddpckpt-heartbeat", daemon=True)
        self._thread.start()

    def _pause(self, watch: Watch | None) -> float:
        """Seconds until the next beat: a period, or less if a rank that has made no
        progress since the wait began would be silent sooner (so it is named at the
        timeout, not up to a period later)."""
        if watch is None:
            return self.period
        due = watch.started + self.timeout + _SLACK - time.monotonic()
        return min(self.period, due) if due > 0 else self.period

    def stop(self) -> None:
        """End the heartbeat thread and take the call out of the rank's record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.group._lock:
            self.group._open.pop(self.beat.op, None)

    def posted(self, exchange: int, tag: str) -> None:
        """Record that this rank posted its part of exchange number ``exchange`` (``tag``)."""
        self.beat.posted, self.beat.posted_tag = exchange, tag_code(tag)

    def mark_failed(self) -> None:
        """Publish that this rank raised an error for every rank in this call."""
        self.beat.failed = 1
        self._store.set(beat_key(self.group.rank), self.group.beat_record())

    def wait(self, watch: Watch) -> None:
        """Block until every key of ``watch`` exists (the heartbeat thread sets markers)."""
        blocking = self._blocking
        slice_ = timedelta(seconds=max(4 * self.timeout, 300.0) if blocking else self.period)
        self._watch = watch
        self._waiting.set()
        try:
            while True:
                try:
                    self._store.wait(list(watch.keys.values()), slice_)
                    return
                except StoreTimeout:
                    if self._thread is None or not self._thread.is_alive():
                        raise
                    if not blocking:  # nobody can wake this wait: judge here between slices
                        self._judge(self._store, watch)
        finally:
            self._watch = None
            self._waiting.clear()

    def _judge(self, client: Any, watch: Watch) -> None:
        """Wake the main thread with a marker or an error if what it waits for is silent."""
        now = time.monotonic()
        failed = self._failed_key
        if watch.gather:
            unknown = [r for r in watch.keys if r not in watch.posted]
            if client.check([failed]):  # a rank failed on its own: wake rank 0 with it
                for r in unknown:
                    client.compare_set(watch.keys[r], b"", Mark.POSTED)
                return
            beats = self._beats(client, unknown)
            mine = (watch.exchange, tag_code(watch.tag))
            watch.posted.update(r for r, b in beats.items() if (b.posted, b.posted_tag) == mine)
            pending = [r for r in unknown if r not in watch.posted]
            if watch.tag == "enter" and not watch.noticed and now - watch.started >= self.notice:
                self._say_absent(watch, [r for r in pending if r not in beats])
            silent = [
                r
                for r in pending
                if watch.silent(r, beats[r].work if r in beats else None, now, self.timeout)
            ]
            marked = [
                r
                for r in silent
                if client.compare_set(watch.keys[r], b"", Mark.SILENT) == Mark.SILENT
            ]
            if marked:  # wake rank 0: every key it waits for must exist
                for r in pending:
                    if r not in marked:
                        client.compare_set(watch.keys[r], b"", Mark.PENDING)
            return
        ((source, key),) = watch.keys.items()
        # Rank 0's heartbeat record says "failed" only until its next call rewrites it, which
        # can come within one period: the call's own failure key is what must be read.
        if client.check([failed]):  # rank 0 may not have read this rank's part
            client.compare_set(key, b"", Mark.FAILED + client.get(failed)[1:])
            return
        beat = self._beats(client, [source]).get(source)
        if watch.silent(source, beat.alive if beat else None, now, self.timeout):
            error = timeout_error(self.call, self.timeout, [source], watch.tag)
            client.compare_set(key, b"", encode_error(error))

    def _say_absent(self, watch: Watch, absent: list[int]) -> None:
        """Rank 0 names, once per wait, the ranks that have not called yet."""
        if not absent:
            return
        watch.noticed = True
        plural = "s" if len(absent) > 1 else ""
        _log.warning(
            "rank 0 has waited %.0f s in %s for rank%s %s, which did not call it yet; every "
            "rank must call %s (not inside `if rank == 0`). Waiting up to %g s (timeout= or "
            "DDPCKPT_TIMEOUT): a rank that died before calling cannot be told from a slow one "
            "until then (its launcher's log says whether it died)",
            time.monotonic() - watch.started,
            self.call,
            plural,
            rank_list(absent),
            self.call,
            self.timeout,
        )

    def _beats(self, client: Any, ranks: list[int]) -> dict[int, Beat]:
        """The heartbeats in this call of those of ``ranks`` that have one, in one read.

        Ranks whose record was never seen are looked for together (``multi_get`` would
        block on a missing one): in the roster of ranks with a record (one read), or for a
        few ranks with one ``check``, about 2 log2(n) per rank that never made a ddpckpt call.
        """
        beating = self.group._beating
        unknown = [r for r in ranks if r not in beating]
        if unknown:  # records are never deleted: each rank's is looked for until it exists
            beating.update(self._present(client, unknown))
        ranks = [r for r in ranks if r in beating]
        keys = [beat_key(r) for r in ranks]
        if not keys:
            return {}
        found = {
            r: Beat.find(b, self.beat.op)
            for r, b in zip(ranks, multi_get(client, keys), strict=True)
        }
        return {r: beat for r, beat in found.items() if beat is not None}

    def _enroll(self, client: Any) -> None:
        """Add this rank to the roster of ranks with a heartbeat record (once per job)."""
        try:
            client.append(roster_key(), f"{self.group.rank} ".encode())
        except (AttributeError, NotImplementedError) as exc:  # readers find records by halving
            _log.debug("the store cannot append (%s): no heartbeat roster", exc)
        self.group._enrolled = True

    def _present(self, client: Any, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that have a heartbeat record: from the roster when many are
        sought (one read, O(ranks) bytes), else (or without a roster) by halving."""
        if len(ranks) > _FEW and client.check([roster_key()]):
            enrolled = {int(r) for r in client.get(roster_key()).split()}
            return [r for r in ranks if r in enrolled]
        return self._halve(client, ranks)

    def _halve(self, client: Any, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that have a heartbeat record, found by halving."""
        if client.check([beat_key(r) for r in ranks]):
            return ranks
        if len(ranks) == 1:
            return []
        half = len(ranks) // 2
        return self._halve(client, ranks[:half]) + self._halve(client, ranks[half:])


def roster_key() -> str:
    """The store key listing the ranks that have a heartbeat record (appended to, never deleted)."""
    return f"{namespace()}/beat/roster"


def beat_key(rank: int) -> str:
    """The store key of ``rank``'s heartbeat record: one per rank for the job, never deleted."""
    return f"{namespace()}/beat/{rank}"


def tag_code(tag: str) -> int:
    """A short code of an exchange's tag, which tells mismatched exchanges apart."""
    return zlib.crc32(tag.encode()) & 0xFFFF
