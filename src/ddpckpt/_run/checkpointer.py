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
:meth:`latest_step`, :meth:`best`, :meth:`info`, :meth:`resume_step`) is collective: call it
on every rank. The queries only read (no lock, no collective; see :mod:`ddpckpt._run.query`).
See :mod:`ddpckpt._run.rundir` for the directory layout, :mod:`ddpckpt._run.resume` for the
steps of :meth:`resume` and :mod:`ddpckpt._run.saving` for those of a save.

To load from a run another job is writing (an evaluation job), open it read-only::

    reader = ddpckpt.Checkpointer("runs/exp1", model=model, read_only=True)
    info = reader.resume()                     # or resume(step=N), or resume(best="loss")
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpckpt import events
from ddpckpt._coord.comm import Comm
from ddpckpt._deprecation import renamed_argument
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.load import load
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._io.writing import header_fields
from ddpckpt._log import get_logger
from ddpckpt._resumecheck import isolate
from ddpckpt._resumecheck import record as _resume_check
from ddpckpt._run import query
from ddpckpt._run.options import resolve
from ddpckpt._run.preemption import Preemption, PreemptionWatch
from ddpckpt._run.resume import READER_LISTINGS, list_candidates, load_first, nothing_loads
from ddpckpt._run.rundir import checkpoint_path
from ddpckpt._run.saving import RunSaves
from ddpckpt._state.capture import Snapshot, capture
from ddpckpt._state.training_state import ROLES, TrainingState
from ddpckpt.errors import CheckpointError
from ddpckpt.policies import Retention, SavePolicy
from ddpckpt.storage import configure

_log = get_logger(__name__)


class Checkpointer:
    """Saves a run's checkpoints under ``directory`` and resumes from the newest good one.

    Objects: a :class:`~ddpckpt.TrainingState` as ``state``, or its shorthand ``model``
    (plain, DDP or compiled), ``optimizer``, ``scheduler``, ``scaler``, ``extra``, ``rng``
    (as for :func:`ddpckpt.save`).

    Options (keyword arguments, grouped and checked by :mod:`ddpckpt._run.options`, read
    back as :attr:`options`): when to save (``every_steps``, ``every_seconds``,
    ``save_policy``, ``preemption``), what to keep (``keep_last``, ``keep_best``, ``monitor``,
    ``mode``, ``retention``), failures (``on_error``, ``retries``, ``retry_backoff``),
    ``async_save``, and storage (``sharing``, ``timeout``, ``lock_stale_after``,
    ``read_only``). A failed save logs an ERROR naming the newest good checkpoint (see
    :attr:`last_error`, :attr:`failed_saves`).

    Read-only: with ``read_only=True`` the Checkpointer only loads. :meth:`resume` then
    takes no lock, cleans nothing, moves nothing aside and writes nothing (``latest``,
    ``run.json``), so it is safe to use while another job trains into ``directory``;
    :meth:`save` raises.

    Preemption: with ``preemption=True`` (or a :class:`~ddpckpt._run.preemption.Preemption`), a
    SIGTERM or SIGUSR1 on any rank makes :meth:`should_save` return True at the same step on
    every rank; that save is synchronous, then :attr:`preempted` is True and the loop should
    stop and exit with :attr:`exit_code` (see :mod:`ddpckpt._run.preemption`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        state: TrainingState | None = None,
        *,
        model: nn.Module | None = None,
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
        rng: bool | None = None,
        async_save: bool | str = False,
        sharing: str | None = None,
        timeout: float | None = None,
        lock_stale_after: float = 600.0,
        read_only: bool = False,
        preemption: bool | Preemption = False,
        storage_options: Mapping[str, Any] | None = None,
        storage: str | None = None,
    ) -> None:
        sharing = renamed_argument("Checkpointer", "storage", storage, "sharing", sharing)
        configure(directory, storage_options)  # an s3:// URL's client (ddpckpt.storage)
        self.state = TrainingState.coerce(
            state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            extra=extra, rng=rng,
        )  # fmt: skip
        self.options = resolve(
            state=self.state,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            every_steps=every_steps,
            every_seconds=every_seconds,
            save_policy=save_policy,
            retention=retention,
            on_error=on_error,
            retries=retries,
            retry_backoff=retry_backoff,
            async_save=async_save,
            sharing=sharing,
            timeout=timeout,
            lock_stale_after=lock_stale_after,
            read_only=read_only,
            preemption=preemption,
        )
        self.read_only = read_only
        self.directory = (  # under ddpckpt check-resume: its own directory
            isolate.for_read(directory, "Checkpointer(read_only=True)", directory=True)
            if read_only
            else isolate.for_write(directory, "Checkpointer", directory=True)
        )
        first = {role: next(iter(getattr(self.state, role).values()), None) for role in ROLES}
        self.model, self.optimizer = first["models"], first["optimizers"]
        self.scheduler, self.scaler = first["schedulers"], first["scalers"]
        self.extra, self.rng = self.state.extra, self.state.rng
        self._saver = AsyncSaver()  # this run's own host buffer and background writer
        self._saves = RunSaves(self.directory, self.options, self._saver)
        self._reserved = False  # whether the buffer was sized ahead of the first save
        self._closed = False
        watched = self.options.schedule.preemption
        self._preemption = None if watched is None else PreemptionWatch(watched, self._saves.newest)
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
        self._saves.settle()
        mode = mode or self.options.keeping.mode
        failed: list[int] = []
        failures: list[str] = []
        # A reader whose candidates were all deleted meanwhile lists the directory again.
        for listing in range(READER_LISTINGS if self.read_only else 1):
            with self._saves.comm("Checkpointer.resume") as comm:
                if not self.read_only and listing == 0:
                    self._saves.prepare(comm)
                committed, broken = list_candidates(comm, self.directory)
            candidates = query.choose(self.directory, committed, step, best, mode)
            candidates = [c for c in candidates if c not in failed]
            if not candidates and not broken and not failed:
                _log.info("%s: no checkpoint to resume from; starting fresh", self.directory)
                return self._resumed(None)
            loaded = load_first(
                candidates, self._load, self.directory, self.read_only, failed, failures
            )
            if loaded is not None:
                if not self.read_only:
                    self._saves.resumed(loaded[0], committed, broken, failed)
                return self._resumed(loaded[1])
            if not candidates:
                break
        raise nothing_loads(self.directory, failures, broken)

    def _load(self, step: int) -> CheckpointInfo:
        """Restore checkpoint ``step`` into the objects; collective."""
        path, timeout = checkpoint_path(self.directory, step), self.options.storage.timeout
        return load(path, state=self.state, timeout=timeout)

    def should_save(self, step: int) -> bool:
        """Whether the policy asks for a save at ``step``; identical on every rank.

        When the policy reads the clock (``every_seconds``) rank 0's answer is used on
        every rank: rank 0 publishes it in one store key that the other ranks wait for, so
        every rank must call this at the same steps. The same holds with ``preemption``:
        then rank 0 also answers True, on every rank, at the first step after a signal on
        any rank (see :mod:`ddpckpt._run.preemption`).
        """
        if (recorder := _resume_check.active()) is not None:
            recorder.step(self, step)
        watch = self._preemption
        latest = self._saves.latest  # with preemption on, a signal can still finish this save
        if latest is not None and (step < latest or (step == latest and watch is None)):
            return False
        if watch is not None:
            watch.announce()

        def decide() -> bytes:  # on rank 0 only when the ranks must agree
            preempt = watch.requested() if watch is not None else None
            if preempt is not None:
                return preempt
            if self._saves.latest is not None and step <= self._saves.latest:
                return b"0"
            due = self.options.schedule.policy.should_save(step, time.monotonic())
            return b"1" if due else b"0"

        if self.options.schedule.policy.needs_agreement or watch is not None:
            decision = Comm.from_leader(
                "Checkpointer.should_save", decide, timeout=self.options.storage.timeout
            )
        else:
            decision = decide()
        if decision[:1] == b"P" and watch is not None:
            watch.agree(step, decision)
            if step == self._saves.latest:  # the newest save holds it: finish it, no new one
                watch.run_save(self._saves.flush)
                return False
            return True
        if decision != b"1":
            self._reserve_staging()
        return decision == b"1"

    def _reserve_staging(self) -> None:
        """Once the layout is known, allocate the async saves' host buffer on a helper
        thread, so the first save does not stall on it (pinning is about 0.5 s per GB)."""
        if not self.options.asynchronous.enabled or self._reserved or self._saves.domains is None:
            return
        self._reserved = True
        if self._saver.latest is not None:
            return  # a save already sized the buffer, and may still be copying into it
        try:
            snapshot = capture(self.state)
        except Exception as exc:  # the save itself raises it; nothing to size until then
            _log.debug("%s: not sizing the staging buffer ahead: %r", self.directory, exc)
            return
        self._saves.reserve(snapshot)

    @events.timed_save
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
        path = self._saves.save(
            step, header_fields(step, epoch, metrics), lambda: self._capture(), synchronous
        )
        if path is not None and (recorder := _resume_check.active()) is not None:
            recorder.saved(self, step, epoch)
        return path

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
    def last_error(self) -> CheckpointError | None:
        """The error of the most recent failed save (a :class:`CheckpointWriteError`, or a
        :class:`CheckpointLockedError` once this job lost the run's lock); ``None`` once a
        save succeeds."""
        return self._saves.failures.last_error

    @property
    def failed_saves(self) -> int:
        """How many saves failed since the last one that succeeded."""
        return self._saves.failures.failed_saves

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
        """The steps of the committed checkpoints, oldest first (see :mod:`ddpckpt._run.query`)."""
        return query.steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``; local and read-only."""
        return query.latest_step(self.directory)

    def best(self, metric: str, mode: str | None = None) -> int | None:
        """The committed step with the best finite ``metric`` (``mode`` ``"min"`` or
        ``"max"``, by default the Checkpointer's), or ``None``; local and read-only."""
        return query.best_step(self.directory, metric, mode or self.options.keeping.mode)

    def info(self, step: int) -> CheckpointInfo:
        """The metadata of checkpoint ``step`` without loading it; local and read-only.
        Raises :class:`CheckpointNotFoundError` or :class:`CorruptCheckpointError`."""
        return query.info(self.directory, step)

    def resume_step(
        self, step: int | None = None, *, best: str | None = None, mode: str | None = None
    ) -> int | None:
        """The checkpoint :meth:`resume` with these arguments would load first (it falls
        back to the next if the data does not verify), or ``None``; local and read-only."""
        return query.resume_step(self.directory, step, best, mode or self.options.keeping.mode)

    def wait(self) -> None:
        """Block until every save started so far is durable; local.

        A background save that failed is then reported like a synchronous one: raised
        with ``on_error="raise"``, logged with ``"warn"``. Being local, it decides nothing
        for the other ranks: the next :meth:`save` or :meth:`resume` handles the failure on
        every rank alike (with ``"raise"`` it raises there too).
        """
        self._saves.report_locally()

    def close(self) -> None:
        """Wait for saves in flight, free the asynchronous saves' host buffer and release
        the directory's lock. Idempotent; local."""
        if self._closed:
            return
        self._closed = True
        try:
            self._saves.close()
        finally:
            if self._preemption is not None:  # last: it may re-deliver a signal
                self._preemption.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer({self.directory!r}) is closed")

    def _capture(self) -> Snapshot:
        return capture(self.state)
