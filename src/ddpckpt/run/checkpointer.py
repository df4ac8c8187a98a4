"""A run's checkpoints: save on a schedule, keep the right ones, resume after any crash.

::

    ckpt = ddpckpt.Checkpointer("runs/exp1", model=model, optimizer=opt, scheduler=sched,
                                keep_last=3, every_steps=500)
    info = ckpt.resume()                       # None on a fresh run
    start = info.step + 1 if info else 0
    for step in range(start, total):
        train_step()
        if ckpt.should_save(step):
            ckpt.save(step, metrics={"loss": loss})
    ckpt.close()

Every method except :meth:`wait`, :meth:`close` and the queries (:meth:`steps`,
:meth:`latest_step`, :meth:`best`, :meth:`info`) is collective: call it on every rank.
See :mod:`ddpckpt.run.rundir` for the directory layout.

To load from a run another job is writing (an evaluation job), open it read-only::

    reader = ddpckpt.Checkpointer("runs/exp1", model=model, read_only=True)
    info = reader.resume()                     # or resume(step=N), or resume(best="loss")
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch
from torch import nn

from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt.dist.comm import Comm
from ddpckpt.dist.topology import storage_domains
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStepError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from ddpckpt.format.manifest import read_manifest
from ddpckpt.io.async_saver import AsyncSaver, async_mode
from ddpckpt.io.load import load
from ddpckpt.io.reader import CheckpointInfo
from ddpckpt.io.writing import (
    WritePlan,
    header_fields,
    plan_write,
    staging_share,
    storage_errors,
    write_and_commit,
)
from ddpckpt.policies import Record, Retention, SavePolicy, best_first, keeping, schedule
from ddpckpt.resumecheck import record as _resume_check
from ddpckpt.run.catalog import SET_ASIDE_MARK
from ddpckpt.run.failures import SaveFailures
from ddpckpt.run.preemption import Preemption, PreemptionWatch
from ddpckpt.run.rundir import (
    clean_temporaries,
    read_latest,
    remove_checkpoint,
    scan,
    step_dirname,
    write_latest,
    write_run_file,
)
from ddpckpt.run.runlock import RunLock
from ddpckpt.state.capture import Snapshot, capture
from ddpckpt.storage import configure, new_token, storage_for
from ddpckpt.training.loader import adopt_loaders

__all__ = ["Checkpointer"]

T = TypeVar("T")
_log = get_logger(__name__)
_READER_LISTINGS = 3  # times a read-only resume lists the directory before giving up


class Checkpointer:
    """Saves a run's checkpoints under ``directory`` and resumes from the newest good one.

    Objects: ``model`` (required; plain, DDP or compiled), ``optimizer``, ``scheduler``,
    ``scaler``, ``extra`` (as for :func:`ddpckpt.save`).

    When to save: ``every_steps`` and/or ``every_seconds`` (rank 0's clock decides), or a
    :class:`~ddpckpt.policies.SavePolicy` as ``save_policy``.

    What to keep: the ``keep_last`` newest (``None`` keeps all) and, with ``keep_best`` and
    ``monitor``, the ``keep_best`` best by that metric (``mode`` ``"min"`` or ``"max"``), or
    a :class:`~ddpckpt.policies.Retention` as ``retention``. The newest committed
    checkpoint is always kept; others are deleted only after a newer one is committed.

    Asynchronous saves: with ``async_save=True``, :meth:`save` returns once this rank's
    share of the state is copied to reusable host buffers; writing, commit, ``latest`` and
    retention follow in the background (one save in flight; the next call waits for it).
    ``async_save="overlap"`` also copies parameters and optimizer state during the next
    forward/backward, and ``optimizer.step()`` waits for that copy.

    Failures: a save that fails in storage (disk full, I/O error) is retried ``retries``
    times with exponential backoff when the error is transient, then, with
    ``on_error="warn"`` (the default), logged as an ERROR (on stderr unless ``logging``
    is configured; by rank 0 and any rank with a failure of its own) while training goes on; with
    ``"raise"`` it raises on every rank. Programming errors (a value that cannot be
    stored, ranks holding different state) always raise. :attr:`last_error` is the
    error of the most recent failed save (``None`` once a save succeeds) and
    :attr:`failed_saves` counts the failures since the last success; every failed save
    logs an ERROR saying so and naming the newest good checkpoint.

    Read-only: with ``read_only=True`` the Checkpointer only loads. :meth:`resume` then
    takes no lock, cleans nothing, moves nothing aside and writes nothing (``latest``,
    ``run.json``), so it is safe to use while another job trains into ``directory``;
    :meth:`save` raises.

    Preemption: with ``preemption=True`` (or a :class:`~ddpckpt.run.preemption.Preemption`), a
    SIGTERM or SIGUSR1 on any rank makes :meth:`should_save` return True at the same step on
    every rank; that save is synchronous, then :attr:`preempted` is True and the loop should
    stop and exit with :attr:`exit_code` (see :mod:`ddpckpt.run.preemption`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: MutableMapping[str, Any] | None = None,
        keep_last: int | None = 3,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        every_steps: int | None = None,
        every_seconds: float | None = None,
        save_policy: SavePolicy | None = None,
        retention: Retention | None = None,
        on_error: str = "warn",
        retries: int = 2,
        retry_backoff: float = 1.0,
        rng: bool = True,
        async_save: bool | str = False,
        storage: str | None = None,
        timeout: float | None = None,
        lock_stale_after: float = 600.0,
        read_only: bool = False,
        preemption: bool | Preemption = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        configure(directory, storage_options)  # an s3:// URL's client (ddpckpt.storage)
        self._failures = SaveFailures(on_error, retries, retry_backoff)
        if read_only and preemption:
            raise ValueError("preemption= saves a checkpoint; a read_only Checkpointer cannot")
        if monitor is not None and keep_best is None and retention is None:
            raise ValueError("monitor= only matters with keep_best=; pass keep_best=K as well")
        self.directory = _resume_check.redirect(os.fspath(directory), read_only=read_only)
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.extra = extra
        adopt_loaders(extra)  # a DataLoader must be tracked before it iterates
        self.save_policy = save_policy or schedule(every_steps, every_seconds)
        self.retention = retention or keeping(keep_last, keep_best, monitor, mode)
        self.mode = mode
        self.read_only = read_only
        self.rng, self.storage, self.timeout = rng, storage, timeout
        self.overlap = async_mode(async_save, optimizer)
        self.async_save = bool(async_save)
        self._saver = AsyncSaver()  # this run's own host buffer and background writer
        self._reserved = False  # whether the buffer was sized ahead of the first save
        self._committed: int | None = None  # newest step known to be committed
        self._lock = RunLock(self.directory, lock_stale_after)
        self._domains: list[list[int]] | None = None
        self._leader = False
        self._latest: int | None = None
        self._closed = False
        self._run_file_written = False
        options = Preemption.of(preemption)
        self._preemption = None if options is None else PreemptionWatch(options, self._newest)
        if (recorder := _resume_check.active()) is not None:
            recorder.attach(self)

    # ------------------------------------------------------------------ public

    def resume(
        self, step: int | None = None, *, best: str | None = None, mode: str | None = None
    ) -> CheckpointInfo | None:
        """Restore the newest committed checkpoint that loads and verifies; collective.

        A newer checkpoint that is corrupt or incomplete is reported (naming the file),
        moved aside as ``step-N.corrupt-*`` and skipped. Returns ``None`` when the
        directory holds no checkpoint; raises if checkpoints exist but none can be
        loaded. With ``step``, restores exactly that checkpoint; with ``best``, the best
        by that metric (``mode`` ``"min"`` or ``"max"``, by default the Checkpointer's),
        falling back to the next best. Later saves must still be newer than the newest
        checkpoint.

        Read-only (``read_only=True``): nothing is moved aside or written, and a
        checkpoint that disappears or changes while it is loaded (the writing job's
        retention deleted it) is reported and the next candidate is loaded.
        """
        self._check_open()
        if step is not None and best is not None:
            raise ValueError("pass step= or best=, not both")
        self._settle()
        failed: list[int] = []
        failures: list[str] = []
        # A reader whose candidates were all deleted meanwhile lists the directory again.
        for listing in range(_READER_LISTINGS if self.read_only else 1):
            with self._comm("Checkpointer.resume") as comm:
                if not self.read_only and listing == 0:
                    self._prepare(comm)
                listed = comm.run_reduce("list", lambda: _listing(self.directory), _merged)
            committed = {int(s): m for s, (status, m) in listed.items() if status == "committed"}
            broken = sorted({int(s) for s in listed} - set(committed))
            candidates = [
                c for c in self._candidates(committed, step, best, mode) if c not in failed
            ]
            if not candidates and not broken and not failed:
                _log.info("%s: no checkpoint to resume from; starting fresh", self.directory)
                return self._resumed(None)
            for candidate in candidates:
                info = self._try_load(candidate, failures)
                if info is None:
                    failed.append(candidate)
                    continue
                if not self.read_only:
                    moved = sorted({b for b in broken if b > candidate} | set(failed))
                    newest = max(c for c in committed if c not in moved)
                    self._after_resume(candidate, moved, newest)
                return self._resumed(info)
            if not candidates:
                break
        raise CorruptCheckpointError(
            f"{self.directory}: holds checkpoints but none can be loaded:\n  "
            + "\n  ".join(failures)
            if failures
            else f"{self.directory}: holds only incomplete checkpoints ({broken}); nothing to resume"
        )

    def _try_load(self, step: int, failures: list[str]) -> CheckpointInfo | None:
        """Load checkpoint ``step``; ``None`` (reported, added to ``failures``) if it is
        damaged or, for a reader, gone."""
        path = self._path(step)
        try:
            return load(path, **self._objects(), rng=self.rng, timeout=self.timeout)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            if isinstance(exc, CheckpointNotFoundError) and not self.read_only:
                raise  # listed a moment ago under this job's lock: not a race
            _log.warning(
                "cannot resume from %s: %s; trying %s",
                path,
                exc,
                "the next candidate (the job writing there may have deleted or replaced it)"
                if self.read_only
                else "an older checkpoint",
                extra=same_on_every_rank(exc),
            )
            failures.append(f"{path}: {exc}")
            return None

    def _candidates(
        self,
        committed: dict[int, dict[str, Any]],
        step: int | None,
        best: str | None,
        mode: str | None,
    ) -> list[int]:
        """The steps to try loading, in order (see :meth:`resume`)."""
        if step is not None:
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"{self._path(step)}: no committed checkpoint for step {step}"
                )
            return [step]
        if best is None:
            return sorted(committed, reverse=True)
        ranked = best_first(committed, best, mode or self.mode)
        if committed and not ranked:
            raise CheckpointNotFoundError(
                f"{self.directory}: no checkpoint has a finite metric {best!r} (saved with "
                f"metrics={{{best!r}: ...}}); resume() without best= loads the newest"
            )
        return ranked

    def should_save(self, step: int) -> bool:
        """Whether the policy asks for a save at ``step``; identical on every rank.

        When the policy reads the clock (``every_seconds``) rank 0's answer is used on
        every rank: rank 0 publishes it in one store key that the other ranks wait for, so
        every rank must call this at the same steps. The same holds with ``preemption``:
        then rank 0 also answers True, on every rank, at the first step after a signal on
        any rank (see :mod:`ddpckpt.run.preemption`).
        """
        if (recorder := _resume_check.active()) is not None:
            recorder.step(self, step)
        watch = self._preemption
        latest = self._latest  # with preemption on, a signal can still finish this save
        if latest is not None and (step < latest or (step == latest and watch is None)):
            return False
        if watch is not None:
            watch.announce()

        def decide() -> bytes:  # on rank 0 only when the ranks must agree
            preempt = watch.requested() if watch is not None else None
            if preempt is not None:
                return preempt
            if self._latest is not None and step <= self._latest:
                return b"0"
            return b"1" if self.save_policy.should_save(step, time.monotonic()) else b"0"

        if self.save_policy.needs_agreement or watch is not None:
            decision = Comm.from_leader("Checkpointer.should_save", decide, timeout=self.timeout)
        else:
            decision = decide()
        if decision[:1] == b"P" and watch is not None:
            watch.agree(step, decision)
            if step == self._latest:  # the newest save holds this step: finish it, no new one
                watch.run_save(self._flush)
                return False
            return True
        if decision != b"1":
            self._reserve_staging()
        return decision == b"1"

    def _reserve_staging(self) -> None:
        """Once the layout is known, allocate the async saves' host buffer on a helper
        thread, so the first save does not stall on it (pinning is about 0.5 s per GB)."""
        if not self.async_save or self._reserved or self._domains is None:
            return
        self._reserved = True
        if self._saver.latest is not None:
            return  # a save already sized the buffer, and may still be copying into it
        try:
            snapshot = capture(**self._objects(), rng=False)
        except Exception as exc:  # the save itself raises it; nothing to size until then
            _log.debug("%s: not sizing the staging buffer ahead: %r", self.directory, exc)
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        self._saver.reserve(staging_share(snapshot, self._domains, rank))

    def save(
        self, step: int, epoch: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> str | None:
        """Save the objects as checkpoint ``step``; collective. Returns its path.

        Synchronous saves return once the checkpoint is durable; asynchronous ones once the
        state is copied (:meth:`wait` blocks until durable). Saving the newest step again
        (an every-N-steps save and an epoch-end save on the same step) replaces it
        atomically with the state as of this call. Raises :class:`CheckpointStepError`
        if ``step`` is older than the newest checkpoint. Returns ``None`` if storage
        failed and ``on_error="warn"`` (see :attr:`last_error`).

        After :meth:`should_save` agreed on a preemption, this save is synchronous and
        :attr:`preempted` is True once it returns (or raises).
        """
        if self._preemption is not None and self._preemption.agreed is not None:
            return self._preemption.run_save(lambda: self._save(step, epoch, metrics, True))
        return self._save(step, epoch, metrics)

    def _save(
        self,
        step: int,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
        synchronous: bool = False,
    ) -> str | None:
        self._check_open()
        if self.read_only:
            raise RuntimeError(
                f"Checkpointer({self.directory!r}, read_only=True) cannot save; open it "
                "without read_only=True in the job that writes this run"
            )
        self._settle()
        header = header_fields(step, epoch, metrics)
        if self._domains is None:
            try:
                with self._comm("Checkpointer.prepare") as comm:
                    self._prepare(comm)
            except CheckpointWriteError as exc:
                self._failed(step, exc)
                return None
        if self._latest is not None and step < self._latest:
            raise CheckpointStepError(
                f"{self.directory}: cannot save step {step}: the newest checkpoint is step "
                f"{self._latest}. Steps must grow; after going back to an older checkpoint, "
                "delete the newer ones or use a new directory"
            )
        again = step == self._latest
        comm = self._comm("Checkpointer.save", self._path(step))
        handed_off = False
        try:
            snapshot = comm.run("capture", self._capture)
            plan = plan_write(
                comm, snapshot, header, overwrite=again, storage=self.storage, domains=self._domains
            )
            if again:
                _log.info("%s: step %d saved again; the new state replaces it", plan.path, step)
            if self.async_save and not synchronous:
                self._saver.start(plan, snapshot, overlap=self.overlap, persist=self._persist)
                handed_off = True
            else:
                self._persist(plan)
        except CheckpointWriteError as exc:
            self._failed(step, exc)
            return None
        finally:
            if not handed_off:
                comm.close()
        self._latest = step
        self.save_policy.saved(step, time.monotonic())
        if (recorder := _resume_check.active()) is not None:
            recorder.saved(self, step, epoch)
        return plan.path

    @property
    def preempted(self) -> bool:
        """Whether a preemption checkpoint was saved (or failed): stop training now."""
        return self._preemption is not None and self._preemption.preempted

    @property
    def exit_code(self) -> int:
        """The process's exit code to use: ``128 + signal`` once :attr:`preempted` (143 for
        SIGTERM, as a shell reports a process that signal ended), else 0."""
        return self._preemption.exit_code if self._preemption is not None else 0

    @property
    def last_error(self) -> CheckpointWriteError | None:
        """The error of the most recent failed save; ``None`` once a save succeeds."""
        return self._failures.last_error

    @property
    def failed_saves(self) -> int:
        """How many saves failed since the last one that succeeded."""
        return self._failures.failed_saves

    def log_step(self, loss: Any) -> None:
        """Report this step's loss to ``ddpckpt check-resume``, which compares it between
        the uninterrupted and the resumed run; local. Outside a check it does nothing."""
        if (recorder := _resume_check.active()) is not None:
            recorder.loss(loss)

    def _resumed(self, info: CheckpointInfo | None) -> CheckpointInfo | None:
        recorder = _resume_check.active()
        return info if recorder is None else recorder.resumed(self, info)

    # ------------------------------------------------------------------ queries (local)

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first; local and read-only.

        Committed means the manifest is in place and verifies; the data is verified
        when loaded (or by :func:`ddpckpt.verify`).
        """
        return [e.step for e in scan(self.directory) if e.status == "committed"]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``; local and read-only."""
        return max(self.steps(), default=None)

    def best(self, metric: str, mode: str | None = None) -> int | None:
        """The committed step with the best finite ``metric`` (``mode`` ``"min"`` or
        ``"max"``, by default the Checkpointer's), or ``None``; local and read-only."""
        committed = {e.step: e.metrics for e in scan(self.directory) if e.status == "committed"}
        ranked = best_first(committed, metric, mode or self.mode)
        return ranked[0] if ranked else None

    def info(self, step: int) -> CheckpointInfo:
        """The metadata of checkpoint ``step`` (epoch, metrics, world size, when saved)
        without loading it; local and read-only. Raises :class:`CheckpointNotFoundError`
        or :class:`CorruptCheckpointError`."""
        path = self._path(step)
        return CheckpointInfo.from_manifest(path, read_manifest(path), {})

    def wait(self) -> None:
        """Block until every save started so far is durable; local.

        A background save that failed is then reported like a synchronous one: raised
        with ``on_error="raise"``, logged with ``"warn"``. Being local, it decides nothing
        for the other ranks: the next :meth:`save` or :meth:`resume` handles the failure on
        every rank alike (with ``"raise"`` it raises there too).
        """
        self._report_locally()

    def close(self) -> None:
        """Wait for saves in flight, free the asynchronous saves' host buffer and release
        the directory's lock. Idempotent; local."""
        if self._closed:
            return
        self._closed = True
        try:
            self._report_locally()
        finally:
            try:
                self._saver.release()
                self._lock.release()
            finally:
                if self._preemption is not None:  # last: it may re-deliver a signal
                    self._preemption.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _objects(self) -> dict[str, Any]:
        """The objects saved and restored, as :func:`ddpckpt.save` and ``load`` take them."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "extra": self.extra,
        }

    def _comm(self, call: str, path: str | None = None) -> Comm:
        return Comm.open(call, path=path or self.directory, timeout=self.timeout)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, step_dirname(step))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer({self.directory!r}) is closed")

    def _prepare(self, comm: Comm) -> None:
        """Find the storage domains, take the lock, clear leftovers, learn the newest step."""
        domains = storage_domains(comm, self.directory, self.storage)
        self._leader = any(d[0] == comm.rank for d in domains)

        def setup() -> list[int]:
            if self._leader:
                self._lock.acquire()
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
        self._domains = domains  # only now: a failed set-up is tried again by the next save
        self._latest = self._committed = newest

    def _capture(self) -> Snapshot:
        return capture(**self._objects(), rng=self.rng)

    def _persist(self, plan: WritePlan) -> None:
        """Write and commit ``plan`` (retrying transient storage errors), then retention.

        Runs on the training thread, or on the background thread for async saves (so the
        lock check, a request on object stores, never stalls training).
        """
        plan.comm.run("lock", self._lock.check)  # never write where another job took over
        self._failures.retrying(plan.path, lambda attempt: write_and_commit(plan, attempt))
        self._committed = plan.header["step"]
        try:
            plan.comm.run("retain", lambda: self._storage(lambda: self._after_commit(plan.path)))
        except CheckpointError as exc:  # committed all the same
            _log.warning(
                "%s is saved, but updating 'latest' or deleting old checkpoints failed: %s",
                plan.path,
                exc,
                extra=same_on_every_rank(exc),
            )

    def _flush(self) -> str | None:
        """Finish the save in flight (the preemption checkpoint already captured); its path."""
        step = self._latest
        self._settle()
        return self._path(step) if step is not None and self._committed == step else None

    def _newest(self) -> str:
        """The newest committed checkpoint, for messages."""
        if self._committed is None:
            return "nothing (this run has no committed checkpoint)"
        return f"{self._path(self._committed)} (step {self._committed})"

    def _storage(self, step: Callable[[], T]) -> T:
        """Run ``step`` reporting file-system failures as :class:`CheckpointWriteError`."""
        with storage_errors(self.directory):
            return step()

    def _settle(self) -> None:
        """Wait for the background save, and handle its failure as a synchronous one.

        Called at the start of collective methods only: every rank consumes the outcome at
        the same call, so all ranks take the same path (see :mod:`ddpckpt.io.background`).
        """
        try:
            self._saver.raise_unseen()
        except CheckpointWriteError as exc:
            self._failed(self._latest, exc)

    def _report_locally(self) -> None:
        """Wait for the background save; report its failure on this rank, deciding nothing."""
        self._failures.report_background(self._saver.outcome())

    def _failed(self, step: int | None, exc: CheckpointWriteError) -> None:
        """Record a failed save; raise it (``on_error="raise"``) or log it loudly."""
        self._latest = self._committed
        newest = (
            None
            if self._committed is None
            else f"{self._path(self._committed)} (step {self._committed})"
        )
        self._failures.failed(step, exc, newest)

    def _after_commit(self, path: str) -> None:
        if not self._leader:
            return
        write_latest(self.directory, os.path.basename(path))
        if not self._run_file_written:  # written by a job that saves, never by one that resumes
            write_run_file(self.directory, {"retention": self.retention.describe()})
            self._run_file_written = True
        committed = [e for e in scan(self.directory) if e.status == "committed"]
        records = [Record(e.step, e.metrics) for e in committed]
        keep = self.retention.keep(records) | {max(r.step for r in records)}
        for entry in committed:
            if entry.step not in keep:
                remove_checkpoint(entry.path)
                _log.info("deleted %s (retention)", entry.path)
        self._lock.refresh()

    def _after_resume(self, step: int, newer_broken: list[int], newest: int) -> None:
        """Move aside the broken checkpoints newer than ``step``; point ``latest`` at it.

        ``newest`` is the newest committed checkpoint left: later saves must be newer
        (after ``resume(step=N)`` too, so no branch can mix with the abandoned one).
        """
        with self._comm("Checkpointer.resumed") as comm:

            def tidy() -> None:
                if not self._leader:
                    return
                for broken in newer_broken:
                    source, store = self._path(broken), storage_for(self.directory)
                    if store.exists(source):
                        target = f"{source}{SET_ASIDE_MARK}{new_token()}"
                        store.commit.set_aside(store, source, target)
                        _log.warning("moved %s aside to %s; it is never loaded", source, target)
                if read_latest(self.directory) != step_dirname(newest):
                    write_latest(self.directory, step_dirname(newest))

            comm.run("tidy", lambda: self._storage(tidy))
        self._latest = self._committed = newest
        self.save_policy.saved(step, time.monotonic())


def _listing(directory: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every checkpoint of ``directory``: its status and metrics, by step (JSON-able)."""
    return {str(e.step): (e.status, e.metrics) for e in scan(directory)}


def _merged(
    views: list[dict[str, tuple[str, dict[str, Any]]]],
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every rank's listing in one (rank 0 reduces them): a step is committed if any rank
    sees it committed (a node lacking its copy gets it repaired by the load)."""
    merged: dict[str, tuple[str, dict[str, Any]]] = {}
    for view in views:
        for step, (status, metrics) in view.items():
            if step not in merged or status == "committed":
                merged[step] = (status, metrics)
    return merged
