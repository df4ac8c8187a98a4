"""The write side of a :class:`~ddpckpt.Checkpointer`: its saves, from the run directory's
set-up to retention.

One :class:`RunSaves` per writable Checkpointer. It finds the storage domains and takes the
run's lock (one rank per domain, the *leader*, touches the directory), writes and commits
each save synchronously or through the Checkpointer's :class:`~ddpckpt._io.async_saver.AsyncSaver`,
then points ``latest`` at it and applies retention; a save that fails in storage goes to
:class:`~ddpckpt._run.save_failures.SaveFailures`. It knows the newest step saved
(:attr:`RunSaves.latest`) and the newest committed one (:attr:`RunSaves.committed`).

Collective methods are called by the Checkpointer on every rank at the same points; the
local ones say so.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.topology import storage_domains
from ddpckpt._format.manifest import MANIFEST_NAME
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.planning import plan_write, staging_share
from ddpckpt._io.write_plan import WritePlan
from ddpckpt._io.writing import write_and_commit
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.best_notice import BestNotices
from ddpckpt._run.options import CheckpointerOptions
from ddpckpt._run.rundir import (
    apply_retention,
    clean_temporaries,
    committed_records,
    point_latest,
    scan,
    set_aside,
    step_dirname,
    write_latest,
    write_run_file,
)
from ddpckpt._run.runlock import RunLock
from ddpckpt._run.runpath import refuse_no_directory
from ddpckpt._run.save_failures import SaveFailures
from ddpckpt._run.tiernames import TierNames
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointStepError,
    CheckpointWriteError,
)
from ddpckpt.storage._location import Location

T = TypeVar("T")
_log = get_logger(__name__)
_WAIT_NOTICE_S = 0.5  # shorter waits for the previous write are not worth a message


class RunSaves:
    """A run's saves on this rank: set-up, write, commit, ``latest``, retention, failures."""

    def __init__(
        self,
        location: Location,
        options: CheckpointerOptions,
        saver: AsyncSaver,
        names: TierNames | None = None,
    ) -> None:
        self.location = location
        directory = location.path
        self.options = options
        self.saver = saver  # the tier's own host buffer and background writer
        self.names = names or TierNames.durable(directory)  # how its messages name the tier
        self.failures = SaveFailures(options.failures, self.names)
        self._waits_told = False  # a save that waited for the previous write was reported
        self.lock = RunLock(location, options.storage.lock_stale_after)
        self.domains: list[list[int]] | None = None  # known once set up
        self.latest: int | None = None  # newest step saved (maybe still in flight)
        self.committed: int | None = None  # newest step known to be committed
        self._leader = False
        self._run_file_written = False
        self.best_notices = BestNotices(directory)
        self.refused: CheckpointLockedError | None = None  # the lock is lost: no more saves

    @property
    def directory(self) -> str:
        """The run directory, as messages name it."""
        return self.location.path

    @property
    def lists(self) -> bool:
        """Whether this rank lists the run directory for its storage domain: the domain's
        first rank once :meth:`prepare` ran (the others receive what it found, so each
        manifest is parsed once per domain, not once per rank), every rank before."""
        return self._leader or self.domains is None

    def comm(self, call: str, path: str | None = None) -> Comm:
        return Comm.open(call, path=path or self.directory, timeout=self.options.storage.timeout)

    def at(self, step: int) -> Location:
        """Where checkpoint ``step`` of the run is saved."""
        return self.location.join(step_dirname(step))

    def path(self, step: int) -> str:
        return self.at(step).path

    def prepare(self, comm: Comm) -> None:
        """Collective: create the run directory (:class:`ValueError` if a file is in its
        way), find the storage domains, take the lock, clear leftovers, learn the newest
        step."""
        refuse_no_directory(comm, self.location, create=True)
        sharing = self.options.storage.sharing  # creating the directory may fail
        domains = self._storage(
            lambda: storage_domains(comm, self.location, sharing), "setting up the run"
        )
        self._leader = any(d[0] == comm.rank for d in domains)

        def setup() -> list[int]:
            if self._leader:
                self.lock.acquire()
                for name in clean_temporaries(self.location):
                    _log.info(
                        "%s: removed %s, left by an interrupted save or deletion",
                        self.directory,
                        name,
                    )
            if not self._leader:  # its domain's first rank lists it for all of them
                return []
            return [e.step for e in scan(self.location) if e.status == "committed"]

        newest = comm.run_reduce(
            "setup",
            lambda: max(self._storage(setup, "setting up the run"), default=None),
            lambda found: max((s for s in found if s is not None), default=None),
        )
        self.domains = domains  # only now: a failed set-up is tried again by the next save
        self.latest = self.committed = newest

    def save(
        self,
        step: int,
        header: dict[str, Any],
        capture: Callable[[], Snapshot],
        synchronous: bool,
        borrow: AsyncSaver | None = None,
    ) -> str | None:
        """Collective: capture and save checkpoint ``step``; its path, or ``None`` if storage
        failed and ``on_error="warn"``. ``borrow``: a saver that staged the same snapshot
        (see :meth:`AsyncSaver.start`)."""
        previous, before, began = self.saver.latest, self.latest, time.monotonic()
        self.settle()  # a failed previous save moves self.latest back
        if previous is not None and previous.finished is not None and before is not None:
            self._note_wait(step, before, previous.started, previous.finished, began)
        if self.refused is not None:  # lost for good: counted as a failed save
            self.failed(step, CheckpointLockedError(str(self.refused)))
            return None
        if self.domains is None:
            try:
                with self.comm("Checkpointer.prepare") as comm:
                    self.prepare(comm)
            except CheckpointWriteError as exc:
                self.failed(step, exc)
                return None
        if self.latest is not None and step < self.latest:
            raise CheckpointStepError(
                f"{self.directory}: cannot save step {step}: the newest checkpoint is step "
                f"{self.latest}. Steps must grow; after going back to an older checkpoint, "
                "delete the newer ones or use a new directory"
            )
        again = step == self.latest
        comm = self.comm("Checkpointer.save", self.path(step))
        handed_off = False
        try:
            snapshot = comm.run("capture", capture)
            storage = self.options.storage
            plan = plan_write(
                comm, self.at(step), snapshot, header, overwrite=again, storage=storage.sharing,
                domains=self.domains, partners=storage.partners,
            )  # fmt: skip
            if again:
                _log.info("%s: step %d saved again; the new state replaces it", plan.path, step)
            asynchronous = self.options.asynchronous
            if asynchronous.enabled and not synchronous:
                overlap = asynchronous.overlap
                self.saver.start(
                    plan, snapshot, overlap=overlap, persist=self._persist, borrow=borrow
                )
                handed_off = True
            else:
                self._persist(plan)
        except CheckpointWriteError as exc:
            self.failed(step, exc)
            return None
        finally:
            if not handed_off:
                comm.close()
        self.latest = step
        self.options.schedule.policy.saved(step, time.monotonic())
        return plan.path

    def _note_wait(
        self, step: int, previous: int, started: float, finished: float, called: float
    ) -> None:
        """Local: say (a WARNING from rank 0, whose wait stands for every rank's: they save
        in step; once per tier, DEBUG after) when this save of ``step`` waited for the
        write of step ``previous``, started at ``started`` and done at ``finished``: saves
        come faster than they are written, and training stalls. A wait under half a second,
        or under a tenth of the time between the two saves, is not worth a message."""
        waited = finished - called
        between = called - started  # from the previous save() to this one
        if waited < _WAIT_NOTICE_S or waited < between / 10:
            return
        steps = max(1, step - previous)
        enough = math.ceil(steps * (finished - started) / between) if between > 0 else steps
        told, self._waits_told = self._waits_told, True
        _log.log(
            logging.DEBUG if told else logging.WARNING,
            "%s: save() of step %d stalled training for %.2f s, waiting for the write of "
            "step %d to finish (a tier writes one save at a time): that write took %.2f s, "
            "and the %d step(s) between the two saves %.2f s. Saves every %d steps or more "
            "(%s) would not wait%s",
            self.names.where,
            step,
            waited,
            previous,
            finished - started,
            steps,
            between,
            enough,
            self.names.cadence,
            "" if told else " (said once; later waits are logged at DEBUG)",
            extra=same_on_every_rank(),
        )

    def reserve(self, snapshot: Snapshot) -> None:
        """Local: size the asynchronous saves' host buffer for ``snapshot`` (once set up)."""
        if self.domains is None:
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        self.saver.reserve(staging_share(snapshot, self.domains, rank))

    def resumed(
        self, step: int, committed: dict[int, Any], broken: dict[int, str], failed: list[int]
    ) -> None:
        """Collective, after checkpoint ``step`` was loaded (from here, or from the fast
        tier): move aside the broken ones newer than it (and those that failed to load);
        point ``latest`` at the newest committed one left. Later saves must be newer than
        it (after ``resume(step=N)`` too, so no branch can mix with the abandoned one)."""
        moved = {b: problem for b, problem in broken.items() if b > step}
        moved.update((f, "it failed to load, as said above") for f in failed)
        newest = max((c for c in committed if c not in moved), default=None)

        def tidy() -> None:
            if self._leader:
                set_aside(self.location, moved)
                if newest is not None:
                    point_latest(self.location, newest)

        with self.comm("Checkpointer.resumed") as comm:
            comm.run("tidy", lambda: self._storage(tidy, "moving broken checkpoints aside"))
        self.latest = self.committed = newest
        self.options.schedule.policy.saved(step, time.monotonic())

    def settle(self) -> None:
        """Collective: wait for the background save, and handle its failure as a
        synchronous one, on every rank at the same call (see :mod:`ddpckpt._io.background`)."""
        try:
            self.saver.raise_unseen()
        except CheckpointWriteError as exc:
            self.failed(self.latest, exc)

    def report_locally(self) -> None:
        """Local: wait for the background save; report its failure here, deciding nothing."""
        error = self.saver.outcome()
        newest = self._newest_good() if isinstance(error, CheckpointWriteError) else None
        self.failures.report_background(error, newest)

    def flush(self) -> str | None:
        """Collective: finish the save in flight; its path if it committed."""
        step = self.latest
        self.settle()
        return self.path(step) if step is not None and self.committed == step else None

    def newest(self) -> str:
        """The newest committed checkpoint, for messages."""
        if self.committed is None:
            return "nothing (this run has no committed checkpoint)"
        return f"{self.path(self.committed)} (step {self.committed})"

    def failed(self, step: int | None, exc: CheckpointError) -> None:
        """Record a failed (or refused) save; raise it (``on_error="raise"``) or log it
        loudly, naming the newest good checkpoint if it is still there."""
        newest = self._newest_good()
        self.latest = self.committed
        self.failures.failed(step, exc, newest)

    def _newest_good(self) -> str | None:
        """:meth:`newest` for a failure's message, or ``None`` if there is none."""
        self._forget_if_gone()
        return None if self.committed is None else self.newest()

    def _forget_if_gone(self) -> None:
        """Forget the newest committed checkpoint if it is gone (deleted from outside: the
        run directory removed?)."""
        if self.committed is None:
            return
        store, path = self.location.storage, self.path(self.committed)
        try:
            if not store.commit.exists(store, path):
                self.committed = None
        except OSError:
            pass  # storage cannot tell now: keep what this job knows

    def close(self) -> None:
        """Local: wait for the save in flight, free the host buffer, release the lock."""
        try:
            self.report_locally()
        finally:
            self.saver.release()
            self.lock.release()

    def _persist(self, plan: WritePlan) -> None:
        """Write and commit ``plan`` (retrying transient storage errors), then retention.

        Runs on the training thread, or on the background thread for async saves (so the
        lock check, a request on object stores, never stalls training). Never writes where
        this job lost the lock; a run directory that vanished is created again first.
        """
        comm = plan.comm
        try:
            retaken = comm.run_reduce("lock", lambda: self._check_lock(), any)
        except CheckpointLockedError as exc:
            self.refused = exc
            raise
        if retaken:  # deleted with the lock: maybe run.json, maybe checkpoints
            self._run_file_written = False
            self._forget_if_gone()
        self.failures.retrying(plan.path, lambda attempt: write_and_commit(plan, attempt))
        self.committed = plan.header["step"]
        try:
            gone = comm.run_reduce(
                "retain",
                lambda: self._storage(
                    lambda: self._after_commit(plan.path, plan.header), "updating the run"
                ),
                lambda found: next((g for g in found if g), None),
            )
        except CheckpointLockedError as exc:
            self.refused = exc
            raise
        except CheckpointError as exc:  # committed all the same
            _log.warning(
                "%s is saved, but updating 'latest' or deleting old checkpoints failed: %s",
                plan.path,
                exc,
                extra=same_on_every_rank(exc),
            )
            return
        if gone:
            self.committed = None
            raise CheckpointWriteError(errno.ENOENT, gone)

    def _check_lock(self) -> bool:
        """On leaders: whether the lock had to be taken again (see :meth:`RunLock.check`)."""
        return self._storage(self.lock.check, "checking the run's lock") if self._leader else False

    def _after_commit(self, path: str, header: Mapping[str, Any]) -> str | None:
        """On leaders, once ``path`` (saved with ``header``) is committed: under the lock
        still held, point ``latest`` at it, apply retention and say if ``keep_best`` cannot
        rank it (:mod:`ddpckpt._run.best_notice`). Returns why the save did not survive, if
        the checkpoint is gone already (its directory deleted from outside)."""
        if not self._leader:
            return None
        try:
            if self.lock.check():
                self._run_file_written = False
        except CheckpointLockedError as exc:
            raise CheckpointLockedError(
                f"{exc}. This job's checkpoint {path}, committed just before, was left there; "
                "'latest' was not moved and nothing was deleted"
            ) from None
        if not self.location.storage.exists(os.path.join(path, MANIFEST_NAME)):
            return (
                f"{path} was committed, then deleted from outside at once (the run directory "
                "removed?); 'latest' was not moved. This save did not survive"
            )
        write_latest(self.location, os.path.basename(path))
        retention = self.options.keeping.retention
        if not self._run_file_written:  # written by a job that saves, never by one that resumes
            write_run_file(self.location, {"retention": retention.describe()})
            self._run_file_written = True
        for deleted in apply_retention(self.location, retention):
            _log.info("deleted %s (retention)", deleted)
        self.lock.refresh()
        self.best_notices.after_save(retention, header, lambda: committed_records(self.location))
        return None

    def _storage(self, step: Callable[[], T], doing: str) -> T:
        """Run ``step`` reporting file-system failures as :class:`CheckpointWriteError`."""
        with run_storage_errors(self.location, doing):
            return step()


_CANNOT_WRITE = {errno.EACCES, errno.EPERM, errno.EROFS}


@contextmanager
def run_storage_errors(directory: Location, doing: str) -> Iterator[None]:
    """Report a storage failure while ``doing`` something to the run directory (not while
    writing a checkpoint) as :class:`CheckpointWriteError` saying so; where this job may
    not write there, what to do instead."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        where = exc.filename or directory
        message = f"{directory}: {doing} failed at {where}: {exc.strerror or exc}"
        if exc.errno in _CANNOT_WRITE:
            message += f". {_cannot_write(directory)}"
        raise CheckpointWriteError(exc.errno, message) from exc


def _cannot_write(directory: Location) -> str:
    """What to do about a run directory this job may not write to."""
    try:
        directory.storage.list(directory.path)
    except OSError:
        return (
            "This job can neither write nor read there: check the directory's owner and "
            "permissions (or the mount), or use another directory"
        )
    return (
        "This job may not write there, and a Checkpointer that saves must (it takes the "
        "run's lock, writes 'latest' and removes leftovers): to only load from it, open it "
        "with Checkpointer(..., read_only=True)"
    )
