"""When to save and which checkpoints to keep: small policies that compose.

A :class:`SavePolicy` answers ``should_save(step, now)``; a :class:`Retention` picks the
steps to keep from the committed checkpoints. :class:`~ddpckpt.Checkpointer` builds
them from its ``every_steps``/``every_seconds``/``keep_last``/``keep_best`` arguments, or
takes your own.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AnyOf",
    "EverySeconds",
    "EverySteps",
    "KeepAll",
    "KeepBest",
    "KeepLast",
    "Never",
    "Record",
    "Retention",
    "SavePolicy",
    "Union",
    "best_first",
    "keeping",
    "retention_from",
    "schedule",
]


class SavePolicy(ABC):
    """Decides whether to save at a step.

    Policies whose answer depends on the clock set ``needs_agreement``: the Checkpointer
    then takes rank 0's answer on every rank, so ranks never disagree.
    """

    needs_agreement: bool = False

    @abstractmethod
    def should_save(self, step: int, now: float) -> bool: ...

    def saved(self, step: int, now: float) -> None:  # noqa: B027 - optional hook
        """Called after every save (or resume), with the step and the monotonic time."""


@dataclass
class EverySteps(SavePolicy):
    """Save when ``step`` is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"every_steps must be a positive int, got {self.n!r}")

    def should_save(self, step: int, now: float) -> bool:
        return step % self.n == 0


@dataclass
class EverySeconds(SavePolicy):
    """Save when ``seconds`` have passed since the last save (or resume, or start)."""

    seconds: float
    needs_agreement = True

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"every_seconds must be positive, got {self.seconds!r}")
        self._last: float | None = None

    def should_save(self, step: int, now: float) -> bool:
        if self._last is None:
            self._last = now
        return now - self._last >= self.seconds

    def saved(self, step: int, now: float) -> None:
        self._last = now


class AnyOf(SavePolicy):
    """Save when any of the policies says so."""

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = policies
        self.needs_agreement = any(p.needs_agreement for p in policies)

    def should_save(self, step: int, now: float) -> bool:
        return any([p.should_save(step, now) for p in self.policies])  # ask each: clocks start

    def saved(self, step: int, now: float) -> None:
        for policy in self.policies:
            policy.saved(step, now)


@dataclass(frozen=True)
class Record:
    """What retention knows of a committed checkpoint."""

    step: int
    metrics: Mapping[str, Any]


class Retention(ABC):
    """Chooses which committed checkpoints to keep.

    The Checkpointer always keeps the newest one as well, and deletes others only after
    a newer checkpoint is committed.
    """

    @abstractmethod
    def keep(self, records: Sequence[Record]) -> set[int]: ...

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__}

    def why_kept(self, records: Sequence[Record]) -> dict[int, str]:
        """Steps this policy keeps for a reason worth showing (``ddpckpt ls``), e.g.
        ``"best #1 by loss"``; keeping the newest ones needs no note."""
        return {}


@dataclass
class KeepAll(Retention):
    def keep(self, records: Sequence[Record]) -> set[int]:
        return {r.step for r in records}


@dataclass
class KeepLast(Retention):
    """The ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"keep_last must be a positive int or None, got {self.n!r}")

    def keep(self, records: Sequence[Record]) -> set[int]:
        return {r.step for r in sorted(records, key=lambda r: r.step)[-self.n :]}

    def describe(self) -> dict[str, Any]:
        return {"type": "KeepLast", "n": self.n}


@dataclass
class KeepBest(Retention):
    """The ``k`` checkpoints with the best ``monitor`` metric (``mode`` ``"min"``/``"max"``).

    Checkpoints without the metric, or with a NaN or infinite value, never count as best;
    ties go to the newer checkpoint.
    """

    k: int
    monitor: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if type(self.k) is not int or self.k < 1:
            raise ValueError(f"keep_best must be a positive int or None, got {self.k!r}")
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError("keep_best needs monitor=, the name of a metric passed to save()")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def best(self, records: Sequence[Record]) -> list[int]:
        """The steps of the best checkpoints, best first."""
        scored = []
        for record in records:
            value = record.metrics.get(self.monitor)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                scored.append((value if self.mode == "min" else -value, -record.step))
        return [-step for _, step in sorted(scored)[: self.k]]

    def keep(self, records: Sequence[Record]) -> set[int]:
        return set(self.best(records))

    def why_kept(self, records: Sequence[Record]) -> dict[int, str]:
        return {
            step: f"best #{i + 1} by {self.monitor}" for i, step in enumerate(self.best(records))
        }

    def describe(self) -> dict[str, Any]:
        return {"type": "KeepBest", "k": self.k, "monitor": self.monitor, "mode": self.mode}


class Union(Retention):
    """Keep what any of the policies keeps."""

    def __init__(self, *policies: Retention) -> None:
        self.policies = policies

    def keep(self, records: Sequence[Record]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(records)
        return kept

    def why_kept(self, records: Sequence[Record]) -> dict[int, str]:
        notes: dict[int, str] = {}
        for policy in self.policies:
            notes.update(policy.why_kept(records))
        return notes

    def describe(self) -> dict[str, Any]:
        return {"type": "Union", "policies": [p.describe() for p in self.policies]}


def retention_from(description: Mapping[str, Any]) -> Retention | None:
    """Rebuild a retention policy from :meth:`Retention.describe` (for ``ddpckpt ls``)."""
    kind = description.get("type")
    if kind == "KeepLast":
        return KeepLast(int(description["n"]))
    if kind == "KeepBest":
        return KeepBest(
            int(description["k"]), str(description["monitor"]), str(description["mode"])
        )
    if kind == "KeepAll":
        return KeepAll()
    if kind == "Union":
        parts = [retention_from(p) for p in description.get("policies", [])]
        return Union(*(p for p in parts if p is not None))
    return None


class Never(SavePolicy):
    """No schedule: ``should_save`` is always False (call ``Checkpointer.save`` yourself)."""

    def should_save(self, step: int, now: float) -> bool:
        return False


def schedule(every_steps: int | None, every_seconds: float | None) -> SavePolicy:
    """The save policy of ``Checkpointer(every_steps=..., every_seconds=...)``."""
    policies: list[SavePolicy] = []
    if every_steps is not None:
        policies.append(EverySteps(every_steps))
    if every_seconds is not None:
        policies.append(EverySeconds(every_seconds))
    if not policies:
        return Never()
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def keeping(
    keep_last: int | None, keep_best: int | None, monitor: str | None, mode: str
) -> Retention:
    """The retention of ``Checkpointer(keep_last=..., keep_best=..., monitor=..., mode=...)``."""
    parts: list[Retention] = [KeepLast(keep_last) if keep_last is not None else KeepAll()]
    if keep_best is not None:
        if monitor is None:
            raise ValueError("keep_best needs monitor=, the name of a metric passed to save()")
        parts.append(KeepBest(keep_best, monitor, mode))
    return parts[0] if len(parts) == 1 else Union(*parts)


def best_first(committed: Mapping[int, Mapping[str, Any]], metric: str, mode: str) -> list[int]:
    """The steps with a finite ``metric``, best first (ties: the newer first)."""
    records = [Record(step, dict(metrics)) for step, metrics in committed.items()]
    return KeepBest(max(len(records), 1), metric, mode).best(records)
