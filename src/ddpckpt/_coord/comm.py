"""Collectives for ddpckpt calls: bounded waits, named missing ranks, one error on every rank.

Every collective ddpckpt call (``save``, ``load``, ``Checkpointer.resume`` ...) opens a
:class:`Comm`. Outside ``torch.distributed`` (or with one rank) every operation is local.
Under ``torch.distributed`` the coordination runs over the default process group's
key-value *store* (or any :class:`~ddpckpt._coord.store.StoreGroup`), not over the
training process group:

* no collective of the training group (NCCL or gloo) is ever entered, so a slow write on
  one rank never trips the training group's watchdog, and a call made on only some ranks
  cannot deadlock the training group;
* exchanges go through rank 0 (the leader): every rank posts one key, rank 0 reads them
  all in one ``multi_get`` and posts one reply, which carries only what the others need
  ("all ok" for :meth:`Comm.run`). A rank's store traffic per exchange is constant in the
  number of ranks, except rank 0's and that of exchanges whose result every rank needs;
* waits block in the store (``wait``), never poll; a heartbeat thread per call names a
  rank that makes no progress for ``timeout`` seconds (:mod:`ddpckpt._coord.liveness`);
* :meth:`Comm.run` runs a step on every rank and gathers the outcome at rank 0: if any
  rank failed, every rank raises the same error with a per-rank report (the local
  exception chained; see :mod:`ddpckpt._coord.failures`);
* a rank that fails between steps (:meth:`Comm.alone`), is interrupted inside one
  (``KeyboardInterrupt``), or leaves the call with an error (:meth:`Comm.close`) posts its
  failure for the ranks still in the call, which raise it within a heartbeat period;
* while rank 0 waits for ranks that have not called yet, it says which, once, after
  :func:`resolve_wait_notice` seconds.

Only small messages (statuses, plans, file records) travel through the store, by
:mod:`ddpckpt._coord.exchange`; bulk bytes (rank files, tensors) move point to point over a
gloo group of the two ranks alone (:mod:`ddpckpt._coord.copies`, :meth:`Comm.pair`).

Calls are matched across ranks by order: the n-th ddpckpt collective on one rank meets
the n-th on every other, so calls must be opened from the training thread (a background
save keeps using the call its ``save`` opened). The first exchange of each call compares
the call names, so ``save`` on one rank and ``load`` on another fails at once instead of
mixing messages. Every key a call writes to the store is deleted when the call is over
(per-rank keys by their rank once rank 0 replied, shared keys, and the parts of ranks
that stopped at a posted failure, by the last rank to close the call), except each rank's heartbeat record, one per rank for the job, and the roster
of the ranks that have one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, TypeVar

from ddpckpt._coord.copies import Pair, pair_group, rendezvous_keys
from ddpckpt._coord.exchange import LEADER, Exchanges
from ddpckpt._coord.failures import combine, describe, encode_error
from ddpckpt._coord.limits import (
    DEFAULT_TIMEOUT,
    LEAVE_WAIT,
    resolve_timeout,
    resolve_wait_notice,
)
from ddpckpt._coord.liveness import Liveness
from ddpckpt._coord.store import (
    StoreGroup,
    StoreTimeout,
    default_group,
    pack,
    unpack,
)
from ddpckpt._coord.topology import node_id
from ddpckpt._coord.wire import CloseCount, Mark
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointError, CollectiveMismatchError, CollectiveTimeoutError
from ddpckpt.storage._location import Location, locate

T = TypeVar("T")
R = TypeVar("R")
_log = get_logger(__name__)


class Comm(Exchanges):
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
            group = default_group()
        self._group = None if local or group is None or group.world_size < 2 else group
        self.rank = self._group.rank if self._group else 0
        self.world_size = self._group.world_size if self._group else 1
        self.path: str | None = None
        self.token = uuid.uuid4().hex[:12]
        self._nodes: list[str] | None = [node_id()]
        self._store: Any = None
        self._own_connection = False
        self._op = -1
        self._exchanges = 0
        self._shared_keys: list[str] | None = []
        self._own_keys: list[str] = []  # this rank's, deleted by it when the call closes
        self._liveness: Liveness | None = None
        self._settled = False
        self._orphans: list[str] = []

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
        watcher = comm._group.watch_client()
        comm._op = next(comm._group._calls)
        failed = comm._key("failed", "all")
        comm._liveness = Liveness(
            comm._group, comm._op, call, comm.timeout, failed, resolve_wait_notice()
        )
        comm._share(failed)
        comm._liveness.start(comm._store, watcher, comm._own_connection)
        try:
            comm._enter(path)
        except BaseException as exc:
            comm.close(exc)
            raise
        return comm

    def locate(self, mine: Location | str) -> Location:
        """The path the ranks agreed on (:meth:`open`), resolved: ``mine`` if it is that
        path and resolved already, else resolved here (once). Called inside the call, so
        that a rank that cannot resolve it (a URL scheme or a library its node lacks) fails
        the call on every rank at once."""
        path = mine.path if isinstance(mine, Location) else mine
        if self.path is not None and self.path != path:
            return locate(self.path)  # this rank passed another path: rank 0's (warned)
        return mine if isinstance(mine, Location) else locate(path)

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
        group = group or default_group()
        if group is None or group.world_size < 2:
            return decide()
        return group.leader_value(call, decide, limit)

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """Leave the call: this rank deletes its own keys (its transfer groups' addresses); the
        last rank to leave deletes the keys the ranks shared.

        After a call that succeeded, or failed with an error every rank raises (not a rank's
        silence, nor rank 0's own error), rank 0 returns only once every rank has left it (or after ``LEAVE_WAIT`` seconds, with a
        warning): its process often holds the store, and a script whose last call this is
        may end at once, while the others still read the call's last answer from that store
        or count themselves out of it.

        ``error``: this rank leaves because of it. Unless it is an error every rank raises
        (one that came through the call's exchanges), it is posted first, so that ranks
        still waiting in the call raise it at once rather than time out (:meth:`post_failure`).
        """
        # a failure every rank raised (not one some rank's silence caused): all are leaving
        everyone = error is None or (
            self._settled and not isinstance(error, CollectiveTimeoutError)
        )
        if error is not None and not self._settled and self._store is not None:
            self.post_failure(error)
        if self._liveness is not None:
            self._liveness.stop()
        if self._store is not None and self._shared_keys is not None:
            keys, self._shared_keys = self._shared_keys, None
            for key in self._own_keys:  # every rank is past the steps that read them
                self._store.delete_key(key)
            closed, orphans = self._key("closed", "count"), self._key("orphans", "all")
            left = self._key("left", "all")
            if self._orphans:  # listed for the last rank to leave (rank 0 may read them still)
                self._store.append(orphans, "".join(f"{key}\n" for key in self._orphans))
            waits = self.rank == 0 and everyone
            count = CloseCount.of(
                self._store.add(closed, CloseCount.add(bool(self._orphans), waits))
            )
            if count.left == self.world_size:  # nobody reads them any more
                if count.orphaned:
                    keys += [*self._store.get(orphans).decode().split(), orphans]
                for key in [*keys, closed]:
                    self._store.delete_key(key)
                if count.waiting and self.rank != 0:
                    self._store.set(left, b"")  # rank 0 waits for it, and deletes it
            elif waits:
                self._wait_for_the_others(left)
            self._group.give_back(self._store, self._own_connection)  # type: ignore[union-attr]

    def _wait_for_the_others(self, left: str) -> None:
        """Rank 0, after a call that succeeded or failed on every rank: wait until the last
        rank has left it."""
        limit = min(self.timeout, LEAVE_WAIT)
        try:
            self._store.wait([left], timedelta(seconds=limit))
        except StoreTimeout:
            _log.warning(
                "ddpckpt: %s ended, but not every rank left it within %.0f s of its end "
                "(a rank may have died since); rank 0 goes on", self.call, limit,
            )  # fmt: skip
            return
        self._store.delete_key(left)

    @property
    def group(self) -> StoreGroup | None:
        """The ranks of this call and their store (``None`` with one process)."""
        return self._group

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
                self._publish("enter", encode_error(error))
                raise error
            self._nodes = [doc["node"] for doc in docs]
            names = sorted(set(self._nodes))
            index = {name: i for i, name in enumerate(names)}
            table = {"names": names, "index": [index[n] for n in self._nodes]}
            self._store.set(nodes_key, json.dumps(table).encode())
            agreed: dict[str, Any] = {"path": path, "token": self.token}  # a JSON document
            self._publish("enter", Mark.DATA + json.dumps(agreed).encode())
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

    def run_reduce(self, tag: str, step: Callable[[], Any], reduce: Callable[[list[Any]], R]) -> R:
        """Like :meth:`run_all`, but rank 0 turns every rank's result into one JSON-able
        answer, ``reduce(results)``, and every rank receives only that answer.

        What each rank receives is the size of the answer, not ``world_size`` results: use
        it whenever the ranks need a decision (a union, a maximum, the ranks that differ)
        rather than each other's data. ``reduce`` runs on rank 0 only; if it raises, every
        rank raises the combined error.
        """
        if self.world_size == 1:
            return json.loads(json.dumps(reduce([step()])))  # the same value as with ranks
        answer, _ = self._run(tag, step, share=False, keep=True, reduce=reduce)
        return answer

    def run_scatter(
        self,
        tag: str,
        step: Callable[[], Any],
        split: Callable[[list[Any]], dict[int, Any]],
        *,
        receive: bool,
    ) -> Any:
        """Like :meth:`run_gather`, then rank 0 sends each rank that passes ``receive=True``
        its own part of ``split(results)`` (``None`` if it has none); returns this rank's
        part (``None`` where ``receive`` is false).

        A rank receives only its part: what the first rank of each storage domain needs
        to write its copy's manifest, say. ``split`` runs on rank 0 only; if it raises,
        every rank raises the combined error.
        """
        if self.world_size == 1:
            part = json.loads(json.dumps(split([step()]).get(0)))
            return part if receive else None
        part, _ = self._run(tag, step, share=False, keep=True, split=split, receive=receive)
        return part if receive else None

    def _run(
        self,
        tag: str,
        step: Callable[[], Any],
        share: bool,
        keep: bool = False,
        reduce: Callable[[list[Any]], Any] | None = None,
        split: Callable[[list[Any]], dict[int, Any]] | None = None,
        receive: bool = False,
    ) -> tuple[Any, list[Any] | None]:
        local: BaseException | None = None
        result: Any = None
        try:
            result = step()
            sent: dict[str, Any] = {"ok": result if share or keep else None}
            if receive:
                sent["receive"] = True
            payload = json.dumps(sent).encode()
        except Exception as exc:
            local = exc
            payload = json.dumps({"error": describe(exc)}).encode()
        except BaseException as exc:  # KeyboardInterrupt: this rank leaves the call now
            self.post_failure(exc)
            raise
        gathered = self._collect(tag, payload, cause=local)
        if gathered is None:  # not the leader: rank 0 sends "all ok", every result or the error
            try:
                reply = self._receive(tag)
            except CheckpointError as exc:
                raise exc from local
            if reduce is not None:
                return json.loads(reply), None
            if split is not None:
                return self._receive_part(tag) if receive else None, None
            return result, [json.loads(b)["ok"] for b in unpack(reply)] if share else None
        outcomes = [json.loads(b) for b in gathered]
        failures = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
        if failures:
            error = combine(self.call, failures)
            self._publish(tag, encode_error(error))
            raise error from local
        results = [o["ok"] for o in outcomes]
        if reduce is not None or split is not None:
            try:
                if split is not None:
                    parts = split(results)
                    receivers = [r for r, o in enumerate(outcomes) if r and o.get("receive")]
                    encoded = {r: json.dumps(parts.get(r)).encode() for r in receivers}
                    mine = json.loads(json.dumps(parts.get(LEADER)))
                else:
                    reply = json.dumps(reduce(results)).encode()  # type: ignore[misc]
            except Exception as exc:
                error = combine(self.call, {LEADER: describe(exc)})
                self._publish(tag, encode_error(error))
                raise error from exc
            if split is not None:
                for r, blob in encoded.items():  # before the reply: a receiver reads it at once
                    self._store.set(self._key(tag, f"to{r}"), blob)
                self._publish(tag, Mark.DATA)
                return mine, None
            self._publish(tag, Mark.DATA + reply)
            return json.loads(reply), None  # exactly what the other ranks decode
        self._publish(tag, Mark.DATA + (pack(gathered) if share else b""))
        return result, results if share or keep else None

    # ------------------------------------------------------------------ tensors

    def run_transfer(self, tag: str, step: Callable[[], T]) -> T:
        """Like :meth:`run`, for a step in which ranks wait for each other point to point
        (:meth:`pair`): a rank whose step fails posts its failure at once, so that ranks
        blocked on it in the step stop within a fraction of a second, not at the timeout."""

        def posting() -> T:
            try:
                return step()
            except Exception as exc:
                if self.world_size > 1 and not self._settled:
                    self.post_failure(exc)
                raise

        return self.run(tag, posting)

    def pair(self, purpose: str, peer: int) -> AbstractContextManager[Pair]:
        """A gloo group of this rank and ``peer`` for one transfer (``purpose`` names it
        within the call), shut down on leaving; ``peer`` enters it with the same
        ``purpose``, inside a step of :meth:`run_transfer`."""
        key = f"{self.token}/{purpose}"
        self._own_keys += rendezvous_keys(key, self.rank, peer)
        failed = self._key("failed", "all")
        return pair_group(
            self._store, key, self.rank, peer, self.timeout, lambda: self._store.check([failed])
        )
