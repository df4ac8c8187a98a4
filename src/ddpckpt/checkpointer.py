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

Every method except :meth:`wait` and :meth:`close` is collective: call it on every rank.
See :mod:`ddpckpt.rundir` for the directory layout.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch
from torch import nn

from ._log import get_logger
from .background import Persister
from .checkpoint import CheckpointInfo, async_mode, load, start_background
from .comm import Comm
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStepError,
    CheckpointWriteError,
    CorruptCheckpointError,
    InsufficientSpaceError,
)
from .policies import (
    AnyOf,
    EverySeconds,
    EverySteps,
    KeepAll,
    KeepBest,
    KeepLast,
    Record,
    Retention,
    SavePolicy,
    Union,
)
from .rundir import (
    clean_temporaries,
    read_latest,
    remove_checkpoint,
    scan,
    step_dirname,
    write_latest,
    write_run_file,
)
from .runlock import RunLock
from .staging import StagingPool
from .state import Snapshot, capture
from .storage import new_token
from .topology import storage_domains
from .writing import (
    WritePlan,
    header_fields,
    plan_write,
    staging_share,
    storage_errors,
    write_and_commit,
)

__all__ = ["Checkpointer"]

T = TypeVar("T")
_log = get_logger(__name__)
# Storage errors worth retrying: a network file system's hiccups, not a full or read-only disk.
_TRANSIENT = {
    errno.EIO,
    errno.EAGAIN,
    errno.EINTR,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.ECONNRESET,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
}


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
    ``on_error="warn"`` (the default), logged on every rank while training goes on; with
    ``"raise"`` it raises on every rank. Programming errors (a value that cannot be
    stored, ranks holding different state) always raise.
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
    ) -> None:
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        if type(retries) is not int or retries < 0:
            raise ValueError(f"retries must be a non-negative int, got {retries!r}")
        if monitor is not None and keep_best is None and retention is None:
            raise ValueError("monitor= only matters with keep_best=; pass keep_best=K as well")
        self.directory = os.fspath(directory)
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.extra = extra
        self.save_policy = save_policy or _save_policy(every_steps, every_seconds)
        self.retention = retention or _retention(keep_last, keep_best, monitor, mode)
        self.on_error, self.retries, self.retry_backoff = on_error, retries, retry_backoff
        self.rng, self.storage, self.timeout = rng, storage, timeout
        self.overlap = async_mode(async_save, optimizer)
        self.async_save = bool(async_save)
        self._pool = StagingPool()
        self._reserved = False  # whether the pool was sized ahead of the first save
        self._persister = Persister()
        self._committed: int | None = None  # newest step known to be committed
        self._lock = RunLock(self.directory, lock_stale_after)
        self._domains: list[list[int]] | None = None
        self._leader = False
        self._latest: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ public

    def resume(self, step: int | None = None) -> CheckpointInfo | None:
        """Restore the newest committed checkpoint that loads and verifies; collective.

        A newer checkpoint that is corrupt or incomplete is reported (naming the file),
        moved aside as ``step-N.corrupt-*`` and skipped. Returns ``None`` when the
        directory holds no checkpoint; raises if checkpoints exist but none can be
        loaded. With ``step``, restores exactly that checkpoint.
        """
        self._check_open()
        self._settle()
        with self._comm("Checkpointer.resume") as comm:
            self._prepare(comm)
            views = comm.run_all(
                "list", lambda: {str(e.step): e.status for e in scan(self.directory)}
            )
        committed = sorted(
            {int(s) for v in views for s, status in v.items() if status == "committed"},
            reverse=True,
        )
        every = list(committed)
        broken = sorted({int(s) for v in views for s, status in v.items() if status != "committed"})
        if step is not None:
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"{self._path(step)}: no committed checkpoint for step {step}"
                )
            committed = [step]
        if not committed and not broken:
            _log.info("%s: no checkpoint to resume from; starting fresh", self.directory)
            return None
        failures = []
        for candidate in committed:
            try:
                info = load(
                    self._path(candidate),
                    model=self.model,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    scaler=self.scaler,
                    extra=self.extra,
                    rng=self.rng,
                    timeout=self.timeout,
                )
            except CorruptCheckpointError as exc:
                _log.warning(
                    "cannot resume from %s: %s; trying an older checkpoint",
                    self._path(candidate),
                    exc,
                )
                failures.append(f"{self._path(candidate)}: {exc}")
                broken.append(candidate)
                continue
            moved = [b for b in broken if b > candidate]
            self._after_resume(candidate, moved, max(c for c in every if c not in moved))
            return info
        raise CorruptCheckpointError(
            f"{self.directory}: holds checkpoints but none can be loaded:\n  "
            + "\n  ".join(failures)
            if failures
            else f"{self.directory}: holds only incomplete checkpoints ({broken}); nothing to resume"
        )

    def should_save(self, step: int) -> bool:
        """Whether the policy asks for a save at ``step``; identical on every rank.

        Collective only when the policy reads the clock (``every_seconds``).
        """
        if self._latest is not None and step <= self._latest:
            return False
        decision = self.save_policy.should_save(step, time.monotonic())
        if self.save_policy.needs_agreement:
            with self._comm("Checkpointer.should_save") as comm:
                decision = comm.broadcast("decision", b"1" if decision else b"0") == b"1"
        if not decision:
            self._reserve_staging()
        return decision

    def _reserve_staging(self) -> None:
        """Once the layout is known, allocate the async saves' host buffer on a helper
        thread, so the first save does not stall on it (pinning is about 0.5 s per GB)."""
        if not self.async_save or self._reserved or self._domains is None:
            return
        self._reserved = True
        try:
            snapshot = capture(
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                extra=self.extra,
                rng=False,
            )
        except CheckpointError as exc:  # the save itself reports it; nothing to size then
            _log.debug("%s: not sizing the staging buffer ahead: %s", self.directory, exc)
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        self._pool.reserve(staging_share(snapshot, self._domains, rank))

    def save(
        self, step: int, epoch: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> str | None:
        """Save the objects as checkpoint ``step``; collective. Returns its path.

        Synchronous saves return once the checkpoint is durable; asynchronous ones once the
        state is copied (:meth:`wait` blocks until durable). Raises
        :class:`CheckpointExistsError` if ``step`` is already saved and
        :class:`CheckpointStepError` if it is older than the newest checkpoint. Returns
        ``None`` if storage failed and ``on_error="warn"``.
        """
        self._check_open()
        self._settle()
        header = header_fields(step, epoch, metrics)
        if self._domains is None:
            try:
                with self._comm("Checkpointer.prepare") as comm:
                    self._prepare(comm)
            except CheckpointWriteError as exc:
                self._failed(step, exc)
                return None
        if self._latest is not None and step <= self._latest:
            if step == self._latest:
                raise CheckpointExistsError(f"{self._path(step)}: step {step} is already saved")
            raise CheckpointStepError(
                f"{self.directory}: cannot save step {step}: the newest checkpoint is step "
                f"{self._latest}. Steps must grow; after going back to an older checkpoint, "
                "delete the newer ones or use a new directory"
            )
        comm = self._comm("Checkpointer.save", self._path(step))
        handed_off = False
        try:
            snapshot = comm.run("capture", self._capture)
            plan = plan_write(comm, snapshot, header, storage=self.storage, domains=self._domains)
            if self.async_save:
                start_background(
                    plan,
                    snapshot,
                    pool=self._pool,
                    persister=self._persister,
                    overlap=self.overlap,
                    optimizer=self.optimizer,
                    persist=self._persist,
                )
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
        return plan.path

    def wait(self) -> None:
        """Block until every save started so far is durable; local.

        A background save that failed is then reported like a synchronous one: raised
        with ``on_error="raise"``, logged with ``"warn"``.
        """
        self._settle()

    def close(self) -> None:
        """Wait for saves in flight, free the asynchronous saves' host buffer and release
        the directory's lock. Idempotent; local."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
        finally:
            self._pool.release()
            self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _comm(self, call: str, path: str | None = None) -> Comm:
        return Comm.open(call, path=path or self.directory, timeout=self.timeout)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, step_dirname(step))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer({self.directory!r}) is closed")

    def _prepare(self, comm: Comm) -> None:
        """Find the storage domains, take the lock, clear leftovers, learn the newest step."""
        self._domains = storage_domains(comm, self.directory, self.storage)
        self._leader = any(d[0] == comm.rank for d in self._domains)

        def setup() -> list[int]:
            if self._leader:
                self._lock.acquire()
                for name in clean_temporaries(self.directory):
                    _log.info(
                        "%s: removed %s, left by an interrupted save or deletion",
                        self.directory,
                        name,
                    )
                write_run_file(self.directory, {"retention": self.retention.describe()})
            return [e.step for e in scan(self.directory) if e.status == "committed"]

        steps = [
            s for listing in comm.run_all("setup", lambda: self._storage(setup)) for s in listing
        ]
        self._latest = self._committed = max(steps, default=None)

    def _capture(self) -> Snapshot:
        self._lock.check()  # never write into a directory another job has taken over
        return capture(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            extra=self.extra,
            rng=self.rng,
        )

    def _persist(self, plan: WritePlan) -> None:
        """Write and commit ``plan`` (retrying transient storage errors), then retention.

        Runs on the training thread, or on the background thread for async saves.
        """
        for attempt in range(self.retries + 1):
            try:
                write_and_commit(plan, attempt)
                break
            except CheckpointWriteError as exc:
                transient = exc.errno in _TRANSIENT and not isinstance(exc, InsufficientSpaceError)
                if not transient or attempt == self.retries:
                    raise
                delay = self.retry_backoff * 2**attempt
                _log.warning("saving %s failed (%s); retrying in %.1f s", plan.path, exc, delay)
                time.sleep(delay)
        self._committed = plan.header["step"]
        try:
            plan.comm.run("retain", lambda: self._storage(lambda: self._after_commit(plan.path)))
        except CheckpointError as exc:  # committed all the same
            _log.warning(
                "%s is saved, but updating 'latest' or deleting old checkpoints failed: %s",
                plan.path,
                exc,
            )

    def _storage(self, step: Callable[[], T]) -> T:
        """Run ``step`` reporting file-system failures as :class:`CheckpointWriteError`."""
        with storage_errors(self.directory):
            return step()

    def _settle(self) -> None:
        """Wait for the background save, and handle its failure as a synchronous one."""
        try:
            self._persister.wait()
        except CheckpointWriteError as exc:
            self._failed(self._latest, exc)

    def _failed(self, step: int | None, exc: CheckpointWriteError) -> None:
        self._latest = self._committed
        if self.on_error == "raise":
            raise exc
        _log.warning(
            "saving step %s failed and training goes on (on_error='warn'); the newest "
            "checkpoint is still %s. Cause: %s",
            step,
            self._path(self._committed) if self._committed is not None else "none",
            exc,
        )

    def _after_commit(self, path: str) -> None:
        if not self._leader:
            return
        write_latest(self.directory, os.path.basename(path))
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
                    source = self._path(broken)
                    if os.path.exists(source):
                        target = f"{source}.corrupt-{new_token()}"
                        os.rename(source, target)
                        _log.warning("moved %s aside to %s; it is never loaded", source, target)
                if read_latest(self.directory) != step_dirname(newest):
                    write_latest(self.directory, step_dirname(newest))

            comm.run("tidy", lambda: self._storage(tidy))
        self._latest = self._committed = newest
        self.save_policy.saved(step, time.monotonic())


def _save_policy(every_steps: int | None, every_seconds: float | None) -> SavePolicy:
    policies: list[SavePolicy] = []
    if every_steps is not None:
        policies.append(EverySteps(every_steps))
    if every_seconds is not None:
        policies.append(EverySeconds(every_seconds))
    if not policies:
        return _Never()
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def _retention(
    keep_last: int | None, keep_best: int | None, monitor: str | None, mode: str
) -> Retention:
    parts: list[Retention] = [KeepLast(keep_last) if keep_last is not None else KeepAll()]
    if keep_best is not None:
        if monitor is None:
            raise ValueError("keep_best needs monitor=, the name of a metric passed to save()")
        parts.append(KeepBest(keep_best, monitor, mode))
    return parts[0] if len(parts) == 1 else Union(*parts)


class _Never(SavePolicy):
    """No schedule given: ``should_save`` is always False; call :meth:`Checkpointer.save` yourself."""

    def should_save(self, step: int, now: float) -> bool:
        return False
