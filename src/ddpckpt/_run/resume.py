"""The walk of :meth:`ddpckpt.Checkpointer.resume` over the tiers (:mod:`ddpckpt._run.tier`).

1. Each tier offers the steps it may serve, newest first (:meth:`Tier.offer`, collective,
   in the tiers' order): the durable tier the committed steps of the run directory that
   ``step=``/``best=`` choose, the fast tier its held steps when the newest is wanted.
2. The newest step offered is restored by the tier that offers it, the earlier tier's on a
   tie (:meth:`Tier.restore`): a step that cannot be restored on every rank is reported and
   the next is tried, whichever tier offers it.
3. Every tier learns what was restored, and by which tier (:meth:`Tier.resumed`): the
   durable tier moves broken checkpoints aside, the fast tier keeps nothing newer.

A read-only Checkpointer (the durable tier alone) whose candidates were all deleted
meanwhile by the job writing there lists them again, :data:`READER_LISTINGS` times.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddpckpt._io.load import none_loaded
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger
from ddpckpt._run.tier import Loaded, Resuming, Tier
from ddpckpt.errors import CheckpointError, CorruptCheckpointError, PartiallyRestoredError

_log = get_logger(__name__)
READER_LISTINGS = 3  # times a read-only resume lists the directory before giving up


def resume_run(
    tiers: Sequence[Tier], resuming: Resuming, directory: str, read_only: bool
) -> CheckpointInfo | None:
    """Collective: the steps above; the info of the checkpoint restored, ``None`` on a
    fresh start. ``directory``: the run directory, for messages. Raises if checkpoints
    exist but none loads."""
    for listing in range(READER_LISTINGS if read_only else 1):
        resuming.listing = listing
        offers = resuming.offers = [tier.offer(resuming) for tier in tiers]
        if not any(offers) and not resuming.broken and not resuming.failed:
            _log.info("%s: no checkpoint to resume from; starting fresh", directory)
            for tier in tiers:
                tier.resumed(None, None, resuming)
            return None
        served = walk(tiers, offers, resuming)
        if served is not None:
            server, loaded = served
            for tier in tiers:
                tier.resumed(loaded, server, resuming)
            return loaded[1]
        if not offers[0]:
            break
    partial = resuming.partial[-1] if resuming.partial else None
    raise nothing_loads(directory, resuming.failures, resuming.broken, partial)


def walk(
    tiers: Sequence[Tier], offers: Sequence[list[int]], resuming: Resuming
) -> tuple[Tier, Loaded] | None:
    """Collective: restore the newest step of ``offers`` (each tier's, newest first) that
    its tier can restore; the earlier tier's on a tie. Each tier is handed the run of its
    steps newer than every other tier's next one, and tries them in order. The tier that
    served and what it restored, or ``None``."""
    left = [list(steps) for steps in offers]
    while any(left):
        first = max(
            (i for i, steps in enumerate(left) if steps), key=lambda i: (left[i][0], -i)
        )  # fmt: skip
        heads = [(steps[0], -j) for j, steps in enumerate(left) if steps and j != first]
        n = 1  # its newest beats every other head, by the choice of first
        while n < len(left[first]) and all((left[first][n], -first) > h for h in heads):
            n += 1
        run, left[first] = left[first][:n], left[first][n:]
        loaded = tiers[first].restore(run, resuming, more=any(left))
        if loaded is not None:
            return tiers[first], loaded
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
