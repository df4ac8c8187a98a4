"""How messages name a tier of a :class:`~ddpckpt.Checkpointer`: the durable run directory
or the fast tier in each node's memory. The write side (:mod:`ddpckpt._run.saving`,
:mod:`ddpckpt._run.save_failures`) is the same for both; only these words differ."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierNames:
    """The words a tier's messages use."""

    where: str  # the tier: its run directory, or "fast tier <directory>"
    prefix: str  # put before a failed save's message ("" where the path names the tier)
    cadence: str  # the arguments that set how often it saves
    none_yet: str  # a failure's message, when the tier holds no good step

    @classmethod
    def durable(cls, directory: str) -> TierNames:
        return cls(
            where=directory,
            prefix="",
            cadence="every_steps= or every_seconds=",
            none_yet="the newest good checkpoint is NONE: this run has no checkpoint to resume "
            "from",
        )

    @classmethod
    def fast(cls, directory: str) -> TierNames:
        where = f"fast tier {directory}"
        return cls(
            where=where,
            prefix=f"{where}: ",
            cadence="FastTier(every_steps=...)",
            # the durable tier keeps its own checkpoints
            none_yet="the fast tier holds no good step yet (the durable tier is not affected)",
        )
