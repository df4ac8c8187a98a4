"""Collectives for ddpckpt calls: bounded waits, named missing ranks, one error on every rank.

Every collective ddpckpt call (``save``, ``load``, ``Checkpointer.resume`` ...) opens a
:class:`Comm`. Outside ``torch.distributed`` (or with one rank) every operation is local.
Under ``torch.distributed`` the coordination runs over the default process group's
key-value *store* (or any :class:`StoreGroup`), not over the training process group:

* no collective of the training group (NCCL or gloo) is ever entered, so a slow write on
  one rank never trips the training group's watchdog, and a call made on only some ranks
  cannot deadlock the training group;
* exchanges go through rank 0 (the leader): every rank posts one key, rank 0 reads them
  all in one ``multi_get`` and posts one reply, which carries only what the others need
  ("all ok" for :meth:`Comm.run`). A rank's store traffic per exchange is constant in the
  number of ranks, except rank 0's and that of exchanges whose result every rank needs;
* waits block in the store (``wait``), never poll. A heartbeat thread per call and rank,
  on a second store connection, writes the rank's heartbeat record once per period and
  judges what its main thread waits for: rank 0 reads the records of the ranks it still
  waits for in one ``multi_get``, the others read rank 0's (or the broadcaster's) only.
  So liveness costs O(ranks) store operations per period in all;
* a rank that makes no progress for ``timeout`` seconds is named: the judging thread
  writes a marker into the key its main thread waits on, which wakes it. Ranks inside a
  ddpckpt call heartbeat, so a slow but alive writer is never timed out, while a killed
  one (or ranks waiting for each other in different exchanges) is, within ``timeout``
  plus two heartbeat periods (a period is ``min(1 s, timeout / 8)``: at most 1.25x);
* :meth:`Comm.run` runs a step on every rank and gathers the outcome at rank 0: if any
  rank failed, every rank raises the same error with a per-rank report (the local
  exception chained).

Small messages (statuses, plans, file records, per-rank state) travel through the store;
tensors, when they must move between ranks, use :meth:`Comm.tensor_group` (a gloo group
made once, or the default group for CUDA tensors under NCCL).

Calls are matched across ranks by order: the n-th ddpckpt collective on one rank meets
the n-th on every other, so calls must be opened from the training thread (a background
save keeps using the call its ``save`` opened). The first exchange of each call compares
the call names, so ``save`` on one rank and ``load`` on another fails at once instead of
mixing messages. Every key a call writes to the store is deleted when the call is over
(per-rank keys by their rank once rank 0 replied, shared keys by the last rank to close
the call), except each rank's heartbeat record, one per rank for the job.
"""

from __future__ import annotations

import builtins
import itertools
import json
import os
import platform
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddpckpt._log import get_logger
from ddpckpt.errors import (
    CheckpointError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankFailureError,
    error_class,
)

__all__ = ["DEFAULT_TIMEOUT", "Comm", "StoreGroup", "node_id", "resolve_timeout"]

T = TypeVar("T")
_log = get_logger(__name__)

DEFAULT_TIMEOUT = 600.0
_PREFIX = "ddpckpt"
_LEADER = 0
_tensor_groups: dict[int, Any] = {}
_default_groups: dict[int, StoreGroup] = {}
_StoreTimeout: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


def resolve_timeout(timeout: float | None) -> float:
    """The effective timeout: ``timeout``, else ``$DDPCKPT_TIMEOUT``, else 600 seconds."""
    source = "timeout"
    if timeout is None:
        env = os.environ.get("DDPCKPT_TIMEOUT", "").strip()
        if not env:
            return DEFAULT_TIMEOUT
        source = "DDPCKPT_TIMEOUT"
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"DDPCKPT_TIMEOUT={env!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def node_id() -> str:
    """Names the machine this process runs on: ``host/machine[/group]``.

    The host name alone can collide (cloned images, containers all called ``localhost``),
    so it is qualified by the kernel's boot id (random for each boot of each machine; else
    ``/etc/machine-id``), and by torchrun's node rank (``GROUP_RANK``) when set, so that
    several simulated nodes on one host are told apart too.
    """
    name = f"{platform.node()}/{_machine_token()}"
    group = os.environ.get("GROUP_RANK")
    return f"{name}/{group}" if group is not None else name


_MACHINE_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id")


def _machine_token() -> str:
    """A short identifier of this machine's running system, or ``"?"`` where none exists."""
    for path in _MACHINE_FILES:
        try:
            with open(path) as f:
                token = f.read().strip().replace("-", "")
        except OSError:
            continue
        if token:
            return token[:12]
    return "?"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass(eq=False)
class StoreGroup:
    """A key-value store and this process's rank among ``world_size``: what :class:`Comm` uses.

    Under ``torch.distributed`` ddpckpt makes one from the default process group. Make one
    yourself to run :class:`Comm` without ``torch.distributed`` (tests, simulations): one
    per rank, each with its own store client, all created before any call.
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
    _open: dict[int, _Beat] = field(default_factory=dict, repr=False)  # calls open here
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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


def _default_group() -> StoreGroup | None:
    """The group of the default process group (``None`` outside a multi-rank job)."""
    if not _distributed():
        return None
    from torch.distributed import distributed_c10d

    process_group = distributed_c10d._get_default_group()
    group = _default_groups.get(id(process_group))
    if group is None or group._process_group is not process_group:  # type: ignore[attr-defined]
        group = StoreGroup(_default_store(), dist.get_rank(), dist.get_world_size())
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


@dataclass
class _Beat:
    """One call's heartbeat on one rank, as the store holds it (``"op alive work posted failed tag"``).

    A rank's record holds an entry per call open on it (an asynchronous save's call stays
    open while the training thread makes others); readers look at the entry of their call.
    """

    op: int
    alive: int
    work: int
    posted: int  # exchanges of call ``op`` this rank has posted its part of
    failed: int  # 1 if the rank raised an error for every rank in call ``op``
    posted_tag: int = 0  # _tag_code of the last exchange posted: tells mismatched ones apart

    @classmethod
    def find(cls, record: bytes, op: int) -> _Beat | None:
        for entry in record.split(b";"):
            fields = [int(x) for x in entry.split()]
            if fields and fields[0] == op:
                return cls(*fields)
        return None

    def encode(self) -> bytes:
        fields = (self.op, self.alive, self.work, self.posted, self.failed, self.posted_tag)
        return " ".join(str(f) for f in fields).encode()


@dataclass
class _Watch:
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

    def silent(self, rank: int, marker: Any, now: float, timeout: float) -> bool:
        last = self.seen.get(rank)
        if last is None:
            last = self.seen[rank] = (marker, self.started)
        elif marker is not None and marker != last[0]:
            last = self.seen[rank] = (marker, now)
        return now - last[1] > timeout


class Comm:
    """The collective context of one ddpckpt call on this rank.

    Create it with :meth:`open` on every rank, in the same order; use it from one thread
    at a time; :meth:`close` it (or use ``with``) on every rank.
    """

    def __init__(
        self, call: str, timeout: float, *, local: bool = False, group: StoreGroup | None = None
    ) -> None:
        self.call = call
        self.timeout = timeout
        if group is None and not local:
            group = _default_group()
        self._group = None if local or group is None or group.world_size < 2 else group
        self.rank = self._group.rank if self._group else 0
        self.world_size = self._group.world_size if self._group else 1
        self.path: str | None = None
        self.token = uuid.uuid4().hex[:12]
        self._nodes: list[str] | None = [node_id()]
        self._store: Any = None
        self._watcher: Any = None
        self._own_connection = False
        self._op = -1
        self._exchanges = 0
        self._beat = _Beat(-1, 0, 0, 0, 0)
        self._period = min(1.0, timeout / 8)
        self._stop = threading.Event()
        self._waiting = threading.Event()
        self._watch: _Watch | None = None
        self._shared_keys: list[str] | None = []
        self._beater: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(
        cls,
        call: str,
        *,
        path: str | None = None,
        timeout: float | None = None,
        group: StoreGroup | None = None,
    ) -> Comm:
        """Enter the collective ``call`` (e.g. ``"ddpckpt.save"``); every rank must call it.

        Agrees on ``path``: rank 0's is used everywhere, and a rank that passed another
        logs a warning. Raises :class:`CollectiveTimeoutError` naming the ranks that did
        not arrive, or :class:`CollectiveMismatchError` if ranks entered different calls.
        ``group`` replaces the default process group (see :class:`StoreGroup`).
        """
        comm = cls(call, resolve_timeout(timeout), group=group)
        comm.path = path
        if comm._group is None:
            return comm
        comm._store, comm._own_connection = comm._group.borrow()
        comm._watcher = comm._group.watch_client()
        comm._op = next(comm._group._calls)
        comm._beat = _Beat(comm._op, 0, 0, 0, 0)
        with comm._group._lock:
            comm._group._open[comm._op] = comm._beat
        comm._share(comm._key("failed", "all"))
        comm._start_heartbeat()
        try:
            comm._enter(path)
        except BaseException:
            comm.close()
            raise
        return comm

    @classmethod
    def local(cls, call: str, path: str | None = None) -> Comm:
        """A context for work this process does alone, even inside a distributed job."""
        comm = cls(call, DEFAULT_TIMEOUT, local=True)
        comm.path = path
        return comm

    @classmethod
    def from_leader(
        cls,
        call: str,
        decide: Callable[[], bytes],
        *,
        timeout: float | None = None,
        group: StoreGroup | None = None,
    ) -> bytes:
        """Rank 0's ``decide()`` on every rank, for one key of store traffic; every rank calls it.

        Not a full call: no heartbeat, no per-rank report. Rank 0 publishes its answer and
        returns at once; every other rank waits for it up to ``timeout`` and raises
        :class:`CollectiveTimeoutError` naming rank 0 if it does not come. Calls are matched
        by order, like :meth:`open`.
        """
        limit = resolve_timeout(timeout)
        group = group or _default_group()
        if group is None or group.world_size < 2:
            return decide()
        key = f"{_namespace()}/decide/{next(group._decisions)}"
        if group.rank == _LEADER:
            value = decide()
            group.store.set(key, value)
            return value
        store, own = group.borrow()
        try:
            store.wait([key], timedelta(seconds=limit))
            value = store.get(key)
            if store.add(f"{key}/read", 1) == group.world_size - 1:  # the last reader tidies
                store.delete_key(key)
                store.delete_key(f"{key}/read")
        except _StoreTimeout:
            raise CollectiveTimeoutError(
                f"rank 0 did not call {call} within {limit:g} s. {call} is collective: call "
                "it on every rank. Raise the limit with timeout= or DDPCKPT_TIMEOUT if it is "
                "only slow."
            ) from None
        finally:
            group.give_back(store, own)
        return value

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the call. The last rank to leave deletes the call's keys from the store."""
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
            self._beater = None
        if self._group is not None:
            with self._group._lock:
                self._group._open.pop(self._op, None)
        if self._store is not None and self._shared_keys is not None:
            keys, self._shared_keys = self._shared_keys, None
            closed = self._key("closed", "count")
            if self._store.add(closed, 1) == self.world_size:  # nobody reads them any more
                for key in [*keys, closed]:
                    self._store.delete_key(key)
            self._group.give_back(self._store, self._own_connection)  # type: ignore[union-attr]

    @property
    def nodes(self) -> list[str]:
        """Every rank's :func:`node_id`, in rank order (fetched from the store when first asked)."""
        if self._nodes is None or len(self._nodes) != self.world_size:
            table = json.loads(self._store.get(self._key("nodes", "all")))
            self._nodes = [table["names"][i] for i in table["index"]]
        return self._nodes

    def _enter(self, path: str | None) -> None:
        """Rank 0 checks that every rank entered the same call, then sends its path and token."""
        mine = json.dumps({"call": self.call, "path": path, "node": node_id()}).encode()
        nodes_key = self._key("nodes", "all")
        self._share(nodes_key)
        infos = self._collect("enter", mine)
        if infos is not None:
            docs = [json.loads(b) for b in infos]
            calls = {doc["call"] for doc in docs}
            if len(calls) > 1:
                listing = ", ".join(f"rank {r}: {doc['call']}" for r, doc in enumerate(docs))
                error = CollectiveMismatchError(
                    f"ranks entered different ddpckpt calls ({listing}); every rank must make "
                    "the same ddpckpt calls in the same order"
                )
                self._publish("enter", _encode_error(error))
                raise error
            self._nodes = [doc["node"] for doc in docs]
            names = sorted(set(self._nodes))
            index = {name: i for i, name in enumerate(names)}
            table = {"names": names, "index": [index[n] for n in self._nodes]}
            self._store.set(nodes_key, json.dumps(table).encode())
            agreed = {"path": path, "token": self.token}
            self._publish("enter", b"K" + json.dumps(agreed).encode())
        else:
            agreed = json.loads(self._receive("enter"))
            self._nodes = None
        self.token = agreed["token"]
        if path != agreed["path"]:
            _log.warning(
                "rank %d passed path %r but rank 0 passed %r; using rank 0's path on every rank",
                self.rank,
                path,
                agreed["path"],
            )
        self.path = agreed["path"]

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
            self._publish(tag, b"K" + _pack(payloads))
            return payloads
        return _unpack(self._receive(tag))

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
        self._await(_Watch(tag, {src: key}, self._exchanges, gather=False))
        return _unwrap(self._store.get(key))

    def barrier(self, tag: str) -> None:
        """Return once every rank has reached this barrier."""
        self.run(tag, lambda: None)

    def run(self, tag: str, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; if it failed anywhere, raise the same error everywhere.

        With one process the step's own exception propagates unchanged. With several,
        rank 0 gathers every rank's outcome and sends back only "all ok" or one error
        whose ``failures`` maps each failing rank to its error; every rank raises it, on a
        failing rank with the local exception chained as ``__cause__``. Returns this
        rank's result.
        """
        if self.world_size == 1:
            return step()
        result, _ = self._run(tag, step, share=False)
        return result

    def run_all(self, tag: str, step: Callable[[], Any]) -> list[Any]:
        """Like :meth:`run`, but returns every rank's result (which must be JSON-able).

        Every rank receives every result: use :meth:`run_gather` if only rank 0 needs them.
        """
        if self.world_size == 1:
            return [step()]
        _, results = self._run(tag, step, share=True)
        return results  # type: ignore[return-value]

    def run_gather(self, tag: str, step: Callable[[], Any]) -> list[Any] | None:
        """Like :meth:`run_all`, but only rank 0 receives the results; other ranks get ``None``."""
        if self.world_size == 1:
            return [step()]
        _, results = self._run(tag, step, share=False, keep=True)
        return results

    def _run(
        self, tag: str, step: Callable[[], Any], share: bool, keep: bool = False
    ) -> tuple[Any, list[Any] | None]:
        local: BaseException | None = None
        result: Any = None
        try:
            result = step()
            payload = json.dumps({"ok": result if share or keep else None}).encode()
        except Exception as exc:
            local = exc
            payload = json.dumps({"error": _describe(exc)}).encode()
        gathered = self._collect(tag, payload, cause=local)
        if gathered is None:  # not the leader: rank 0 sends "all ok", every result or the error
            try:
                reply = self._receive(tag)
            except CheckpointError as exc:
                raise exc from local
            return result, [json.loads(b)["ok"] for b in _unpack(reply)] if share else None
        outcomes = [json.loads(b) for b in gathered]
        failures = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
        if failures:
            error = _combine(self.call, failures)
            self._publish(tag, _encode_error(error))
            raise error from local
        results = [o["ok"] for o in outcomes]
        self._publish(tag, b"K" + (_pack(gathered) if share else b""))
        return result, results if share or keep else None

    # ------------------------------------------------------------------ tensors

    def tensor_group(self, device: torch.device) -> Any:
        """The process group to move tensors on ``device`` with (all ranks must ask together)."""
        if device.type != "cpu" and dist.get_backend() != "gloo":
            return None  # the default (e.g. NCCL) group carries device tensors
        key = id(dist.distributed_c10d._get_default_group())
        if key not in _tensor_groups:
            _tensor_groups[key] = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.timeout)
            )
        return _tensor_groups[key]

    # ------------------------------------------------------------------ exchanges

    def _collect(
        self, tag: str, payload: bytes, cause: BaseException | None = None
    ) -> list[bytes] | None:
        """Every rank's ``payload`` on rank 0 (``None`` on the others, which post theirs).

        Rank 0 blocks until every rank has posted, or its heartbeat thread has marked the
        silent ranks (then it publishes a timeout naming them and raises it).
        """
        self._exchanges += 1
        if self.rank != _LEADER:
            self._store.set(self._key(tag, self.rank), b"K" + payload)
            self._beat.posted, self._beat.posted_tag = self._exchanges, _tag_code(tag)
            return None
        keys = {r: self._key(tag, r) for r in range(1, self.world_size)}
        self._await(_Watch(tag, keys, self._exchanges, gather=True))
        blobs = _multi_get(self._store, list(keys.values()))
        silent = [r for r, blob in zip(keys, blobs, strict=True) if blob[:1] == b"T"]
        if silent:
            for r, blob in zip(keys, blobs, strict=True):
                if blob[:1] in (b"T", b"P"):  # markers: the ranks that posted delete their own
                    self._store.delete_key(keys[r])
            error = self._timeout_error(silent, tag)
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
        self._await(_Watch(tag, {_LEADER: key}, self._exchanges, gather=False))
        reply = self._store.get(key)
        self._store.delete_key(self._key(tag, self.rank))  # rank 0 has read it
        return _unwrap(reply)

    def _fail(self, tag: str, error: CheckpointError) -> None:
        """Rank 0 timed out: tell every rank, also those waiting in another exchange."""
        blob = _encode_error(error)
        self._store.set(self._key("failed", "all"), blob)
        self._beat.failed = 1
        self._store.set(self._beat_key(self.rank), self._group.beat_record())  # type: ignore[union-attr]
        self._publish(tag, blob)

    # ------------------------------------------------------------------ waiting and liveness

    def _share(self, key: str) -> None:
        """Record a key every rank reads (the same list on every rank), for :meth:`close`."""
        if self._shared_keys is not None and key not in self._shared_keys:
            self._shared_keys.append(key)

    def _key(self, tag: str, who: int | str) -> str:
        return f"{_namespace()}/{self._op}/{tag}/{who}"

    def _beat_key(self, rank: int) -> str:
        return f"{_namespace()}/beat/{rank}"  # one per rank for the job: never deleted

    def _start_heartbeat(self) -> None:
        """Beat every period, and judge what the main thread waits for (see :class:`_Watch`)."""
        client = self._watcher or self._store
        group = self._group
        assert group is not None  # only calls with several ranks beat

        def beat() -> None:
            try:
                while True:
                    self._beat.alive += 1
                    if not self._waiting.is_set():
                        self._beat.work += 1
                    client.set(self._beat_key(self.rank), group.beat_record())
                    watch = self._watch
                    if watch is not None:
                        self._judge(client, watch)
                    if self._stop.wait(self._period):
                        return
            except RuntimeError as exc:  # the store went away: the waiting main thread sees it
                _log.warning("ddpckpt heartbeat of rank %d stopped: %s", self.rank, exc)

        self._beater = threading.Thread(target=beat, name="ddpckpt-heartbeat", daemon=True)
        self._beater.start()

    def _await(self, watch: _Watch) -> None:
        """Block until every key of ``watch`` exists (the heartbeat thread sets markers)."""
        blocking = self._watcher is not None and self._own_connection
        slice_ = timedelta(seconds=max(4 * self.timeout, 300.0) if blocking else self._period)
        self._watch = watch
        self._waiting.set()
        try:
            while True:
                try:
                    self._store.wait(list(watch.keys.values()), slice_)
                    return
                except _StoreTimeout:
                    if self._beater is None or not self._beater.is_alive():
                        raise
                    if not blocking:  # nobody can wake this wait: judge here between slices
                        self._judge(self._store, watch)
        finally:
            self._watch = None
            self._waiting.clear()

    def _judge(self, client: Any, watch: _Watch) -> None:
        """Wake the main thread with a marker or an error if what it waits for is silent."""
        now = time.monotonic()
        if watch.gather:
            unknown = [r for r in watch.keys if r not in watch.posted]
            beats = self._beats(client, unknown)
            mine = (watch.exchange, _tag_code(watch.tag))
            watch.posted.update(r for r, b in beats.items() if (b.posted, b.posted_tag) == mine)
            pending = [r for r in unknown if r not in watch.posted]
            silent = [
                r
                for r in pending
                if watch.silent(r, beats[r].work if r in beats else None, now, self.timeout)
            ]
            marked = [r for r in silent if client.compare_set(watch.keys[r], b"", b"T") == b"T"]
            if marked:  # wake rank 0: every key it waits for must exist
                for r in pending:
                    if r not in marked:
                        client.compare_set(watch.keys[r], b"", b"P")
            return
        ((source, key),) = watch.keys.items()
        # Rank 0's heartbeat record says "failed" only until its next call rewrites it, which
        # can come within one period: the call's own failure key is what must be read.
        failed = self._key("failed", "all")
        if client.check([failed]):
            client.compare_set(key, b"", client.get(failed))
            return
        beat = self._beats(client, [source]).get(source)
        if watch.silent(source, beat.alive if beat else None, now, self.timeout):
            error = self._timeout_error([source], watch.tag)
            client.compare_set(key, b"", _encode_error(error))

    def _beats(self, client: Any, ranks: list[int]) -> dict[int, _Beat]:
        """The heartbeats in this call of those of ``ranks`` that have one, in one read.

        Ranks whose record was never seen are looked for together (``multi_get`` would
        block on a missing one): one ``check``, or about 2 log2(n) per rank that never
        made a ddpckpt call.
        """
        beating = self._group._beating  # type: ignore[union-attr]
        unknown = [r for r in ranks if r not in beating]
        if unknown:  # records are never deleted: each rank's is looked for until it exists
            beating.update(self._present(client, unknown))
        ranks = [r for r in ranks if r in beating]
        keys = [self._beat_key(r) for r in ranks]
        if not keys:
            return {}
        found = {
            r: _Beat.find(b, self._op) for r, b in zip(ranks, _multi_get(client, keys), strict=True)
        }
        return {r: beat for r, beat in found.items() if beat is not None}

    def _present(self, client: Any, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that have a heartbeat record, found by halving."""
        if client.check([self._beat_key(r) for r in ranks]):
            return ranks
        if len(ranks) == 1:
            return []
        half = len(ranks) // 2
        return self._present(client, ranks[:half]) + self._present(client, ranks[half:])

    def _timeout_error(self, ranks: Sequence[int], tag: str) -> CollectiveTimeoutError:
        names = ", ".join(str(r) for r in ranks)
        plural = "s" if len(ranks) > 1 else ""
        if tag == "enter":
            why = (
                f"rank{plural} {names} did not call {self.call} within {self.timeout:g} s. "
                f"{self.call} is collective: call it on every rank (not inside `if rank == 0`)"
            )
        else:
            why = (
                f"rank{plural} {names} stopped responding during {self.call} (step "
                f"'{tag}') for {self.timeout:g} s: the process died or hangs"
            )
        error = CollectiveTimeoutError(
            f"{why}. Raise the limit with timeout= or DDPCKPT_TIMEOUT if it is only slow."
        )
        error.failures = {r: f"CollectiveTimeoutError: no response in step '{tag}'" for r in ranks}
        return error


def _tag_code(tag: str) -> int:
    return zlib.crc32(tag.encode()) & 0xFFFF


def _namespace() -> str:
    """Store keys of this incarnation of the job.

    A store can outlive a torchrun restart, and the restarted processes count their calls
    from zero again: keys left by the previous attempt must never be read as new ones.
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"{_PREFIX}/{run}/{attempt}" if run or attempt else _PREFIX


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    if hasattr(store, "multi_get"):
        return list(store.multi_get(keys))
    return [store.get(k) for k in keys]


def _pack(payloads: Sequence[bytes]) -> bytes:
    header = struct.pack(f"<I{len(payloads)}Q", len(payloads), *(len(p) for p in payloads))
    return header + b"".join(payloads)


def _unpack(blob: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("<I", blob)
    sizes = struct.unpack_from(f"<{count}Q", blob, 4)
    out, offset = [], 4 + 8 * count
    for size in sizes:
        out.append(blob[offset : offset + size])
        offset += size
    return out


def _unwrap(blob: bytes) -> bytes:
    """The data of a reply (``b"K"`` and data), or raise the error it carries (``b"E"``)."""
    if blob[:1] == b"E":
        doc = json.loads(blob[1:])
        cls = error_class(doc["type"])
        errno = doc.get("errno")
        error = cls(errno, doc["message"]) if errno is not None else cls(doc["message"])
        error.failures = {int(r): f for r, f in doc["failures"].items()}
        raise error
    return blob[1:]


def _encode_error(exc: CheckpointError) -> bytes:
    doc: dict[str, Any] = {"type": type(exc).__name__, "failures": exc.failures}
    if isinstance(exc, OSError) and exc.errno is not None:  # rebuilt as cls(errno, strerror)
        doc.update(errno=exc.errno, message=exc.strerror)
    else:
        doc["message"] = str(exc)
    return b"E" + json.dumps(doc).encode()


def _describe(exc: BaseException) -> dict[str, Any]:
    message = str(exc) or repr(exc)
    if isinstance(exc, OSError) and exc.strerror is not None:  # without the "[Errno N]" prefix
        message = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return {
        "type": type(exc).__name__,
        "message": message,
        "errno": getattr(exc, "errno", None),
        "host": platform.node(),
    }


def _combine(call: str, failures: dict[int, dict[str, Any]]) -> CheckpointError:
    """One error describing every rank's failure, identical on every rank."""
    kinds = {f["type"] for f in failures.values()}
    messages = {f["message"] for f in failures.values()}
    ranks = sorted(failures)
    on = ", ".join(str(r) for r in ranks)
    if len(messages) == 1:
        text = f"{messages.pop()} (on rank{'s' if len(ranks) > 1 else ''} {on})"
    else:
        lines = [
            f"  rank {r} ({failures[r]['host']}): {failures[r]['type']}: {failures[r]['message']}"
            for r in ranks
        ]
        text = f"{call} failed on {len(ranks)} rank(s):\n" + "\n".join(lines)
    if len(kinds) > 1:  # e.g. incomplete on one rank, corrupt on another: both are corrupt
        common = _common_error(kinds)
        kinds = {common.__name__} if common is not None else kinds
    if len(kinds) == 1:
        kind = kinds.pop()
        cls = error_class(kind)
        errnos = {f.get("errno") for f in failures.values()}
        if cls is RankFailureError and _is_os_error(kind):
            cls = CheckpointWriteError
        if issubclass(cls, OSError) and len(errnos) == 1 and errnos != {None}:
            error: CheckpointError = cls(errnos.pop(), text)
        else:
            error = cls(text)
    else:
        error = RankFailureError(text)
    error.failures = {r: f"{f['type']}: {f['message']}" for r, f in failures.items()}
    return error


def _common_error(kinds: set[str]) -> type[CheckpointError] | None:
    """The most specific ddpckpt error class all ``kinds`` share, if more specific than the base."""
    classes = [error_class(k) for k in kinds]
    if any(c is RankFailureError for c in classes):
        return None
    for candidate in classes[0].__mro__:
        if candidate is CheckpointError:
            return None
        if isinstance(candidate, type) and all(issubclass(c, candidate) for c in classes):
            return candidate  # type: ignore[return-value]
    return None


def _is_os_error(name: str) -> bool:
    builtin = getattr(builtins, name, None)
    return isinstance(builtin, type) and issubclass(builtin, OSError)
