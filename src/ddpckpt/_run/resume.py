"""The steps of :meth:`ddpckpt.Checkpointer.resume`.

1. :func:`list_candidates` (collective): every rank lists the run directory; a step is
   committed if any rank sees it committed (a node lacking its copy gets it repaired by
   the load), broken otherwise.
2. :func:`ddpckpt._run.query.choose`: the committed steps to try, in order.
3. :func:`load_first` (collective, through the Checkpointer's load): the first candidate
   that loads and verifies; a damaged one (or, for a reader, one deleted meanwhile) is
   reported and the next is tried.
4. :func:`set_aside` (one rank per storage domain): broken checkpoints newer than the one
   loaded become ``step-N.corrupt-*``, never loaded again.
5. :func:`point_latest` (same ranks): ``latest`` names the newest committed checkpoint.

A read-only Checkpointer runs steps 1 to 3 only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ddpckpt._coord.comm import Comm
from ddpckpt._format.runfiles import read_latest, step_dirname
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.catalog import SET_ASIDE_MARK
from ddpckpt._run.rundir import scan, write_latest
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ddpckpt.storage import storage_for
from ddpckpt.storage._base import new_token

_log = get_logger(__name__)
READER_LISTINGS = 3  # times a read-only resume lists the directory before giving up
_Listing = dict[str, tuple[str, dict[str, Any], str]]  # step: status, metrics, problem


def list_candidates(comm: Comm, directory: str) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Collective: the committed checkpoints (metrics by step) and the broken ones (what is
    wrong with each, by step)."""
    listed = comm.run_reduce("list", lambda: _listing(directory), _merged)
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
    (its step) and ``failures`` (the reason). For a writer a missing checkpoint raises: it
    was listed a moment ago under this job's lock, so it is no race.
    """
    for step in candidates:
        path = os.path.join(directory, step_dirname(step))
        try:
            return step, load(step)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            if isinstance(exc, CheckpointNotFoundError) and not read_only:
                raise
            _log.warning(
                "cannot resume from %s: %s; trying %s",
                path,
                exc,
                "the next candidate (the job writing there may have deleted or replaced it)"
                if read_only
                else "an older checkpoint",
                extra=same_on_every_rank(exc),
            )
            failed.append(step)
            failures.append(f"{path}: {exc}")
    return None


def nothing_loads(
    directory: str, failures: list[str], broken: dict[int, str]
) -> CorruptCheckpointError:
    """The error when checkpoints exist but none loads."""
    if failures:
        return CorruptCheckpointError(
            f"{directory}: holds checkpoints but none can be loaded:\n  " + "\n  ".join(failures)
        )
    return CorruptCheckpointError(
        f"{directory}: holds only incomplete checkpoints; nothing to resume:\n  "
        + "\n  ".join(broken.values())
    )


def set_aside(directory: str, reasons: dict[int, str]) -> None:
    """Rename the checkpoints of the steps in ``reasons`` (what is wrong with each) to
    ``step-N.corrupt-<token>``; local, one rank per storage domain. One already gone
    (another domain's rank, same storage) is skipped."""
    store = storage_for(directory)
    for step, reason in sorted(reasons.items()):
        source = os.path.join(directory, step_dirname(step))
        if store.exists(source):
            target = f"{source}{SET_ASIDE_MARK}{new_token()}"
            store.commit.set_aside(store, source, target)
            _log.warning("moved %s aside to %s; it is never loaded (%s)", source, target, reason)


def point_latest(directory: str, step: int) -> None:
    """Make ``latest`` name checkpoint ``step`` unless it already does; local."""
    if read_latest(directory) != step_dirname(step):
        write_latest(directory, step_dirname(step))


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
