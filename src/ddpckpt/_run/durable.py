"""The durable tier of a :class:`~ddpckpt.Checkpointer`: its run directory.

Its saves are :class:`~ddpckpt._run.saving.RunSaves`'; its part of a resume
(:mod:`ddpckpt._run.resume`):

1. :meth:`DurableSaves.offer` (collective): a writer first sets the run directory up
   (:meth:`RunSaves.prepare`: storage domains, the lock, leftovers), a reader checks that
   it is no file (:mod:`ddpckpt._run.runpath`); the first rank of each storage domain
   lists it (every rank, for a read-only Checkpointer, which does not know the domains)
   and the others receive the merged listing (:func:`list_candidates`);
   ``Resuming.choose`` orders the committed steps to try.
2. :meth:`DurableSaves.restore` (collective): the first candidate that loads and verifies
   (:func:`load_first`).
3. :meth:`DurableSaves.resumed` (one rank per storage domain, not read-only): broken
   checkpoints newer than the one loaded become ``step-N.corrupt-*``, never loaded again,
   and ``latest`` names the newest committed checkpoint left; rank 0 says what a resume
   on fewer ranks than saved the checkpoint cannot restore
   (:mod:`ddpckpt._io.world_change`).

Collective methods are called by the Checkpointer on every rank at the same points.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ddpckpt._coord.comm import Comm
from ddpckpt._format.runfiles import step_dirname
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.load import damage_of, partly_note
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._io.world_change import note_fewer_ranks
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.options import CheckpointerOptions
from ddpckpt._run.rundir import scan
from ddpckpt._run.runpath import refuse_no_directory
from ddpckpt._run.saving import RunSaves
from ddpckpt._run.tier import Loaded, Resuming, Tier
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PartiallyRestoredError,
)
from ddpckpt.storage._location import Location

_log = get_logger(__name__)
_Listing = dict[str, tuple[str, dict[str, Any], str]]  # step: status, metrics, problem


class DurableSaves:
    """The durable tier of one Checkpointer on this rank (see the module docstring)."""

    def __init__(
        self, directory: Location, options: CheckpointerOptions, saver: AsyncSaver, read_only: bool
    ) -> None:
        self.saves = RunSaves(directory, options, saver)
        self.options = options
        self.read_only = read_only
        self._committed: dict[int, dict[str, Any]] = {}  # as the last listing found them

    @property
    def directory(self) -> str:
        return self.saves.directory

    def due(self, step: int) -> bool:
        """Local: whether the schedule (``every_steps``, ``every_seconds``) asks for
        ``step``, on this rank's clock (the Checkpointer has rank 0 decide where the policy
        reads a clock, and adds preemption)."""
        latest = self.saves.latest
        if latest is not None and step <= latest:
            return False
        return self.options.schedule.policy.should_save(step, time.monotonic())

    def save(
        self,
        step: int,
        header: dict[str, Any],
        capture: Callable[[], Snapshot],
        synchronous: bool,
        borrow: AsyncSaver | None = None,
    ) -> str | None:
        """Collective: :meth:`RunSaves.save`."""
        return self.saves.save(step, header, capture, synchronous, borrow)

    def offer(self, resuming: Resuming) -> list[int]:
        """Collective: list the run directory (at the first listing of a resume, a writer
        sets it up first, and a reader checks it is no file); the committed steps
        ``resuming.choose`` picks, in its order, less those that failed to load earlier in
        this resume. Incomplete ones go to ``resuming.broken``."""
        with self.saves.comm("Checkpointer.resume") as comm:
            if resuming.listing == 0:
                if self.read_only:
                    refuse_no_directory(comm, self.saves.location, create=False)
                else:
                    self.saves.prepare(comm)
            self._committed, broken = list_candidates(comm, self.saves.location, self.saves.lists)
        resuming.broken = broken
        return [c for c in resuming.choose(self._committed) if c not in resuming.failed]

    def restore(self, steps: list[int], resuming: Resuming, more: bool) -> Loaded | None:
        """Collective: :func:`load_first` of ``steps``."""
        return load_first(
            steps, load=resuming.load_noting, directory=self.directory,
            read_only=self.read_only, failed=resuming.failed, failures=resuming.failures,
        )  # fmt: skip

    def resumed(self, loaded: Loaded | None, server: Tier | None, resuming: Resuming) -> None:
        """Collective: after a writer restored ``loaded`` (from this tier or another), move
        aside the broken checkpoints newer than it and those that failed to load; point
        ``latest`` at the newest committed one left (:meth:`RunSaves.resumed`); on rank 0,
        say what a resume on fewer ranks than saved it cannot restore
        (:mod:`ddpckpt._io.world_change`: a reader, for evaluation, trains nothing on)."""
        if loaded is not None and not self.read_only:
            self.saves.resumed(loaded[0], self._committed, resuming.broken, resuming.failed)
            note_fewer_ranks(loaded[1])

    def settle(self) -> None:
        self.saves.settle()

    def report_locally(self) -> None:
        self.saves.report_locally()

    def close(self) -> None:
        self.saves.close()


def list_candidates(
    comm: Comm, directory: Location, lists: bool = True
) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Collective: the committed checkpoints (metrics by step) and the broken ones (what is
    wrong with each, by step), as the ranks that pass ``lists`` find them (at least one of
    each storage domain); the others read nothing. A step is committed if any lister sees
    it committed (a node lacking its copy gets it repaired by the load), broken otherwise."""
    listed = comm.run_reduce("list", lambda: _listing(directory) if lists else {}, _merged)
    committed = {int(s): m for s, (status, m, _) in listed.items() if status == "committed"}
    broken = {
        int(s): problem for s, (status, _, problem) in listed.items() if status != "committed"
    }
    return committed, dict(sorted(broken.items()))


def load_first(
    candidates: list[int],
    load: Callable[[int], CheckpointInfo],
    directory: str,
    read_only: bool,
    failed: list[int],
    failures: list[str],
) -> Loaded | None:
    """The first of ``candidates`` that ``load`` restores, with its info; ``None`` if none does.

    Each one that is damaged (or, for a reader, gone) is reported and added to ``failed``
    (its step) and ``failures`` (the reason), also when its load had begun writing into the
    objects (a :class:`PartiallyRestoredError`: the next load restores every object again);
    once one loads after others failed, a warning names it and the steps skipped. For a
    writer a missing checkpoint raises: it was listed a moment ago under this job's lock, so
    it is no race; so does any failure that is no damage (a mismatch of the objects).
    """
    skipped: list[str] = []
    for step in candidates:
        path = os.path.join(directory, step_dirname(step))
        try:
            info = load(step)
        except (CorruptCheckpointError, CheckpointNotFoundError, PartiallyRestoredError) as exc:
            cause = damage_of(exc)
            if cause is None:
                raise  # e.g. the objects do not match it: no damage, an older one fails too
            if isinstance(cause, CheckpointNotFoundError) and not read_only:
                raise
            _log.warning(
                "cannot resume from %s: %s; trying %s%s",
                path,
                cause,
                "the next candidate (the job writing there may have deleted or replaced it)"
                if read_only
                else "an older checkpoint",
                partly_note(exc),
                extra=same_on_every_rank(exc),
            )
            failed.append(step)
            failures.append(f"{path}: {cause}")
            skipped.append(f"step {step} ({cause})")
            continue
        if skipped:
            _log.warning(
                "resumed from %s (step %d) instead of the checkpoint(s) tried first, which "
                "could not be loaded: %s; every object was restored from step %d",
                path,
                step,
                "; ".join(skipped),
                step,
                extra=same_on_every_rank(),
            )
        return step, info
    return None


def _listing(directory: Location) -> _Listing:
    """Every checkpoint of ``directory``: its status and metrics, by step (JSON-able)."""
    return {str(e.step): (e.status, e.metrics, e.problem) for e in scan(directory)}


def _merged(views: list[_Listing]) -> _Listing:
    """Every rank's listing in one (rank 0 reduces them): committed wins over broken."""
    merged: _Listing = {}
    for view in views:
        for step, (status, metrics, problem) in view.items():
            if step not in merged or status == "committed":
                merged[step] = (status, metrics, problem)
    return merged
