"""The fast tier of a :class:`~ddpckpt.Checkpointer`: a checkpoint in every node's host
memory, as often as every step, that a restarted job resumes from.

With ``Checkpointer(..., fast_tier="/dev/shm/<job>")`` (or a
:class:`~ddpckpt._run.options.FastTier`) a Checkpointer keeps two tiers. With
``fast_tier="auto"`` the directory is named at the first set-up, once rank 0 has read or made
the run's identity: :func:`~ddpckpt._run.options.auto_directory`, the same on every node and
at every launch writing the run directory
(:meth:`~ddpckpt._run.fast_directory.FastDirectory._resolve`).

* the **fast tier** (:class:`FastSaves`): a run directory of its own on every node, in
  memory that outlives the worker processes (a tmpfs), written by every ``save()``.
  ``should_save(step)`` says True at every ``FastTier.every_steps``-th step, for the fast
  tier alone unless the durable schedule is due too. Each node keeps a copy, written as on
  node-local storage (:mod:`ddpckpt._io.writing`): the replicated state (model, optimizer)
  is split among the node's ranks and written from their own memory, never sent between
  nodes; rank 0's buffers and shared state reach every node by doubling, and each rank's
  own file (RNG streams, data position, state that is not replicated) is kept by its node
  and the ``FastTier.partners`` nodes after it (:class:`~ddpckpt._coord.plan.Partners`,
  :mod:`ddpckpt._io.settling`), so a fast save costs each node O(partners) transfers
  whatever the number of nodes, and losing any ``partners`` neighbouring nodes loses no
  rank's state. Saves are
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
newest first, the durable tier first on a tie (:mod:`ddpckpt._run.resume`; this tier's part
is :meth:`FastSaves.offer`, :meth:`FastSaves.restore`, :meth:`FastSaves.resumed`). A rank
holds a step if its node's copy keeps the files it needs (its own; rank 0's for a rank the
checkpoint did not have). A fast-tier step is taken from the copy most ranks hold; nodes
that lack it (a replaced node, a wiped tmpfs, ranks placed on another node by the
restart's rendezvous) first receive the copy of a node that has it and keeps their ranks'
files, verified against its checksums (:func:`~ddpckpt._coord.replicate.repair_copies`). A step that cannot be restored on every
rank is reported and the next is tried; a WARNING says when the durable tier serves in
place of a newer fast-tier step, or because no node holds one. Whichever tier served, the
fast tier then keeps nothing newer than the step resumed from
(:meth:`~ddpckpt._run.fast_directory.FastDirectory.keep_up_to`).

Collective methods are called by the Checkpointer on every rank at the same points.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddpckpt._coord.replicate import repair_copies
from ddpckpt._format.runfiles import FastTierMarker
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.load import failure_of, partly_note
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.fast_directory import FastDirectory, reported
from ddpckpt._run.fast_steps import Held, holdings, say_durable_served, say_world_changed
from ddpckpt._run.options import (
    Asynchronous,
    CheckpointerOptions,
    FailureHandling,
    FastTier,
    Keeping,
    Schedule,
    StorageOptions,
    auto_directory,
)
from ddpckpt._run.tier import Loaded, Resuming, Tier
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    PartiallyRestoredError,
)
from ddpckpt.policies import EverySteps, KeepLast
from ddpckpt.storage._location import Location

_log = get_logger(__name__)
_SHARING = "auto"  # each node's memory is its own: probed, whatever $DDPCKPT_STORAGE says
# A fast-tier step failing so is reported, and the next step (or the durable tier) serves.
_CANNOT_SERVE = (CorruptCheckpointError, CheckpointNotFoundError, CheckpointWriteError)
_MAX_SKIPPED = 255  # fast saves skipped at most between two tries at setting the tier up


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
        storage=StorageOptions(
            _SHARING, storage.timeout, storage.lock_stale_after, False, config.partners
        ),
    )


class FastSaves(FastDirectory):
    """The fast tier of one Checkpointer on this rank (see the module docstring)."""

    def __init__(
        self,
        directory: str | None,
        config: FastTier,
        durable: CheckpointerOptions,
        overlap: bool,
        run: Location,
        place: Callable[[str], str] = lambda path: path,
    ) -> None:
        # None (fast_tier="auto"): named by the run's identity at the first set-up
        # (_resolve); until then messages name the pattern.
        self.auto = directory is None
        self.named = not self.auto  # whether self.directory is the tier's (not the pattern)
        self.directory = directory or auto_directory("<this run's identity>")
        self.run_location = run  # the durable run directory whose steps this tier holds
        self.every = config.every_steps
        self.saver = AsyncSaver()  # its own host buffer and background writer
        self._options = fast_options(config, durable, overlap)
        self._place = place  # where this process writes a path (check-resume maps it)
        self.saves = self._saves_in(self.directory)
        self._held: Held = {}  # known once listed, with this job's number of ranks
        self._world = 1
        self._owner = ""  # the durable run's identity, once the tier is set up (see _set_up)
        self._found: FastTierMarker | None = None  # this node's marker, as set-up read it
        self._refused = False  # resume() could not set the tier up (reported)
        self._set_up_failures = 0  # in a row: the next try waits 2**n - 1 fast saves
        self._skip = 0  # fast saves left to skip before the set-up is tried again
        self._offered: list[int] = []  # the steps this resume's offer() listed
        self._tried: list[int] = []  # those this resume tried to restore from here

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
        synchronous: bool = False,
        borrow: AsyncSaver | None = None,
    ) -> str | None:
        """Collective: start saving ``step`` to the fast tier (always asynchronously:
        ``synchronous`` is for the durable tier); its path, or ``None`` when the
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
        with reported(lambda exc: self.saves.failed(step, exc)):
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

        with reported(failed):
            with self.saves.comm("Checkpointer.save (fast tier set-up)") as comm:
                self._set_up(comm)
            self._tidy(step, resumed=False)
            self._set_up_failures = 0
            return True
        return False

    def settle(self) -> None:
        """Collective: wait for the fast save in flight; log its failure on every rank
        (never raised: see :meth:`save`)."""
        with reported(lambda exc: self.saves.failed(self.saves.latest, exc)):
            self.saves.settle()  # fails if another job took this tier's lock over

    def report_locally(self) -> None:
        """Local: wait for the fast save in flight; log its failure here (never raised)."""
        with reported(self._say_background_failed):
            self.saves.report_locally()

    def close(self) -> None:
        """Local: wait for the save in flight, free the host buffer, release the node's lock.
        The steps stay in host memory for the next start of the job."""
        with reported(self._say_background_failed):
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

    def offer(self, resuming: Resuming) -> list[int]:
        """Collective: :meth:`held` the tier (set up, or reported as unusable); the steps
        held anywhere, newest first, when ``resuming`` wants the newest step (else none:
        ``step=`` and ``best=`` name the run directory's)."""
        held = self.held()
        self._tried, self._offered = [], held if resuming.newest else []
        return self._offered

    def restore(self, steps: list[int], resuming: Resuming, more: bool) -> Loaded | None:
        """Collective: restore the first of ``steps`` that every rank can restore, copying
        it first to the nodes that lack it (:meth:`_try`); each that cannot be restored is
        reported and added to ``resuming.failures``. ``None`` if none can."""
        for i, step in enumerate(steps):
            self._tried.append(step)
            later = more or i + 1 < len(steps)
            loaded = self._try(step, resuming.load_noting, resuming.failures, more=later)
            if loaded is not None:
                others = [
                    s
                    for offered in resuming.offers
                    if offered is not self._offered
                    for s in offered
                    if s not in resuming.failed
                ]
                _log.info(
                    "resumed from the fast tier: %s (step %d; the durable tier's newest is %s)",
                    loaded[1].path,
                    step,
                    f"step {max(others)}" if others else "none",
                )
                say_world_changed(loaded[1], self._world)
                return loaded
        return None

    def resumed(self, loaded: Loaded | None, server: Tier | None, resuming: Resuming) -> None:
        """Collective: keep nothing newer than the step resumed from (:meth:`keep_up_to`);
        where another tier served the newest step, say why this one did not."""
        if loaded is not None and server is not self and resuming.newest:
            say_durable_served(
                self.directory, loaded[0], sorted(map(int, self._held), reverse=True),
                self._tried, self._refused,
            )  # fmt: skip
        self.keep_up_to(None if loaded is None else loaded[0])

    def _try(
        self,
        step: int,
        load: Callable[[Location], CheckpointInfo],
        failures: list[str],
        more: bool,
    ) -> Loaded | None:
        """Restore fast-tier ``step``, first copying it to the nodes that lack it; ``None``
        (reported) if that fails."""
        at = self.saves.at(step)
        have, copies = holdings(self._held[str(step)])  # of the copy most nodes hold
        try:
            with self.saves.comm("Checkpointer.resume (fast tier copies)", at.path) as comm:
                if len(have) < comm.world_size:
                    world = comm.world_size
                    repair_copies(comm, at, have.mask(world), _SHARING, copies.mask(world))
            return step, load(at)
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
            failures.append(f"{at}: {cause}")
            return None
