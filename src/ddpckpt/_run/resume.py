"""The steps of :meth:`ddpckpt.Checkpointer.resume`.

1. :func:`list_candidates` (collective): the first rank of each storage domain lists the
   run directory (every rank, for a read-only Checkpointer, which does not know the
   domains) and the others receive the merged listing; a step is committed if any lister
   sees it committed (a node lacking its copy gets it repaired by the load), broken
   otherwise. The other ranks parse no manifest but the one they load.
2. :func:`ddpckpt._run.query.choose`: the committed steps to try, in order.
3. :func:`load_first` (collective, through the Checkpointer's load): the first candidate
   that loads and verifies; a damaged one (or, for a reader, one deleted meanwhile) is
   reported and the next is tried.
4. :func:`~ddpckpt._run.rundir.set_aside` (one rank per storage domain): broken checkpoints newer than the one
   loaded become ``step-N.corrupt-*``, never loaded again.
5. :func:`~ddpckpt._run.rundir.point_latest` (same ranks): ``latest`` names the newest committed checkpoint.

A read-only Checkpointer runs steps 1 to 3 only. With a fast tier, its steps join those
of step 2 (:mod:`ddpckpt._run.fast_tier`), and it keeps nothing newer than the step loaded.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddpckpt._coord.comm import Comm
from ddpckpt._format.runfiles import step_dirname
from ddpckpt._io.load import damage_of, none_loaded, partly_note
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.rundir import scan
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PartiallyRestoredError,
)

if TYPE_CHECKING:
    from ddpckpt._run.fast_tier import FastSaves
    from ddpckpt._run.saving import RunSaves

_log = get_logger(__name__)
READER_LISTINGS = 3  # times a read-only resume lists the directory before giving up
_Listing = dict[str, tuple[str, dict[str, Any], str]]  # step: status, metrics, problem


def resume_run(
    saves: RunSaves,
    fast: FastSaves | None,
    load: Callable[[int | str], CheckpointInfo],
    choose: Callable[[dict[int, Any]], list[int]],
    read_only: bool,
    newest: bool,
) -> CheckpointInfo | None:
    """Collective: the steps above for the run of ``saves`` (and its fast tier); the info of
    the checkpoint restored, ``None`` on a fresh start. ``load`` restores a step of the run
    (or a fast-tier checkpoint by path); ``choose`` orders the committed steps to try;
    ``newest``: the newest checkpoint is wanted (no ``step=``, no ``best=``), which the fast
    tier may hold. Raises if checkpoints exist but none loads."""
    directory = saves.directory
    failed: list[int] = []
    failures: list[str] = []
    partial: list[PartiallyRestoredError] = []  # loads that left the objects partly restored

    def load_noting(step: int | str) -> CheckpointInfo:
        try:
            return load(step)
        except PartiallyRestoredError as exc:
            partial.append(exc)
            raise

    # A reader whose candidates were all deleted meanwhile lists the directory again.
    for listing in range(READER_LISTINGS if read_only else 1):
        with saves.comm("Checkpointer.resume") as comm:
            if not read_only and listing == 0:
                saves.prepare(comm)
            committed, broken = list_candidates(comm, directory, saves.lists)
        candidates = [c for c in choose(committed) if c not in failed]
        held = fast.list() if fast is not None else []
        if not candidates and not broken and not failed and not (newest and held):
            _log.info("%s: no checkpoint to resume from; starting fresh", directory)
            if fast is not None:
                fast.keep_up_to(None)
            return None
        load_durable = functools.partial(
            load_first, load=load_noting, directory=directory, read_only=read_only,
            failed=failed, failures=failures,
        )  # fmt: skip
        if fast is not None and newest:
            loaded = fast.resume(held, candidates, load_noting, load_durable, failures)
        else:
            loaded = load_durable(candidates)
        if loaded is not None:
            if not read_only:
                saves.resumed(loaded[0], committed, broken, failed)
            if fast is not None:
                fast.keep_up_to(loaded[0])
            return loaded[1]
        if not candidates:
            break
    raise nothing_loads(directory, failures, broken, partial[-1] if partial else None)


def list_candidates(
    comm: Comm, directory: str, lists: bool = True
) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Collective: the committed checkpoints (metrics by step) and the broken ones (what is
    wrong with each, by step), as the ranks that pass ``lists`` find them (at least one of
    each storage domain); the others read nothing."""
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
) -> tuple[int, CheckpointInfo] | None:
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


def nothing_loads(
    directory: str,
    failures: list[str],
    broken: dict[int, str],
    partial: PartiallyRestoredError | None = None,
) -> CheckpointError:
    """The error when checkpoints exist but none loads (:func:`none_loaded`), or when only
    incomplete ones (``broken``) exist."""
    if failures or partial is not None:
        return none_loaded(directory, failures, partial)
    return CorruptCheckpointError(
        f"{directory}: holds only incomplete checkpoints; nothing to resume:\n  "
        + "\n  ".join(broken.values())
    )


def _listing(directory: str) -> _Listing:
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
