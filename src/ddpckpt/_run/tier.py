"""The tiers of a :class:`~ddpckpt.Checkpointer`, as peers.

A tier is a run directory that a Checkpointer saves to and resumes from: the durable tier
(:class:`~ddpckpt._run.durable.DurableSaves`, the run directory) and, with ``fast_tier=``,
the fast tier (:class:`~ddpckpt._run.fast_tier.FastSaves`, a directory in each node's
memory). Both write through a :class:`~ddpckpt._run.saving.RunSaves` of their own. The
Checkpointer holds its tiers in a list, the durable one first, and walks it: to settle,
wait for and close their saves, to size their host buffers, and at :meth:`resume`, where
:func:`ddpckpt._run.resume.resume_run` restores the newest step any tier offers (the
earlier tier's on a tie).

Collective methods are called by the Checkpointer on every rank at the same points, in
the tiers' order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._run.saving import RunSaves
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import PartiallyRestoredError
from ddpckpt.storage._location import Location

Loaded = tuple[int, CheckpointInfo]  # the step restored, and its checkpoint's info


@dataclass
class Resuming:
    """One :meth:`~ddpckpt.Checkpointer.resume`, as every tier sees it (the same on every
    rank)."""

    load: Callable[[int | Location], CheckpointInfo]  # restores a step of the run, or a place
    choose: Callable[[dict[int, Any]], list[int]]  # orders the run's committed steps to try
    newest: bool  # the newest checkpoint is wanted (no step=, no best=): any tier may serve
    listing: int = 0  # how many times the tiers were listed before, in this resume
    offers: list[list[int]] = field(default_factory=list)  # each tier's, at the last listing
    failures: list[str] = field(default_factory=list)  # "path: cause", each that failed
    failed: list[int] = field(default_factory=list)  # the run directory's steps that did
    broken: dict[int, str] = field(default_factory=dict)  # incomplete steps: why, by step
    partial: list[PartiallyRestoredError] = field(default_factory=list)  # half-restored

    def load_noting(self, step: int | Location) -> CheckpointInfo:
        """:attr:`load`, noting a load that left the objects partly restored."""
        try:
            return self.load(step)
        except PartiallyRestoredError as exc:
            self.partial.append(exc)
            raise


class Tier(Protocol):
    """What the Checkpointer and :func:`~ddpckpt._run.resume.resume_run` ask of a tier."""

    @property
    def saves(self) -> RunSaves:
        """Its write side: its run directory, host buffer, newest step."""

    def due(self, step: int) -> bool:
        """Local: whether its own schedule asks for ``step``."""

    def save(
        self,
        step: int,
        header: dict[str, Any],
        capture: Callable[[], Snapshot],
        synchronous: bool,
        borrow: AsyncSaver | None,
    ) -> str | None:
        """Collective: save ``step``; its path, or ``None`` if the save failed (reported).
        ``borrow``: another tier's saver that staged the same snapshot."""

    def offer(self, resuming: Resuming) -> list[int]:
        """Collective: list the tier; the steps it may serve this resume, newest first."""

    def restore(self, steps: list[int], resuming: Resuming, more: bool) -> Loaded | None:
        """Collective: restore the first of ``steps`` (offered by :meth:`offer`, newest
        first) that every rank can restore; ``None`` if none can (each failure reported and
        added to ``resuming``). ``more``: whether other steps are left to try after these."""

    def resumed(self, loaded: Loaded | None, server: Tier | None, resuming: Resuming) -> None:
        """Collective, once a tier ``server`` restored ``loaded`` (``None`` for both: a fresh
        start): tidy up, and say what a user should know about this tier's part."""

    def settle(self) -> None:
        """Collective: wait for its save in flight; handle its failure on every rank."""

    def report_locally(self) -> None:
        """Local: wait for its save in flight; report its failure here."""

    def close(self) -> None:
        """Local: wait for its save in flight, free its host buffer, release its lock."""
