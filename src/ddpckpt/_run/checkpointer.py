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
on every rank. The queries only read (no lock, no collective; see
:mod:`ddpckpt._run.checkpointer_queries`), as do the properties of this process's saves
(:mod:`ddpckpt._run.checkpointer_status`); :mod:`ddpckpt._run.gate` decides which tiers a
save writes.
See :mod:`ddpckpt._run.rundir` for the directory layout, :mod:`ddpckpt._run.resume` for the
steps of :meth:`resume` and :mod:`ddpckpt._run.saving` for those of a save.

To load from a run another job is writing (an evaluation job), open it read-only::

    reader = ddpckpt.Checkpointer("runs/exp1", model=model, read_only=True)
    info = reader.resume()                     # or resume(step=N), or resume(best="loss")
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpckpt import _observe, events
from ddpckpt._deprecation import renamed_argument
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.load import load_from
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._io.writing import header_fields
from ddpckpt._log import get_logger
from ddpckpt._observe import (
    Access,
    CheckpointerOpened,
    CheckpointerResumed,
    CheckpointerSaved,
    LossLogged,
    StepEnded,
)
from ddpckpt._run import query
from ddpckpt._run.checkpointer_queries import RunQueries
from ddpckpt._run.checkpointer_status import RunStatus
from ddpckpt._run.durable import DurableSaves
from ddpckpt._run.fast_tier import FastSaves
from ddpckpt._run.gate import SaveGate
from ddpckpt._run.options import Arguments, FastTier, resolve
from ddpckpt._run.preemption import Preemption, PreemptionWatch
from ddpckpt._run.resume import resume_run
from ddpckpt._run.rundir import checkpoint_path
from ddpckpt._run.tier import Resuming
from ddpckpt._state.capture import Snapshot, capture
from ddpckpt._state.training_state import ROLES, TrainingState
from ddpckpt.policies import Retention, SavePolicy
from ddpckpt.storage._location import Location, locate
from ddpckpt.storage._registry import configure

_log = get_logger(__name__)


class Checkpointer(RunQueries, RunStatus):
    """Saves a run's checkpoints under ``directory`` and resumes from the newest good one.

    Every rank constructs it with the same arguments, then calls the collective methods
    in the same order: :meth:`resume` once before training, :meth:`should_save` and
    :meth:`save` at the same steps, :meth:`close` at the end (it is also a context
    manager). The first of :meth:`resume` and :meth:`save` takes the run directory's lock
    (not with ``read_only``) and raises :class:`~ddpckpt.errors.CheckpointLockedError`
    if another live job holds it.
    A failed save logs an ERROR naming the newest good checkpoint (see
    :attr:`last_error`, :attr:`failed_saves`) while training goes on, unless
    ``on_error="raise"``.

    Args:
        directory: The run directory (or URL); checkpoints are ``step-N`` inside it.
        state: The objects to save, as a :class:`~ddpckpt.TrainingState`.
        model: Keyword shorthand of ``state`` (plain, DDP or compiled), as for
            :func:`ddpckpt.save`; so are ``optimizer``, ``scheduler``, ``scaler``,
            ``extra`` and ``rng``.
        optimizer: See ``model``.
        scheduler: See ``model``.
        scaler: See ``model``.
        extra: See ``model``.
        keep_last: Keep the newest this many checkpoints (``None`` keeps all). The newest
            is always kept; others are deleted only after a newer one is committed.
        keep_best: Also keep this many best by ``monitor``.
        monitor: The metric ``keep_best`` ranks by (passed to :meth:`save`).
        mode: ``"min"`` or ``"max"``: the better direction of ``monitor``; also the
            default of ``resume(best=...)`` and :meth:`best`.
        every_steps: Save when ``step`` is a multiple of this.
        every_seconds: Save when this long has passed since the last save (rank 0's
            clock decides for every rank).
        save_policy: A :class:`~ddpckpt.policies.SavePolicy` instead of ``every_steps``
            and ``every_seconds``.
        retention: A :class:`~ddpckpt.policies.Retention` instead of ``keep_last``,
            ``keep_best`` and ``monitor``.
        on_error: What a save that fails in storage does once retried: ``"warn"``
            (default: log an ERROR on stderr, training goes on) or ``"raise"`` (on every
            rank). A value that cannot be stored, or ranks holding different state,
            always raise.
        retries: How many times a transient storage failure is retried.
        retry_backoff: Seconds before the first retry, doubling after each.
        rng: See ``model``.
        async_save: ``True`` or ``"overlap"``: saves finish in the background, as for
            :func:`ddpckpt.save` (``"overlap"`` needs an optimizer).
        sharing: ``"auto"`` (default), ``"shared"`` or ``"local"``: whether the machines
            share ``directory``'s storage.
        timeout: Seconds a rank waits for a silent one, in every collective.
        lock_stale_after: Seconds after which a lock whose holder stopped refreshing it
            may be taken over.
        read_only: Only load: :meth:`resume` takes no lock, cleans nothing, moves
            nothing aside and writes nothing (``latest``, ``run.json``), so it is safe
            while another job trains into ``directory``; :meth:`save` raises.
        preemption: ``True`` (or a :class:`~ddpckpt.Preemption`): a SIGTERM or SIGUSR1 on
            any rank makes :meth:`should_save` return True at the same step on every rank;
            that save is synchronous, then :attr:`preempted` is True and the loop should
            stop and exit with :attr:`exit_code`.
        storage_options: Configures an ``s3://`` URL's client (endpoint, region,
            credentials: :meth:`S3Storage.from_options <ddpckpt.storage.s3.S3Storage.from_options>`).
        fast_tier: A directory in each node's memory (such as ``"/dev/shm/<job>"``),
            ``"auto"`` (one named for this user and run directory under ``/dev/shm``: the
            same at every launch of the job; see :attr:`fast_tier_directory`) or a
            :class:`~ddpckpt.FastTier`: every :meth:`save` also writes there,
            :meth:`should_save` says True at every ``FastTier.every_steps``-th step for it,
            and :meth:`resume` restores the newest step either tier holds, so a crash loses
            at most the steps since the last fast save. The directory is this user's alone
            (created ``0700``, files ``0600``); one that is a symbolic link, another user's,
            writable by others, or no fast tier (another run's directory) is refused with an
            ERROR and never read, written or deleted. A fast save never raises its failure
            (an ERROR; training goes on), nor does a fast tier :meth:`resume` cannot set up
            (it resumes from the durable tier).
        storage: Deprecated spelling of ``sharing`` (warns; may be removed after
            2027-06-01).

    Raises:
        ValueError: An option it cannot honour, or a bad combination (names the argument;
            a wrong type is a ``TypeError``). Checked before anything is touched.
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
        fast_tier: str | os.PathLike[str] | FastTier | None = None,
    ) -> None:
        sharing = renamed_argument("Checkpointer", "storage", storage, "sharing", sharing)
        configure(directory, storage_options)  # an s3:// URL's client (ddpckpt.storage)
        self.state = TrainingState.coerce(
            state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            extra=extra, rng=rng,
        )  # fmt: skip
        self.options = resolve(
            Arguments.of(locals()), state=self.state, directory=os.fspath(directory)
        )
        self.read_only = read_only
        self.directory = (  # under ddpckpt check-resume: its own directory
            _observe.place(directory, "Checkpointer(read_only=True)", Access.READ_RUN)
            if read_only
            else _observe.place(directory, "Checkpointer", Access.WRITE_RUN)
        )
        self._location = locate(self.directory)
        first = {role: next(iter(getattr(self.state, role).values()), None) for role in ROLES}
        self.model, self.optimizer = first["models"], first["optimizers"]
        self.scheduler, self.scaler = first["schedulers"], first["scalers"]
        self.extra, self.rng = self.state.extra, self.state.rng
        fast = self.options.fast_tier
        self._saver = AsyncSaver(lends=fast is not None)  # the durable tier's buffer, writer
        self._durable = DurableSaves(self._location, self.options, self._saver, read_only)
        self._saves = self._durable.saves
        place = lambda path: _observe.place(path, "Checkpointer(fast_tier=...)", Access.WRITE_RUN)  # noqa: E731
        self._fast = None if fast is None else FastSaves(
            None if fast.directory is None else place(fast.directory),
            fast, self.options, overlap=bool(self.state.optimizers), run=self._location,
            place=place,
        )  # fmt: skip
        self._closed = False
        watched = self.options.schedule.preemption
        self._preemption = None if watched is None else PreemptionWatch(watched, self._saves.newest)
        self._gate = SaveGate(self.state, self.options, self._durable, self._fast, self._preemption)
        # the tiers as peers, durable first: it wins a tie at resume and lends its copies
        self._tiers = self._gate.all
        _observe.tell(CheckpointerOpened(self))

    # ------------------------------------------------------------------ public

    def resume(
        self, step: int | None = None, *, best: str | None = None, mode: str | None = None
    ) -> CheckpointInfo | None:
        """Restore the newest committed checkpoint that loads and verifies; collective.

        Every rank calls it once, before training. A newer checkpoint that is corrupt or
        incomplete is reported (naming the file), moved aside as ``step-N.corrupt-*`` and
        skipped, also when the damage was found while its tensors were read into the
        objects (the next checkpoint loaded restores every one of them again; a WARNING
        names the step loaded instead). Later saves must still be newer than the newest
        checkpoint.

        Read-only (``read_only=True``): nothing is moved aside or written, and a checkpoint
        that disappears or changes while it is loaded (the writing job's retention deleted it)
        is reported and the next candidate is loaded.

        Args:
            step: Restore exactly this checkpoint.
            best: Restore the best checkpoint by this metric instead of the newest, falling
                back to the next best.
            mode: ``"min"`` or ``"max"`` for ``best`` (by default the Checkpointer's).

        Returns:
            The loaded checkpoint's metadata, or ``None`` when the directory holds no
            checkpoint (a fresh run).

        Raises:
            CorruptCheckpointError: Checkpoints exist but none loads (lists why each failed).
            PartiallyRestoredError: None loads, and a load that failed had begun writing
                into the objects: they must not be trained on, and saving them is refused
                until a load into them succeeds.
            CheckpointLockedError: Another live job holds the run directory's lock.
            StateMismatchError: The objects do not match the checkpoint (as :func:`ddpckpt.load`).
            ValueError: Both ``step`` and ``best`` were given, or the run directory is a
                file (or under one).
        """
        self._check_open()
        if step is not None and best is not None:
            raise ValueError("pass step= or best=, not both")
        for tier in self._tiers:
            tier.settle()
        mode = mode or self.options.keeping.mode
        resuming = Resuming(
            load=self._load,
            choose=lambda committed: query.choose(self.directory, committed, step, best, mode),
            newest=step is None and best is None,
        )
        info = resume_run(self._tiers, resuming, self.directory, self.read_only)
        return self._resumed(info)

    def _load(self, step: int | Location) -> CheckpointInfo:
        """Restore checkpoint ``step`` (or the one at a location: the fast tier's) into the
        objects; collective."""
        at = step if isinstance(step, Location) else checkpoint_path(self._location, step)
        return load_from(at, self.state, timeout=self.options.storage.timeout)

    def should_save(self, step: int) -> bool:
        """Whether the policy asks for a save at ``step``; the same answer on every rank.

        Every rank calls it at the same steps. When the policy reads the clock
        (``every_seconds``) rank 0's answer is used on every rank: rank 0 publishes it in one
        store key that the other ranks wait for. The same holds with ``preemption``: then
        rank 0 also answers True, on every rank, at the first step after a signal on any rank.
        With a fast tier it is also True at its steps (``FastTier.every_steps``); the
        :meth:`save` that follows then writes the fast tier alone unless the durable
        schedule is due as well.

        Args:
            step: The training step about to be saved (the argument :meth:`save` gets).

        Returns:
            ``True`` when :meth:`save` should be called at this step.
        """
        _observe.tell(StepEnded(self, step))
        return self._gate.due(step)

    @events.timed_save
    def save(
        self, step: int, epoch: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> str | None:
        """Save the objects as checkpoint ``step``; collective.

        Every rank calls it with the same arguments. Synchronous saves return once the
        checkpoint is durable; asynchronous ones once the state is copied (:meth:`wait` blocks
        until durable). Saving the newest step again (an every-N-steps save and an epoch-end
        save on the same step) replaces it atomically with the state as of this call. After
        :meth:`should_save` agreed on a preemption, this save is synchronous and
        :attr:`preempted` is True once it returns (or raises).

        With a fast tier, every save but a preemption's also starts one there (whose
        failure, a refused directory or another job's lock on it included, is logged as an
        ERROR, never raised); a save :meth:`should_save` asked for the fast tier alone
        writes only there and returns that path (``None`` if it failed).

        Args:
            step: The training step; checkpoint ``step-N`` of the run directory.
            epoch: Recorded in the manifest.
            metrics: Scalars recorded in the manifest (what ``keep_best`` and
                ``resume(best=...)`` rank by).

        Returns:
            The checkpoint's path, or ``None`` if storage failed and ``on_error="warn"`` (see
            :attr:`last_error`).

        Raises:
            CheckpointStepError: ``step`` is older than the newest checkpoint.
            CheckpointWriteError: Storage failed and ``on_error="raise"``.
            UnsupportedValueError: A value cannot be stored without pickle (always raised).
            ValueError: The run directory is a file, or under one (always raised).
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
        header = header_fields(step, epoch, metrics)
        tiers = self._gate.tiers(step, synchronous)
        capture = _once(self._capture) if len(tiers) > 1 else self._capture  # one snapshot
        paths, lender = [], None
        for tier in tiers:
            path = tier.save(step, dict(header), capture, synchronous, lender)
            if tier is self._durable and path is not None:
                _observe.tell(CheckpointerSaved(self, step, epoch))
            lender = lender or tier.saves.saver  # its copies, if it staged any
            paths.append(path)
        return paths[0]  # the durable tier's, unless should_save asked for the fast tier alone

    def log_step(self, loss: Any) -> None:
        """Report this step's loss to ``ddpckpt check-resume``, which compares it between
        the uninterrupted and the resumed run; local (each rank reports its own, once per
        step). Outside a check it does nothing and costs nothing.

        Args:
            loss: A number or a tensor (a tensor of several losses too); a tensor is
                read only under a check.
        """
        _observe.tell(LossLogged(loss))

    def _resumed(self, info: CheckpointInfo | None) -> CheckpointInfo | None:
        _observe.tell(CheckpointerResumed(self, info))
        return info

    def wait(self) -> None:
        """Block until every save started so far (fast tier included) is durable; local.

        A background save that failed is then reported like a synchronous one: raised
        with ``on_error="raise"``, logged as an ERROR with ``"warn"``. Being local, it
        decides nothing for the other ranks: the next :meth:`save` or :meth:`resume`
        handles the failure on every rank alike (with ``"raise"`` it raises there too).

        Raises:
            CheckpointWriteError: With ``on_error="raise"``, a background save failed.
        """
        for tier in self._tiers:
            tier.report_locally()

    def close(self) -> None:
        """Wait for saves in flight, free the asynchronous saves' host buffer and release the
        directory's lock; local and idempotent.

        The one call that ends a Checkpointer (leaving its ``with`` block calls it);
        :func:`ddpckpt.release_async_buffers` is for plain :func:`ddpckpt.save` calls only.
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.ExitStack() as closing:  # each closed, whatever the others raise
            if self._preemption is not None:  # last: it may re-deliver a signal
                closing.callback(self._preemption.close)
            for tier in reversed(self._tiers):  # in order, as callbacks run last first
                closing.callback(tier.close)

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


def _once(make: Callable[[], Snapshot]) -> Callable[[], Snapshot]:
    """``make``, called at most once: the durable and fast tiers save one snapshot."""
    made: list[Snapshot] = []

    def once() -> Snapshot:
        if not made:
            made.append(make())
        return made[0]

    return once
