"""The fast tier of a :class:`~ddpckpt.Checkpointer`: a checkpoint in every node's host
memory, as often as every step, that a restarted job resumes from.

With ``Checkpointer(..., fast_tier="/dev/shm/<job>")`` (or a
:class:`~ddpckpt._run.options.FastTier`) a Checkpointer keeps two tiers. With
``fast_tier="auto"`` the directory is named at the first set-up, once rank 0 has read or made
the run's identity: :func:`~ddpckpt._run.options.auto_directory`, the same on every node and
at every launch writing the run directory (:meth:`FastSaves._resolve`).

* the **fast tier** (:class:`FastSaves`): a run directory of its own on every node, in
  memory that outlives the worker processes (a tmpfs), written by every ``save()``.
  ``should_save(step)`` says True at every ``FastTier.every_steps``-th step, for the fast
  tier alone unless the durable schedule is due too. Each node keeps a complete copy,
  written as on node-local storage (:mod:`ddpckpt._io.writing`): the replicated state
  (model, optimizer) is split among the node's ranks and written from their own memory,
  never sent between nodes; each rank's own file (RNG streams, data position, state that
  is not replicated) and rank 0's buffers and shared state go to the other nodes point to
  point (:mod:`ddpckpt._io.settling`), so any one node can restore every rank. Saves are
  always asynchronous (``"overlap"`` when an optimizer is saved): the training thread only
  copies its share, and the next fast save waits for the one in flight. The tier keeps
  ``FastTier.keep`` steps. A fast save that fails (a full tmpfs, a refused directory, a
  damaged marker, another job's live lock) is an ERROR on stderr and training goes on,
  whatever ``on_error`` says; the next fast save tries again (:meth:`FastSaves.save`).
* the **durable tier**, the run directory, as without a fast tier: written when its own
  schedule (``every_steps``, ``every_seconds``, preemption) is due, or when ``save()`` is
  called without ``should_save`` having asked for the fast tier alone. Retention,
  ``latest``, the queries and ``export`` only ever see the durable tier.

``Checkpointer.resume()`` (collective) lists both tiers on every rank and tries the steps
newest first, the durable tier first on a tie (:meth:`FastSaves.resume`). A fast-tier step
is taken from the copy most ranks hold; nodes that lack it (a replaced node, a wiped
tmpfs) first receive it from a node that has it, verified against its checksums
(:func:`~ddpckpt._coord.replicate.repair_copies`). A step that cannot be restored on every
rank is reported and the next is tried; a WARNING says when the durable tier serves in
place of a newer fast-tier step, or because no node holds one. Whichever tier served, the
fast tier then keeps nothing newer than the step resumed from (:meth:`FastSaves.keep_up_to`).

Ownership and trust (:meth:`FastSaves._set_up`, before anything is read from the directory
or written there, on every rank): the directory is this user's alone, made ``0700`` with
files ``0600`` (:meth:`~ddpckpt.storage._posix.PosixStorage.make_private_dir`); one that is
a symbolic link, another user's, or writable by its group or others is refused. It must
then be a fast tier: its marker (``owner.json``, :class:`~ddpckpt._format.runfiles.FastTierMarker`)
names the run whose steps it holds; a directory without one is used only if it holds
nothing but ddpckpt's bookkeeping (a lock, temporaries), and one with a durable run's
identity file never. Steps are deleted (with a WARNING) only where a valid marker names
another run; a marker written by the previous release (the bare identity, format 0) is
this run's if it names this run, and is refused otherwise. A refused tier, a damaged
marker among its reasons, is reported as a :class:`~ddpckpt.errors.CheckpointWriteError`
(the tier cannot be written), a damaged run identity as the
:class:`~ddpckpt.errors.CorruptCheckpointError` its parser raised: an ERROR either way, at
``resume()`` (which goes on with the durable tier) or at a fast save.

Collective methods are called by the Checkpointer on every rank at the same points.
"""

from __future__ import annotations

import errno
import os
import platform
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.rankset import RankSet
from ddpckpt._coord.replicate import repair_copies
from ddpckpt._format.runfiles import (
    FAST_TIER_FORMAT,
    FAST_TIER_MARKER,
    LATEST,
    LOCK_NAME,
    RUN_DIR_IDENTITY,
    RUN_FILE,
    FastTierMarker,
    parse_step,
    read_fast_tier_marker,
    read_run_identity,
)
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.load import failure_of, partly_note
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.options import (
    Asynchronous,
    CheckpointerOptions,
    FailureHandling,
    FastTier,
    Keeping,
    Schedule,
    Storage,
    auto_directory,
    nests,
)
from ddpckpt._run.rundir import remove_checkpoint, scan
from ddpckpt._run.saving import RunSaves, run_storage_errors
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStepError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
    PartiallyRestoredError,
    StateMismatchError,
    UnsupportedValueError,
)
from ddpckpt.policies import EverySteps, KeepLast
from ddpckpt.storage import storage_for
from ddpckpt.storage._base import is_temp_name

_log = get_logger(__name__)
_SHARING = "auto"  # each node's memory is its own: probed, whatever $DDPCKPT_STORAGE says
# A fast-tier step failing so is reported, and the next step (or the durable tier) serves.
_CANNOT_SERVE = (CorruptCheckpointError, CheckpointNotFoundError, CheckpointWriteError)
# step: checkpoint id: the ranks whose node holds it, as RankSet spans (constant size for
# whole runs of nodes, whatever the number of ranks)
_Held = dict[str, dict[str, list[list[int]]]]
Loaded = tuple[int, CheckpointInfo]
# Raised whatever the tier: a caller's mistake, or ranks out of step (a fast save that
# swallowed them would only move the failure to the next collective call).
_RAISED = (
    PartiallyRestoredError,  # objects a failed load left half-restored are never saved
    CheckpointStepError,
    UnsupportedValueError,
    StateMismatchError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
)
_MAX_SKIPPED = 255  # fast saves skipped at most between two tries at setting the tier up
_AVOID = (
    "give fast_tier= a directory of this user's own that does not exist yet (it is created "
    "private), or fast_tier='auto' (one named for this user and run), or remove this one"
)


@contextmanager
def _reported(report: Callable[[CheckpointError], None]) -> Iterator[None]:
    """Run the body; a failure of the fast tier is handed to ``report`` (an ERROR) instead
    of raised, so that training goes on. What every save raises (:data:`_RAISED`: a
    caller's mistake, ranks out of step, objects a failed load left half-restored) is
    raised still."""
    try:
        yield
    except CheckpointError as exc:
        if isinstance(exc, _RAISED):
            raise
        report(exc)


def fast_options(
    config: FastTier, durable: CheckpointerOptions, overlap: bool
) -> CheckpointerOptions:
    """The options of the fast tier's saves: every ``config.every_steps`` steps, the
    ``config.keep`` newest, asynchronous, never raising a storage failure, probed storage."""
    storage = durable.storage
    return CheckpointerOptions(
        schedule=Schedule(EverySteps(config.every_steps), None),
        keeping=Keeping(KeepLast(config.keep), durable.keeping.mode),
        failures=FailureHandling("warn", 0, 0.0),  # a full tmpfs is not transient
        asynchronous=Asynchronous(True, overlap and config.overlap),
        storage=Storage(_SHARING, storage.timeout, storage.lock_stale_after, False),
    )


class FastSaves:
    """The fast tier of one Checkpointer on this rank (see the module docstring)."""

    def __init__(
        self,
        directory: str | None,
        config: FastTier,
        durable: CheckpointerOptions,
        overlap: bool,
        run: str,
        place: Callable[[str], str] = lambda path: path,
    ) -> None:
        # None (fast_tier="auto"): named by the run's identity at the first set-up
        # (_resolve); until then messages name the pattern.
        self.auto = directory is None
        self.named = not self.auto  # whether self.directory is the tier's (not the pattern)
        self.directory = directory or auto_directory("<this run's identity>")
        self.run = run  # the durable run directory whose steps this tier holds
        self.every = config.every_steps
        self.saver = AsyncSaver()  # its own host buffer and background writer
        self._options = fast_options(config, durable, overlap)
        self._place = place  # where this process writes a path (check-resume maps it)
        self.saves = self._saves_in(self.directory)
        self._held: _Held = {}  # known once listed, with this job's number of ranks
        self._world = 1
        self._owner = ""  # the durable run's identity, once the tier is set up (see _set_up)
        self._found: FastTierMarker | None = None  # this node's marker, as set-up read it
        self._refused = False  # resume() could not set the tier up (reported)
        self._set_up_failures = 0  # in a row: the next try waits 2**n - 1 fast saves
        self._skip = 0  # fast saves left to skip before the set-up is tried again

    def _saves_in(self, directory: str) -> RunSaves:
        return RunSaves(directory, self._options, self.saver, tier=f"fast tier {directory}")

    def _resolve(self, owner: str) -> None:
        """Collective (every rank alike, after :meth:`_agree_owner`): with ``"auto"``, name
        the directory for the run ``owner`` once, before anything touches it; said at INFO
        (``resume()``'s log names it too). Nothing was written through :attr:`saves` yet:
        every save and listing comes after a set-up."""
        if not self.auto or self.saves.domains is not None:
            return  # named already (a set-up got as far as preparing it)
        directory = self._place(auto_directory(owner))
        if directory != self.directory:
            self.directory, self.saves = directory, self._saves_in(directory)
            _log.info("fast tier of %s (fast_tier='auto'): %s", self.run, directory)
        self.named = True

    @property
    def latest(self) -> int | None:
        """The newest step saved to the fast tier (maybe still in flight)."""
        return self.saves.latest

    def due(self, step: int) -> bool:
        """Local: whether the fast tier's schedule asks for ``step``."""
        latest = self.saves.latest
        return step % self.every == 0 and (latest is None or step > latest)

    def save(
        self,
        step: int,
        header: dict[str, Any],
        capture: Callable[[], Snapshot],
        borrow: AsyncSaver | None = None,
    ) -> str | None:
        """Collective: start saving ``step`` to the fast tier; its path, or ``None`` when the
        save failed (an ERROR; training goes on, whatever failed: a full tmpfs, a refused
        directory, a damaged marker, another job's live lock). ``borrow``: the durable
        tier's saver, when it has just staged the same snapshot (copied once for both
        tiers). A tier not set up yet (a job that did not resume, or whose resume could not
        set it up) is set up first (:meth:`_claim`). Raises only what every save raises: a
        step older than the newest, a value that cannot be stored, ranks out of step. After
        a failed set-up, the next ``2**n - 1`` fast saves are skipped (``n`` failures in a
        row, at most :data:`_MAX_SKIPPED`; said in the ERROR), so that a tier refused for
        good costs, and prints, little."""
        if not self._owner and self._skip > 0:
            self._skip -= 1  # every rank alike: set-up failures reach every rank
            return None
        with _reported(lambda exc: self.saves.failed(step, exc)):
            if self._owner or self._claim(step):
                return self.saves.save(step, header, capture, synchronous=False, borrow=borrow)
        return None

    def _claim(self, step: int) -> bool:
        """Collective, at the first fast save of a job whose ``resume()`` did not set the
        tier up: set it up and mark it as this run's, as a resume does, so that a restarted
        job resumes from it; its steps of another run, and this run's steps newer than
        ``step``, are deleted with a WARNING. False (the save's failure reported) if that
        failed; the next save tries again."""

        def failed(exc: CheckpointError) -> None:
            self._owner = ""
            self._set_up_failures += 1
            self._skip = min(2**self._set_up_failures - 1, _MAX_SKIPPED)
            self.saves.failed(step, exc)
            _log.warning(
                "the fast tier %s is tried again at the fast save after the next %d (fast "
                "saves until then are skipped; the durable tier saves as scheduled)",
                self.directory,
                self._skip,
                extra=same_on_every_rank(exc),
            )

        with _reported(failed):
            with self.saves.comm("Checkpointer.save (fast tier set-up)") as comm:
                self._set_up(comm)
            self._tidy(step, resumed=False)
            self._set_up_failures = 0
            return True
        return False

    def _set_up(self, comm: Comm) -> None:
        """Collective: learn the run's identity (rank 0), check on every rank that its
        node's directory may be used (:meth:`_check_here`: nothing is read from it or
        written there before), then set it up as a run directory (storage domains, each
        node's lock, leftovers) and mark the nodes' new directories as this run's.

        Raises :class:`CheckpointWriteError` (``EACCES``) naming every node's reason if
        any node's directory is refused, :class:`CorruptCheckpointError` if the run's
        identity file is damaged, or what the set-up raises (another job's live lock)."""
        self._owner = ""
        owner = self._agree_owner(comm)
        self._resolve(owner)
        problems = comm.run_reduce("trust", lambda: self._check_here(owner), _by_problem)
        if problems:
            error = CheckpointWriteError(
                errno.EACCES,
                f"the fast tier {self.directory} is refused: {'; '.join(problems)}. Nothing "
                "in it is used, written or deleted, and the durable tier is not affected",
            )
            # As a combined error's: printed by rank 0, and by the refusing ranks if not it.
            error.failures = {r: p for p, ranks in problems.items() for r in ranks}
            raise comm.everywhere(error)  # from the reduced answer: every rank raises it
        self.saves.prepare(comm)
        leader = any(domain[0] == comm.rank for domain in self.saves.domains or [])

        def mark() -> None:
            if leader and self._found is None:
                with run_storage_errors(self.directory, "marking the fast tier as this run's"):
                    _write_marker(self.directory, owner)

        comm.run("mark", mark)
        if self._found is None:  # a new directory: its node's leader marked it
            self._found = FastTierMarker(owner)
        self._owner = owner

    def _check_here(self, owner: str) -> str | None:
        """On every rank, before anything is read from the directory or written there: why
        this node's directory may not be the fast tier of the run ``owner``, or ``None``
        (then it exists, private, and :attr:`_found` holds its marker, if any)."""
        where = f"{self.directory} on {platform.node()}"
        self._found = None
        with run_storage_errors(self.directory, "setting up the fast tier"):
            if "://" not in self.run and nests(self.directory, self.run):
                return (
                    f"{where} is the run directory {self.run}, or one of them holds the other "
                    f"once symbolic links are resolved: {_AVOID}"
                )
            store = storage_for(self.directory)
            make_private = getattr(store, "make_private_dir", None)
            if make_private is None:  # FastTier.check refuses URLs: a storage of the user's
                return f"{where} is not on a local file system: {_AVOID}"
            problem = make_private(self.directory)
            if problem is not None:
                return f"{where}: {problem}: {_AVOID}"
            names = set(store.list(self.directory))
            if RUN_DIR_IDENTITY in names:
                return (
                    f"{where} is a durable run directory (it holds {RUN_DIR_IDENTITY}, a run's "
                    f"identity), not a fast tier: check fast_tier= (a typo, swapped paths?); "
                    f"{_AVOID}"
                )
            try:
                found = read_fast_tier_marker(self.directory)
            except CorruptCheckpointError as exc:
                return (
                    f"{where}: its marker is damaged ({exc}): remove the directory if no job "
                    "uses it (it holds only copies in memory), or give fast_tier= another one"
                )
        if found is None:
            foreign = sorted(n for n in names if n != LOCK_NAME and not is_temp_name(n))
            if foreign:
                steps = [n for n in foreign if parse_step(n) is not None]
                marks = [n for n in foreign if n in (LATEST, RUN_FILE)]
                what = "checkpoints of a run" if steps or marks else "files of another program"
                shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
                return (
                    f"{where} is no fast tier (it has no {FAST_TIER_MARKER}) and holds {what} "
                    f"({shown}): nothing there is used or deleted; check fast_tier= (a typo, "
                    f"swapped paths?) and {_AVOID}"
                )
        elif found.format < FAST_TIER_FORMAT and found.run != owner:
            return (
                f"{where} was marked by an earlier release of ddpckpt for another run "
                f"({found.run_directory!r}): its steps are not used or deleted; {_AVOID}"
            )
        self._found = found
        return None

    def _agree_owner(self, comm: Comm) -> str:
        """Collective: the durable run's identity (:func:`_owner`), read or made by rank 0."""

        def leader() -> str | None:
            if comm.rank != 0:
                return None
            with run_storage_errors(self.run, "reading the run's identity for the fast tier"):
                return _owner(self.run)

        return str(comm.run_reduce("owner", leader, lambda found: found[0]))

    def settle(self) -> None:
        """Collective: wait for the fast save in flight; log its failure on every rank
        (never raised: see :meth:`save`)."""
        with _reported(lambda exc: self.saves.failed(self.saves.latest, exc)):
            self.saves.settle()  # fails if another job took this tier's lock over

    def report_locally(self) -> None:
        """Local: wait for the fast save in flight; log its failure here (never raised)."""
        with _reported(self._say_background_failed):
            self.saves.report_locally()

    def close(self) -> None:
        """Local: wait for the save in flight, free the host buffer, release the node's lock.
        The steps stay in host memory for the next start of the job."""
        with _reported(self._say_background_failed):
            self.saves.close()

    def _say_background_failed(self, exc: CheckpointError) -> None:
        _log.error(
            "fast tier %s: a background save failed and training goes on (a fast save never "
            "stops training); its newest good step is %s. Cause: %s",
            self.directory,
            self.saves.newest(),
            exc,
            extra=same_on_every_rank(exc),
        )

    # ------------------------------------------------------------------ resume

    def list(self) -> list[int]:
        """Collective: set the tier up (:meth:`_set_up`) and learn which node holds which
        step; the steps held anywhere, newest first. A tier that cannot be set up is an
        ERROR and holds nothing: ``resume()`` goes on with the durable tier, and the next
        fast save tries to set it up again."""
        self._held, self._refused = {}, False
        with _reported(self._refuse), self.saves.comm("Checkpointer.resume (fast tier)") as comm:
            self._set_up(comm)
            owner = self._owner
            self._held = comm.run_reduce("held", lambda: self._held_here(owner), _by_step)
            self._world = comm.world_size
        return sorted((int(s) for s in self._held), reverse=True)

    def _refuse(self, exc: CheckpointError) -> None:
        """Report that :meth:`list` could not set the tier up: it holds nothing."""
        self._owner, self._held, self._refused = "", {}, True
        _log.error(
            "the fast tier %s cannot be used: %s. resume() goes on with the durable tier "
            "%s alone (its newest step is what it resumes from), and each later fast save "
            "tries the fast tier again",
            self.directory,
            exc,
            self.run,
            extra=same_on_every_rank(exc),
        )

    def _held_here(self, owner: str) -> dict[str, str]:
        """The committed steps this rank's node holds for the run ``owner``, with their
        checkpoint ids; none, with a WARNING, if its marker names another run (they are
        deleted after the resume, :meth:`keep_up_to`)."""
        held = {str(e.step): e.manifest.id for e in scan(self.directory) if e.manifest is not None}
        found = self._found
        if held and (found is None or found.run != owner):
            _log.warning(
                "the fast tier %s holds steps %s of another run (%s, not %s): not resumed "
                "from, and deleted; give each job a fast-tier directory of its own",
                self.directory,
                ", ".join(sorted(held, key=int)),
                found.run if found is not None else "unknown",
                owner,
            )
            return {}
        return held

    def resume(
        self,
        fast: list[int],
        durable: list[int],
        load: Callable[[str], CheckpointInfo],
        load_durable: Callable[[list[int]], Loaded | None],
        failures: list[str],
    ) -> Loaded | None:
        """Collective: restore the newest step of either tier that every rank can restore.

        ``fast`` and ``durable``: the steps each tier may serve, newest first (from
        :meth:`list` and the run directory); ``load`` restores a fast-tier checkpoint by
        path, ``load_durable`` the first of some durable steps that loads. A fast-tier step
        that cannot be restored is reported and added to ``failures``. Returns the step
        and its info, or ``None`` when nothing loads.
        """
        fast, tried = list(fast), []
        loaded: Loaded | None = None
        while loaded is None and (fast or durable):
            if fast and (not durable or fast[0] > durable[0]):
                step = fast.pop(0)
                tried.append(step)
                loaded = self._try(step, load, failures, more=bool(fast or durable))
                if loaded is not None:
                    _log.info(
                        "resumed from the fast tier: %s (step %d; the durable tier's newest is %s)",
                        loaded[1].path,
                        step,
                        f"step {max(durable)}" if durable else "none",
                    )
                    self._say_world_changed(loaded[1])
                    return loaded
            else:
                upto = [s for s in durable if not fast or s >= fast[0]]
                durable = durable[len(upto) :]
                loaded = load_durable(upto)
        if loaded is not None:
            self._say_durable_served(loaded[0], tried)
        return loaded

    def _try(
        self, step: int, load: Callable[[str], CheckpointInfo], failures: list[str], more: bool
    ) -> Loaded | None:
        """Restore fast-tier ``step``, first copying it to the nodes that lack it; ``None``
        (reported) if that fails."""
        path = self.saves.path(step)
        copies = [RankSet.from_json(spans) for spans in self._held[str(step)].values()]
        ranks = max(copies, key=len)  # the copy most nodes hold
        try:
            with self.saves.comm("Checkpointer.resume (fast tier copies)", path) as comm:
                if len(ranks) < comm.world_size:
                    repair_copies(comm, path, ranks.mask(comm.world_size), _SHARING)
            return step, load(path)
        except (*_CANNOT_SERVE, PartiallyRestoredError) as exc:
            cause = failure_of(exc)
            if not isinstance(cause, _CANNOT_SERVE):
                raise  # the objects do not match it: no other step would do
            _log.warning(
                "the fast tier cannot restore step %d on every rank: %s; trying %s%s",
                step,
                cause,
                "an older step" if more else "nothing else: no older checkpoint is left",
                partly_note(exc),
                extra=same_on_every_rank(exc),
            )
            failures.append(f"{path}: {cause}")
            return None

    def _say_durable_served(self, step: int, tried: list[int]) -> None:
        """Say why the durable tier served step ``step``, where the fast tier might have."""
        held = sorted((int(s) for s in self._held), reverse=True)
        if tried:
            _log.warning(
                "the fast tier %s could not serve every rank (see above); resumed from the "
                "durable tier at step %d: the %d step(s) after it that the fast tier held "
                "are lost",
                self.directory,
                step,
                max(tried) - step,
            )
        elif self._refused:
            _log.info(
                "resumed from the durable tier at step %d: the fast tier could not be used "
                "(see the ERROR above)",
                step,
            )
        elif not held:
            _log.warning(
                "the fast tier %s holds no checkpoint on any node (lost with the nodes' "
                "memory, or never written); resumed from the durable tier at step %d",
                self.directory,
                step,
            )
        elif held[0] < step:
            _log.warning(
                "the fast tier %s holds step %d at newest, older than the durable tier's step "
                "%d (its save of a later step had not committed when the job stopped, its "
                "saves failed, or it was left by an earlier run): resumed from the durable "
                "tier at step %d, so no step is lost",
                self.directory,
                held[0],
                step,
                step,
            )
        else:
            _log.info(
                "resumed from the durable tier at step %d: the fast tier holds the same step",
                step,
            )

    def _say_world_changed(self, info: CheckpointInfo) -> None:
        """Warn when the fast-tier checkpoint restored was saved by another number of ranks."""
        world = self._world
        if info.world_size != world:
            _log.warning(
                "%s was saved by %d ranks and this job has %d: it is restored as a durable "
                "checkpoint would be (replicated state exactly; each rank's own state as the "
                "messages above say)",
                info.path,
                info.world_size,
                world,
            )

    def keep_up_to(self, step: int | None, resumed: bool = True) -> None:
        """Collective, after a resume from ``step`` (``None``: a fresh start): each node
        deletes its fast-tier steps newer than it (those of an abandoned run, or that failed
        to load), those of another run and what is not committed (:meth:`_tidy`); later
        fast saves follow on. Nothing is done where :meth:`list` could not set the tier up;
        a failure is an ERROR (the next fast save sets the tier up again), never raised."""
        if not self._owner:
            return

        def failed(exc: CheckpointError) -> None:
            self._owner = ""
            _log.error(
                "the fast tier %s: removing steps newer than the one resumed from failed: %s. "
                "Training goes on; the next fast save sets the fast tier up again",
                self.directory,
                exc,
                extra=same_on_every_rank(exc),
            )

        with _reported(failed):
            self._tidy(step, resumed)

    def _tidy(self, step: int | None, resumed: bool) -> None:
        """Collective: :meth:`keep_up_to`, raising its failure; also before the first save,
        of ``step``, of a job whose resume did not set the tier up (``resumed=False``: this
        run's steps newer than it are deleted with a WARNING). A node whose marker names
        another run deletes every step, then marks the tier as this run's."""
        domains = self.saves.domains or []
        owner = self._owner
        with self.saves.comm("Checkpointer.resume (fast tier tidy)") as comm:
            leader = any(domain[0] == comm.rank for domain in domains)

            def tidy() -> int | None:
                if not leader:
                    return None
                with run_storage_errors(self.directory, "removing newer fast-tier steps"):
                    found = read_fast_tier_marker(self.directory)
                    ours = found is not None and found.run == owner
                    newest, newer = _keep_up_to(self.directory, step if ours else None)
                    if newer and not resumed:
                        _say_dropped(self.directory, newer, step, found, ours)
                    if not ours or found is None or found.format != FAST_TIER_FORMAT:
                        _write_marker(self.directory, owner)
                    return newest

            newest = comm.run_reduce(
                "tidy", tidy, lambda found: max((s for s in found if s is not None), default=None)
            )
        self._found = FastTierMarker(owner)
        self.saves.latest = self.saves.committed = newest


def _owner(run: str) -> str:
    """On rank 0: the identity of the durable run directory ``run``, a random token kept
    in it (made by the first resume with a fast tier), so that a run directory deleted and
    made anew is another run. A damaged one (no regular file, too large, not UTF-8 text)
    raises :class:`CorruptCheckpointError` saying what to do; it is never replaced."""
    store, path = storage_for(run), os.path.join(run, RUN_DIR_IDENTITY)
    try:
        found = read_run_identity(run, store)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc}. The fast tier is not used while the run's identity is unreadable: "
            f"delete {path} to give the run a new one (the fast tier's steps then count as "
            "another run's, and are deleted at the next start)"
        ) from None
    if found is not None:
        return found
    token = f"{run}#{uuid.uuid4().hex}"
    store.make_dirs(run)  # a job that saves the fast tier before the durable one
    store.replace(path, token.encode())
    return token


def _write_marker(directory: str, owner: str) -> None:
    """Mark the fast tier ``directory`` as the run ``owner``'s (replaced atomically)."""
    location = os.path.join(directory, FAST_TIER_MARKER)
    storage_for(directory).replace(location, FastTierMarker(owner).as_bytes())


def _by_problem(problems: list[str | None]) -> dict[str, list[int]]:
    """On rank 0: each problem the ranks found (those of a node find the same), with the
    ranks that found it."""
    found: dict[str, list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem is not None:
            found.setdefault(problem, []).append(rank)
    return found


def _by_step(views: list[dict[str, str]]) -> _Held:
    """On rank 0: every rank's holdings by step and checkpoint id, each as the spans of a
    :class:`RankSet`: every rank receives an answer whose size does not grow with the
    number of ranks when whole runs of nodes hold a copy."""
    held: dict[str, dict[str, list[int]]] = {}
    for rank, view in enumerate(views):
        for step, ident in view.items():
            held.setdefault(step, {}).setdefault(ident, []).append(rank)
    return {
        step: {ident: RankSet.of(ranks).to_json() for ident, ranks in copies.items()}
        for step, copies in held.items()
    }


def _keep_up_to(directory: str, step: int | None) -> tuple[int | None, list[int]]:
    """Delete the steps of ``directory`` newer than ``step`` (all for ``None``) and those
    not committed; the newest left, and the committed steps deleted."""
    newest, newer = None, []
    for entry in scan(directory):
        if entry.status != "committed":
            why = entry.problem
        elif step is None or entry.step > step:
            why = "newer than the step resumed from" if step is not None else "not resumed from"
            newer.append(entry.step)
        else:
            newest = entry.step
            continue
        remove_checkpoint(entry.path)
        _log.info("removed %s from the fast tier (%s)", entry.path, why)
    return newest, newer


def _say_dropped(
    directory: str, steps: list[int], step: int | None, found: FastTierMarker | None, ours: bool
) -> None:
    """Warn that the first save of a job that did not resume deleted the fast tier's
    ``steps``: this run's steps newer than ``step``, or (not ``ours``) another run's."""
    listed = ", ".join(str(s) for s in sorted(steps))
    if ours:
        _log.warning(
            "the fast tier %s held step(s) %s of this run, newer than step %s, the first this "
            "job saves to it without having resumed from it: deleted, so that a restart "
            "cannot resume from them",
            directory,
            listed,
            step,
        )
    else:
        _log.warning(
            "the fast tier %s held step(s) %s of another run (%s): deleted; give each job a "
            "fast-tier directory of its own",
            directory,
            listed,
            found.run if found is not None else "unknown",
        )
