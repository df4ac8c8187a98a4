"""The fast tier's directory on every node, as :class:`FastDirectory` (the base class of
:class:`~ddpckpt._run.fast_tier.FastSaves`) keeps it: named for the run with
``fast_tier="auto"``, set up (each node's checks, :mod:`ddpckpt._run.fast_trust`; storage
domains, each node's lock, the marker), listed (which node holds which step,
:mod:`ddpckpt._run.fast_steps`), and pruned to nothing newer than the step resumed from. A
failure of the tier is reported, not raised (:func:`reported`).

Collective methods are called by the Checkpointer on every rank at the same points.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ddpckpt._coord.comm import Comm
from ddpckpt._format.rankparts import file_rank, kept_ranks
from ddpckpt._format.runfiles import FAST_TIER_FORMAT, FastTierMarker, read_fast_tier_marker
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.fast_steps import LACKING, Held, by_step, keep_up_to, say_dropped
from ddpckpt._run.fast_trust import by_problem, check_here, run_identity, write_marker
from ddpckpt._run.options import CheckpointerOptions, auto_directory
from ddpckpt._run.rundir import scan
from ddpckpt._run.saving import RunSaves, run_storage_errors
from ddpckpt._run.tiernames import TierNames
from ddpckpt.errors import (
    CheckpointError,
    CheckpointStepError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PartiallyRestoredError,
    StateMismatchError,
    UnsupportedValueError,
)
from ddpckpt.storage._location import Location, locate

_log = get_logger(__name__)
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


@contextmanager
def reported(report: Callable[[CheckpointError], None]) -> Iterator[None]:
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


class FastDirectory:
    """The fast tier's directory on every node, for one Checkpointer on this rank (see the
    module docstring); :class:`~ddpckpt._run.fast_tier.FastSaves` makes its state."""

    auto: bool
    named: bool
    directory: str
    run_location: Location
    saver: AsyncSaver
    saves: RunSaves
    _options: CheckpointerOptions
    _place: Callable[[str], str]
    _held: Held
    _world: int
    _owner: str
    _found: FastTierMarker | None
    _refused: bool

    @property
    def run(self) -> str:
        """The durable run directory, as messages name it."""
        return self.run_location.path

    def _saves_in(self, directory: str) -> RunSaves:
        return RunSaves(locate(directory), self._options, self.saver, TierNames.fast(directory))

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

    def _set_up(self, comm: Comm) -> None:
        """Collective: learn the run's identity (rank 0), check on every rank that its
        node's directory may be used (:func:`~ddpckpt._run.fast_trust.check_here`: nothing is read from it or
        written there before), then set it up as a run directory (storage domains, each
        node's lock, leftovers) and mark the nodes' new directories as this run's.

        Raises :class:`CheckpointWriteError` (``EACCES``) naming every node's reason if
        any node's directory is refused, :class:`CorruptCheckpointError` if the run's
        identity file is damaged, or what the set-up raises (another job's live lock)."""
        self._owner = ""
        owner = self._agree_owner(comm)
        self._resolve(owner)

        def here() -> str | None:
            self._found = None  # known once the directory is found usable
            problem, self._found = check_here(self.saves.location, self.run, owner)
            return problem

        problems = comm.run_reduce("trust", here, by_problem)
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
                with run_storage_errors(self.saves.location, "marking the fast tier as this run's"):
                    write_marker(self.saves.location, owner)

        comm.run("mark", mark)
        if self._found is None:  # a new directory: its node's leader marked it
            self._found = FastTierMarker(owner)
        self._owner = owner

    def _agree_owner(self, comm: Comm) -> str:
        """Collective: the durable run's identity (:func:`~ddpckpt._run.fast_trust.run_identity`), read or made by rank 0."""

        def leader() -> str | None:
            if comm.rank != 0:
                return None
            with run_storage_errors(
                self.run_location, "reading the run's identity for the fast tier"
            ):
                return run_identity(self.run_location)

        return str(comm.run_reduce("owner", leader, lambda found: found[0]))

    def held(self) -> list[int]:
        """Collective: set the tier up (:meth:`_set_up`) and learn which node holds which
        step; the steps held anywhere, newest first. A tier that cannot be set up is an
        ERROR and holds nothing: ``resume()`` goes on with the durable tier, and the next
        fast save tries to set it up again."""
        self._held, self._refused = {}, False
        with reported(self._refuse), self.saves.comm("Checkpointer.resume (fast tier)") as comm:
            self._set_up(comm)
            owner = self._owner
            rank = comm.rank
            self._held = comm.run_reduce("held", lambda: self._held_here(owner, rank), by_step)
            self._world = comm.world_size
        return sorted((int(s) for s in self._held), reverse=True)

    def _refuse(self, exc: CheckpointError) -> None:
        """Report that :meth:`held` could not set the tier up: it holds nothing."""
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

    def _held_here(self, owner: str, rank: int) -> dict[str, str]:
        """The committed steps this rank's node holds for the run ``owner``, with their
        checkpoint ids; an id ends with :data:`LACKING` where the node's copy lacks the
        file ``rank`` needs (its own, or rank 0's for a rank the checkpoint did not have:
        a node keeps only some ranks' files, ``FastTier.partners``). None, with a WARNING,
        if its marker names another run (they are deleted after the resume,
        :meth:`keep_up_to`)."""
        held = {
            str(e.step): e.manifest.id
            + ("" if file_rank(rank, e.manifest.world_size) in kept_ranks(e.manifest)
               else LACKING)
            for e in scan(self.saves.location)
            if e.manifest is not None
        }  # fmt: skip
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

    def keep_up_to(self, step: int | None, resumed: bool = True) -> None:
        """Collective, after a resume from ``step`` (``None``: a fresh start): each node
        deletes its fast-tier steps newer than it (those of an abandoned run, or that failed
        to load), those of another run and what is not committed (:meth:`_tidy`); later
        fast saves follow on. Nothing is done where :meth:`held` could not set the tier up;
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

        with reported(failed):
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
                where = self.saves.location
                with run_storage_errors(where, "removing newer fast-tier steps"):
                    found = read_fast_tier_marker(where)
                    ours = found is not None and found.run == owner
                    newest, newer = keep_up_to(where, step if ours else None)
                    if newer and not resumed:
                        say_dropped(self.directory, newer, step, found, ours)
                    if not ours or found is None or found.format != FAST_TIER_FORMAT:
                        write_marker(where, owner)
                    return newest

            newest = comm.run_reduce(
                "tidy", tidy, lambda found: max((s for s in found if s is not None), default=None)
            )
        self._found = FastTierMarker(owner)
        self.saves.latest = self.saves.committed = newest
