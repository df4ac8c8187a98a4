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

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.topology import storage_domains
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.writing import (
    WritePlan,
    plan_write,
    staging_share,
    storage_errors,
    write_and_commit,
)
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.options import CheckpointerOptions
from ddpckpt._run.resume import point_latest, set_aside
from ddpckpt._run.rundir import (
    apply_retention,
    clean_temporaries,
    scan,
    step_dirname,
    write_latest,
    write_run_file,
)
from ddpckpt._run.runlock import RunLock
from ddpckpt._run.save_failures import SaveFailures
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import CheckpointError, CheckpointStepError, CheckpointWriteError

T = TypeVar("T")
_log = get_logger(__name__)


class RunSaves:
    """A run's saves on this rank: set-up, write, commit, ``latest``, retention, failures."""

    def __init__(self, directory: str, options: CheckpointerOptions, saver: AsyncSaver) -> None:
        self.directory = directory
        self.options = options
        self.saver = saver  # the Checkpointer's own host buffer and background writer
        self.failures = SaveFailures(options.failures)
        self.lock = RunLock(directory, options.storage.lock_stale_after)
        self.domains: list[list[int]] | None = None  # known once set up
        self.latest: int | None = None  # newest step saved (maybe still in flight)
        self.committed: int | None = None  # newest step known to be committed
        self._leader = False
        self._run_file_written = False

    def comm(self, call: str, path: str | None = None) -> Comm:
        return Comm.open(call, path=path or self.directory, timeout=self.options.storage.timeout)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, step_dirname(step))

    def prepare(self, comm: Comm) -> None:
        """Collective: find the storage domains, take the lock, clear leftovers, learn the
        newest step."""
        sharing = self.options.storage.sharing  # creating the directory may fail
        domains = self._storage(lambda: storage_domains(comm, self.directory, sharing))
        self._leader = any(d[0] == comm.rank for d in domains)

        def setup() -> list[int]:
            if self._leader:
                self.lock.acquire()
                for name in clean_temporaries(self.directory):
                    _log.info(
                        "%s: removed %s, left by an interrupted save or deletion",
                        self.directory,
                        name,
                    )
            return [e.step for e in scan(self.directory) if e.status == "committed"]

        newest = comm.run_reduce(
            "setup",
            lambda: max(self._storage(setup), default=None),
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
    ) -> str | None:
        """Collective: capture and save checkpoint ``step``; its path, or ``None`` if storage
        failed and ``on_error="warn"``."""
        self.settle()
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
            sharing = self.options.storage.sharing
            plan = plan_write(
                comm, snapshot, header, overwrite=again, storage=sharing, domains=self.domains
            )
            if again:
                _log.info("%s: step %d saved again; the new state replaces it", plan.path, step)
            asynchronous = self.options.asynchronous
            if asynchronous.enabled and not synchronous:
                overlap = asynchronous.overlap
                self.saver.start(plan, snapshot, overlap=overlap, persist=self._persist)
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
        """Collective, after checkpoint ``step`` was loaded: move aside the broken ones newer
        than it (and those that failed to load); point ``latest`` at the newest committed
        one left. Later saves must be newer than it (after ``resume(step=N)`` too, so no
        branch can mix with the abandoned one)."""
        moved = {b: problem for b, problem in broken.items() if b > step}
        moved.update((f, "it failed to load, as said above") for f in failed)
        newest = max(c for c in committed if c not in moved)

        def tidy() -> None:
            if self._leader:
                set_aside(self.directory, moved)
                point_latest(self.directory, newest)

        with self.comm("Checkpointer.resumed") as comm:
            comm.run("tidy", lambda: self._storage(tidy))
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
        self.failures.report_background(self.saver.outcome())

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

    def failed(self, step: int | None, exc: CheckpointWriteError) -> None:
        """Record a failed save; raise it (``on_error="raise"``) or log it loudly."""
        self.latest = self.committed
        newest = None if self.committed is None else self.newest()
        self.failures.failed(step, exc, newest)

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
        lock check, a request on object stores, never stalls training).
        """
        # never write where another job took over; a lock that cannot be read fails the save
        plan.comm.run("lock", lambda: self._storage(self.lock.check))
        self.failures.retrying(plan.path, lambda attempt: write_and_commit(plan, attempt))
        self.committed = plan.header["step"]
        try:
            plan.comm.run("retain", lambda: self._storage(lambda: self._after_commit(plan.path)))
        except CheckpointError as exc:  # committed all the same
            _log.warning(
                "%s is saved, but updating 'latest' or deleting old checkpoints failed: %s",
                plan.path,
                exc,
                extra=same_on_every_rank(exc),
            )

    def _after_commit(self, path: str) -> None:
        if not self._leader:
            return
        write_latest(self.directory, os.path.basename(path))
        retention = self.options.keeping.retention
        if not self._run_file_written:  # written by a job that saves, never by one that resumes
            write_run_file(self.directory, {"retention": retention.describe()})
            self._run_file_written = True
        for deleted in apply_retention(self.directory, retention):
            _log.info("deleted %s (retention)", deleted)
        self.lock.refresh()

    def _storage(self, step: Callable[[], T]) -> T:
        """Run ``step`` reporting file-system failures as :class:`CheckpointWriteError`."""
        with storage_errors(self.directory):
            return step()
