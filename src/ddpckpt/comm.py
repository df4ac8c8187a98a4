"""Collectives for ddpckpt calls: bounded waits, named missing ranks, one error on every rank.

Every collective ddpckpt call (``save``, ``load``, ``Checkpointer.resume`` ...) opens a
:class:`Comm`. Outside ``torch.distributed`` (or with one rank) every operation is local.
Under ``torch.distributed`` the coordination runs over the default process group's
key-value *store*, not over the training process group:

* no collective of the training group (NCCL or gloo) is ever entered, so a slow write on
  one rank never trips the training group's watchdog, and a call made on only some ranks
  cannot deadlock the training group;
* every wait is bounded: a rank that shows no sign of life for ``timeout`` seconds is
  reported by rank number and by what it failed to do. Ranks inside a ddpckpt call
  heartbeat, so a slow but alive writer is never timed out, while a killed one is;
* :meth:`Comm.run` runs a step on every rank and gathers the outcome: if any rank failed,
  every rank raises the same error with a per-rank report (the local exception chained).

Small messages (statuses, plans, file records, per-rank state) travel through the store;
tensors, when they must move between ranks, use :meth:`Comm.tensor_group` (a gloo group
made once, or the default group for CUDA tensors under NCCL).

Calls are matched across ranks by order: the n-th ddpckpt collective on one rank meets
the n-th on every other, so calls must be opened from the training thread (a background
save keeps using the call its ``save`` opened). The first exchange of each call compares
the call names, so ``save`` on one rank and ``load`` on another fails at once instead of
mixing messages. Every key a call writes to the store is deleted when the call is over:
per-rank keys by rank 0 once read, shared keys by the last rank to close the call.
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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ._log import get_logger
from .errors import (
    CheckpointError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankFailureError,
    error_class,
)

__all__ = ["DEFAULT_TIMEOUT", "Comm", "node_id", "resolve_timeout"]

T = TypeVar("T")
_log = get_logger(__name__)

DEFAULT_TIMEOUT = 600.0
_PREFIX = "ddpckpt"
_SCAN_PERIOD = 0.25  # seconds between liveness checks while waiting
_op_counter = itertools.count()
_tensor_groups: dict[int, Any] = {}


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


class Comm:
    """The collective context of one ddpckpt call on this rank.

    Create it with :meth:`open` on every rank, in the same order; use it from one thread
    at a time; :meth:`close` it (or use ``with``) on every rank.
    """

    def __init__(self, call: str, timeout: float, *, local: bool = False) -> None:
        self.call = call
        self.timeout = timeout
        distributed = _distributed() and not local
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.nodes: list[str] = [node_id()]
        self.path: str | None = None
        self.token = uuid.uuid4().hex[:12]
        self._store: Any = None
        self._op = -1
        self._stop = threading.Event()
        self._waiting = threading.Event()
        self._shared_keys: list[str] | None = []
        self._beater: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(cls, call: str, *, path: str | None = None, timeout: float | None = None) -> Comm:
        """Enter the collective ``call`` (e.g. ``"ddpckpt.save"``); every rank must call it.

        Agrees on ``path``: rank 0's is used everywhere, and a rank that passed another
        logs a warning. Raises :class:`CollectiveTimeoutError` naming the ranks that did
        not arrive, or :class:`CollectiveMismatchError` if ranks entered different calls.
        """
        comm = cls(call, resolve_timeout(timeout))
        comm.path = path
        if comm.world_size == 1:
            return comm
        from torch.distributed import distributed_c10d

        comm._store = distributed_c10d._get_default_store()
        comm._op = next(_op_counter)
        comm._start_heartbeat()
        for rank in range(comm.world_size):  # each rank's liveness keys: deleted at close
            for kind in ("waiting", "alive", "work"):
                comm._share(comm._key(kind, rank))
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
        if self._store is not None and self._shared_keys is not None:
            keys, self._shared_keys = self._shared_keys, None
            closed = self._key("closed", "count")
            if self._store.add(closed, 1) == self.world_size:  # nobody reads them any more
                for key in [*keys, closed]:
                    self._store.delete_key(key)

    def _enter(self, path: str | None) -> None:
        mine = {"call": self.call, "path": path, "node": node_id(), "token": self.token}
        infos = [json.loads(b) for b in self.all_gather("enter", json.dumps(mine).encode())]
        calls = {info["call"] for info in infos}
        if len(calls) > 1:
            listing = ", ".join(f"rank {r}: {info['call']}" for r, info in enumerate(infos))
            raise CollectiveMismatchError(
                f"ranks entered different ddpckpt calls ({listing}); every rank must make "
                "the same ddpckpt calls in the same order"
            )
        self.nodes = [info["node"] for info in infos]
        self.token = infos[0]["token"]
        agreed = infos[0]["path"]
        if path != agreed:
            _log.warning(
                "rank %d passed path %r but rank 0 passed %r; using rank 0's path on every rank",
                self.rank,
                path,
                agreed,
            )
        self.path = agreed

    # ------------------------------------------------------------------ primitives

    def all_gather(self, tag: str, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order, on every rank."""
        if self.world_size == 1:
            return [payload]
        self._store.set(self._key(tag, self.rank), payload)
        result_key = self._key(tag, "all")
        self._share(result_key)
        if self.rank == 0:
            try:
                self._wait({r: self._key(tag, r) for r in range(self.world_size)}, tag)
            except CheckpointError as exc:
                self._store.set(result_key, _encode_error(exc))
                raise
            keys = [self._key(tag, r) for r in range(self.world_size)]
            payloads = _multi_get(self._store, keys)
            self._store.set(result_key, b"K" + _pack(payloads))
            for key in keys:  # only rank 0 reads the per-rank keys
                self._store.delete_key(key)
            return payloads
        # Rank 0 publishes an error here if it times out, so wait a little longer for it.
        self._wait({0: result_key}, tag, grace=2 * _SCAN_PERIOD + 1.0)
        return _unpack_result(self._store.get(result_key))

    def broadcast(self, tag: str, payload: bytes | None, src: int = 0) -> bytes:
        """``src``'s payload on every rank (other ranks pass ``None``)."""
        if self.world_size == 1:
            if payload is None:
                raise ValueError("the broadcasting rank must pass a payload")
            return payload
        key = self._key(tag, src)
        self._share(key)
        if self.rank == src:
            if payload is None:
                raise ValueError("the broadcasting rank must pass a payload")
            self._store.set(key, payload)
            return payload
        self._wait({src: key}, tag)
        return self._store.get(key)

    def barrier(self, tag: str) -> None:
        self.all_gather(tag, b"")

    def run(self, tag: str, step: Callable[[], T]) -> T:
        """Run ``step`` on every rank; if it failed anywhere, raise the same error everywhere.

        With one process the step's own exception propagates unchanged. With several,
        each rank's outcome is gathered and every rank raises one error whose
        ``failures`` maps each failing rank to its error; on a failing rank the local
        exception is chained as ``__cause__``. Returns this rank's result.
        """
        if self.world_size == 1:
            return step()
        result, _ = self._run(tag, step, share=False)
        return result

    def run_all(self, tag: str, step: Callable[[], Any]) -> list[Any]:
        """Like :meth:`run`, but returns every rank's result (which must be JSON-able)."""
        if self.world_size == 1:
            return [step()]
        _, results = self._run(tag, step, share=True)
        return results

    def _run(self, tag: str, step: Callable[[], Any], share: bool) -> tuple[Any, list[Any]]:
        local: BaseException | None = None
        result: Any = None
        try:
            result = step()
            payload = json.dumps({"ok": result if share else None}).encode()
        except Exception as exc:
            local = exc
            payload = json.dumps({"error": _describe(exc)}).encode()
        outcomes = [json.loads(b) for b in self.all_gather(tag, payload)]
        failures = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
        if failures:
            raise _combine(self.call, failures) from local
        return result, [o["ok"] for o in outcomes]

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

    # ------------------------------------------------------------------ internals

    def _share(self, key: str) -> None:
        """Record a key every rank reads (the same list on every rank), for :meth:`close`."""
        if self._shared_keys is not None:
            self._shared_keys.append(key)

    def _key(self, tag: str, who: int | str) -> str:
        return f"{_namespace()}/{self._op}/{tag}/{who}"

    def _beat_key(self, rank: int, kind: str) -> str:
        return self._key(kind, rank)  # per call: work for another call is no progress in this one

    def _beat(self, rank: int, kind: str) -> int:
        return int(self._store.add(self._beat_key(rank, kind), 0))

    def _start_heartbeat(self) -> None:
        """Beat "alive" all along this call, and "work" whenever it is not blocked waiting."""
        interval = min(1.0, self.timeout / 4)
        store, stop, waiting = self._store, self._stop, self._waiting
        alive, work = self._beat_key(self.rank, "alive"), self._beat_key(self.rank, "work")

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    store.add(alive, 1)
                    if not waiting.is_set():
                        store.add(work, 1)
                except RuntimeError as exc:  # the store went away: the next wait reports it
                    _log.warning("ddpckpt heartbeat of rank %d stopped: %s", self.rank, exc)
                    return

        store.add(alive, 1)
        store.add(work, 1)
        self._beater = threading.Thread(target=beat, name="ddpckpt-heartbeat", daemon=True)
        self._beater.start()

    def _wait(self, keys: dict[int, str], tag: str, grace: float = 0.0) -> None:
        """Wait until every key in ``keys`` (rank -> key that rank sets) exists.

        While waiting, this rank publishes which ranks it waits for. A pending rank makes
        progress if it is alive (its heartbeat runs) and is either working or waiting,
        directly or through others, for a rank that is: a slow writer keeps everyone
        waiting on it patient, while ranks waiting for each other in a cycle (mismatched
        calls) or a dead rank show none. A pending rank without progress for ``timeout +
        grace`` seconds raises :class:`CollectiveTimeoutError` naming it.
        """
        waiting_key = self._key("waiting", self.rank)
        self._store.set(waiting_key, json.dumps(sorted(keys)).encode())
        self._waiting.set()
        try:
            pending = dict(keys)
            liveness = _Liveness(self, self.timeout + grace)
            delay, next_scan = 0.0005, time.monotonic() + _SCAN_PERIOD
            while not self._store.check(list(pending.values())):
                time.sleep(delay)
                delay = min(delay * 1.5, 0.02)
                if time.monotonic() < next_scan:
                    continue
                next_scan = time.monotonic() + _SCAN_PERIOD
                pending = {r: k for r, k in pending.items() if not self._store.check([k])}
                silent = sorted(r for r in pending if not liveness.progressing(r))
                if silent:
                    raise self._timeout_error(silent, tag)
        finally:
            self._waiting.clear()
            self._store.set(waiting_key, b"[]")  # never deleted mid-call: readers must not block

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


class _Liveness:
    """Which ranks make progress, judged from their heartbeats (see :meth:`Comm._wait`)."""

    def __init__(self, comm: Comm, timeout: float) -> None:
        self.comm = comm
        self.timeout = timeout
        self.seen: dict[tuple[int, str], tuple[int, float]] = {}

    def _recent(self, rank: int, kind: str) -> bool:
        """Whether ``rank``'s ``kind`` beat changed within the timeout (or was first seen then)."""
        now = time.monotonic()
        value = self.comm._beat(rank, kind)
        last = self.seen.get((rank, kind))
        if last is None or last[0] != value:
            self.seen[(rank, kind)] = last = (value, now)
        return now - last[1] <= self.timeout

    def _waits_for(self, rank: int) -> list[int]:
        key = self.comm._key("waiting", rank)
        if not self.comm._store.check([key]):
            return []
        return [int(r) for r in json.loads(self.comm._store.get(key))]

    def progressing(self, rank: int, visiting: frozenset[int] = frozenset()) -> bool:
        if rank in visiting or not self._recent(rank, "alive"):
            return False
        if self._recent(rank, "work"):
            return True
        inner = visiting | {rank}
        return any(self.progressing(other, inner) for other in self._waits_for(rank))


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


def _unpack_result(blob: bytes) -> list[bytes]:
    if blob[:1] == b"E":
        doc = json.loads(blob[1:])
        error = error_class(doc["type"])(doc["message"])
        error.failures = {int(r): f for r, f in doc["failures"].items()}
        raise error
    return _unpack(blob[1:])


def _encode_error(exc: CheckpointError) -> bytes:
    doc = {"type": type(exc).__name__, "message": str(exc), "failures": exc.failures}
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
