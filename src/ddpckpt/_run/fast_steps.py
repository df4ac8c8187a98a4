"""What a node's fast tier holds (:mod:`ddpckpt._run.fast_tier`): which rank's node holds
which step, pruning the steps a resume abandoned, and what a resume says about the tier."""

from __future__ import annotations

from ddpckpt._coord.rankset import RankSet
from ddpckpt._format.runfiles import FastTierMarker
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger
from ddpckpt._run.rundir import remove_checkpoint, scan
from ddpckpt.storage._location import Location

_log = get_logger(__name__)
# step: checkpoint id: the ranks whose node holds it, as RankSet spans (constant size for
# whole runs of nodes, whatever the number of ranks)
Held = dict[str, dict[str, list[list[int]]]]


def by_step(views: list[dict[str, str]]) -> Held:
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


LACKING = "~"  # after a node's copy id: the copy lacks the rank's own file


def holdings(copies: dict[str, list[list[int]]]) -> tuple[RankSet, RankSet]:
    """Of one step's copies (id -> the ranks whose node holds it, as :func:`by_step` gives
    them), the copy most ranks' nodes hold: the ranks whose node holds it with the files
    they need, and the ranks whose node holds it at all."""
    by_id: dict[str, list[RankSet]] = {}
    for ident, spans in copies.items():
        by_id.setdefault(ident.removesuffix(LACKING), []).append(RankSet.from_json(spans))
    ident = max(by_id, key=lambda i: sum(len(s) for s in by_id[i]))
    have = RankSet.from_json(copies.get(ident, []))
    return have, RankSet.of(r for s in by_id[ident] for a, b in s.spans for r in range(a, b))


def keep_up_to(directory: Location, step: int | None) -> tuple[int | None, list[int]]:
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
        remove_checkpoint(entry.location)
        _log.info("removed %s from the fast tier (%s)", entry.path, why)
    return newest, newer


def say_dropped(
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


def say_durable_served(
    directory: str, step: int, held: list[int], tried: list[int], refused: bool
) -> None:
    """Say why the durable tier served step ``step``, where the fast tier ``directory``
    might have: it ``held`` these steps (newest first), ``tried`` these, and could not be
    set up if ``refused``."""
    if tried:
        _log.warning(
            "the fast tier %s could not serve every rank (see above); resumed from the "
            "durable tier at step %d: the %d step(s) after it that the fast tier held "
            "are lost",
            directory,
            step,
            max(tried) - step,
        )
    elif refused:
        _log.info(
            "resumed from the durable tier at step %d: the fast tier could not be used "
            "(see the ERROR above)",
            step,
        )
    elif not held:
        _log.warning(
            "the fast tier %s holds no checkpoint on any node (lost with the nodes' "
            "memory, or never written); resumed from the durable tier at step %d",
            directory,
            step,
        )
    elif held[0] < step:
        _log.warning(
            "the fast tier %s holds step %d at newest, older than the durable tier's step "
            "%d (its save of a later step had not committed when the job stopped, its "
            "saves failed, or it was left by an earlier run): resumed from the durable "
            "tier at step %d, so no step is lost",
            directory,
            held[0],
            step,
            step,
        )
    else:
        _log.info(
            "resumed from the durable tier at step %d: the fast tier holds the same step",
            step,
        )


def say_world_changed(info: CheckpointInfo, world: int) -> None:
    """Warn when the fast-tier checkpoint restored was saved by another number of ranks
    than this job's ``world``."""
    if info.world_size != world:
        _log.warning(
            "%s was saved by %d rank%s and this job has %d: it is restored as a durable "
            "checkpoint would be (replicated state exactly; each rank's own state as the "
            "other warnings of this resume say)",
            info.path,
            info.world_size,
            "" if info.world_size == 1 else "s",
            world,
        )
