"""The key-value store ddpckpt's collectives run over, and the ranks that share it.

A :class:`StoreGroup` is a store and this process's rank among ``world_size``: under
``torch.distributed`` one is made from the default process group's store
(:func:`default_group`); tests and simulations make their own. It hands out store
connections, so that a wait blocked on one never stalls another thread's traffic.
Keys are namespaced per incarnation of the job (:func:`namespace`); messages of several
ranks travel packed in one value (:func:`pack`).
"""

from __future__ import annotations

import atexit
import itertools
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from ddpckpt._coord.limits import LEAVE_WAIT
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointError, CollectiveTimeoutError

_log = get_logger(__name__)

_PREFIX = "ddpckpt"
_default_groups: dict[int, StoreGroup] = {}
StoreTimeout: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class HeartbeatEntry(Protocol):
    """One call's entry in this rank's heartbeat record (a
    :class:`~ddpckpt._coord.liveness.Beat`)."""

    def encode(self) -> bytes: ...


@dataclass(eq=False)
class StoreGroup:
    """A key-value store and this process's rank among ``world_size``: what a
    :class:`~ddpckpt._coord.comm.Comm` coordinates through.

    Under ``torch.distributed`` ddpckpt makes one from the default process group. Make one
    yourself to run a ``Comm`` without ``torch.distributed`` (tests, simulations): one per
    rank, each with its own store client, all created before any call.
    """

    store: Any
    rank: int
    world_size: int
    _calls: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _decisions: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _watch_client: Any = field(default=None, repr=False)
    _spare: list[Any] = field(default_factory=list, repr=False)  # connections for waits
    _clonable: bool = field(default=True, repr=False)
    _beating: set[int] = field(default_factory=set, repr=False)  # ranks with a record
    _enrolled: bool = field(default=False, repr=False)  # this rank is in the beat roster
    _open: dict[int, HeartbeatEntry] = field(default_factory=dict, repr=False)  # calls open here
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _unread: str | None = field(default=None, repr=False)  # rank 0's last answer's key
    # the process may hold the store (the default group's): wait at exit until it is read
    _wait_at_exit: bool = field(default=False, repr=False)

    def beat_record(self) -> bytes:
        """This rank's heartbeat record: one entry per call open on it."""
        with self._lock:
            return b";".join(beat.encode() for beat in self._open.values())

    def _connect(self) -> Any | None:
        """A new connection to the store, or ``None`` if the store cannot be cloned."""
        if self._clonable:
            try:
                return self.store.clone()
            except (AttributeError, NotImplementedError, RuntimeError) as exc:
                self._clonable = False
                _log.warning(
                    "the store %s cannot open more connections (%s): ddpckpt waits for "
                    "other ranks by polling it",
                    type(self.store).__name__,
                    exc,
                )
        return None

    def watch_client(self) -> Any | None:
        """The heartbeat threads' connection (short operations only), made once."""
        if self._watch_client is None:
            self._watch_client = self._connect() or False
        return self._watch_client or None

    def borrow(self) -> tuple[Any, bool]:
        """A connection for one call's blocking waits, and whether it is the call's own.

        A client serves one request at a time, so a wait blocked on a shared client would
        stall every other thread using it (a background save's call, the training
        thread's ``should_save``, torch itself on the process group's client).
        """
        with self._lock:
            if self._spare:
                return self._spare.pop(), True
        client = self._connect()
        return (client, True) if client is not None else (self.store, False)

    def give_back(self, client: Any, own: bool) -> None:
        if own:
            with self._lock:
                self._spare.append(client)

    def leader_value(self, call: str, decide: Callable[[], bytes], limit: float) -> bytes:
        """Rank 0's ``decide()`` on every rank, through one key (see ``Comm.from_leader``).

        Rank 0 publishes its answer and returns at once; every other rank waits for it up
        to ``limit`` seconds and raises :class:`CollectiveTimeoutError` naming rank 0 if it
        does not come. At exit, rank 0 waits until the others have read its last answer: its
        process may hold the store, and a script can end right after this call.
        """
        key = f"{namespace()}/decide/{next(self._decisions)}"
        if self.rank == 0:
            value = decide()
            self.store.set(key, value)
            if self._wait_at_exit and self._unread is None:
                atexit.register(self._wait_until_read)
            self._unread = key
            return value
        store, own = self.borrow()
        try:
            store.wait([key], timedelta(seconds=limit))
            value = store.get(key)
            if store.add(f"{key}/read", 1) == self.world_size - 1:  # the last reader tidies
                store.delete_key(key)
                store.delete_key(f"{key}/read")
        except StoreTimeout:
            raise CollectiveTimeoutError(
                f"rank 0 did not call {call} within {limit:g} s. {call} is collective: call "
                "it on every rank. Raise the limit with timeout= or DDPCKPT_TIMEOUT if it is "
                "only slow."
            ) from None
        finally:
            self.give_back(store, own)
        return value

    def _wait_until_read(self) -> None:
        """At exit, rank 0: wait until every rank has read the last answer :meth:`leader_value`
        published (its last reader deletes it), ``LEAVE_WAIT`` seconds at most."""
        key, self._unread = self._unread, None
        if key is None:
            return
        deadline = time.monotonic() + LEAVE_WAIT
        try:
            while self.store.check([key]):
                if time.monotonic() > deadline:
                    _log.warning(
                        "ddpckpt: not every rank read rank 0's last decision within %.0f s "
                        "(a rank may have died); rank 0 exits", LEAVE_WAIT,
                    )  # fmt: skip
                    return
                time.sleep(0.01)
        except dist.DistError as exc:  # the store is gone already: nobody can read it now
            _log.debug("ddpckpt: the store went away before exit: %s", exc)


def default_group() -> StoreGroup | None:
    """The group of the default process group (``None`` outside a multi-rank job)."""
    if not _distributed():
        return None
    from torch.distributed import distributed_c10d

    process_group = distributed_c10d._get_default_group()
    group = _default_groups.get(id(process_group))
    if group is None or group._process_group is not process_group:  # type: ignore[attr-defined]
        group = StoreGroup(
            _default_store(), dist.get_rank(), dist.get_world_size(), _wait_at_exit=True
        )
        group._process_group = process_group  # type: ignore[attr-defined]  # pins the id
        _default_groups[id(process_group)] = group
    return group


def _default_store() -> Any:
    """The default process group's store, else a client of ``$MASTER_ADDR:$MASTER_PORT``."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (host and port):
        raise CheckpointError(
            "ddpckpt coordinates ranks through the default process group's key-value store, "
            f"which this process group does not expose ({reason}). Initialise "
            "torch.distributed with init_method='env://' or 'tcp://', or set MASTER_ADDR and "
            "MASTER_PORT to a TCPStore every rank can reach (torchrun sets both)"
        )
    _log.warning(
        "the default process group has no key-value store (%s); ddpckpt coordinates through "
        "the TCPStore at MASTER_ADDR:MASTER_PORT = %s:%s instead",
        reason,
        host,
        port,
    )
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
    return dist.PrefixStore(_PREFIX, client)


def namespace() -> str:
    """Store keys of this incarnation of the job; the same on every rank.

    A store can outlive a torchrun restart, and the restarted processes count their calls
    from zero again: keys left by the previous attempt must never be read as new ones. On
    one node the launcher's restart count tells the attempts apart. On several nodes it
    does not: a node whose worker failed counts a restart, the others restart theirs
    without counting one (torch.distributed.elastic), so the counts differ between nodes.
    There each rendezvous round's own store address (fresh per round unless the launcher
    shares its rendezvous store, TORCHELASTIC_USE_AGENT_STORE) names the incarnation; with
    a shared store the count is used still, and ranks whose counts differ wait for one
    another until their timeout says so, never reading another attempt's keys.
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    nodes = os.environ.get("GROUP_WORLD_SIZE", "1")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if attempt and nodes != "1" and not shared:
        address = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        return f"{_PREFIX}/{run}/{address}"
    return f"{_PREFIX}/{run}/{attempt}" if run or attempt else _PREFIX


def multi_get(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, in one request where the store can (all must exist)."""
    if hasattr(store, "multi_get"):
        return list(store.multi_get(keys))
    return [store.get(k) for k in keys]


def pack(payloads: Sequence[bytes]) -> bytes:
    """``payloads`` as one value: their count and sizes, then their bytes."""
    header = struct.pack(f"<I{len(payloads)}Q", len(payloads), *(len(p) for p in payloads))
    return header + b"".join(payloads)


def unpack(blob: bytes) -> list[bytes]:
    """The payloads :func:`pack` put in ``blob``."""
    (count,) = struct.unpack_from("<I", blob)
    sizes = struct.unpack_from(f"<{count}Q", blob, 4)
    out, offset = [], 4 + 8 * count
    for size in sizes:
        out.append(blob[offset : offset + size])
        offset += size
    return out
