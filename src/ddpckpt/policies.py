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
    "KeepAnyOf",
    "KeepBest",
    "KeepLast",
    "Never",
    "Record",
    "Retention",
    "SavePolicy",
]
# Earlier names: the retention union (shadowing typing.Union), and the Checkpointer's own
# factories, which are internal now (each old name warns; see __getattr__).
_RENAMED = {"Union": "KeepAnyOf"}
_INTERNAL = ("schedule", "keeping", "retention_from", "best_first")


class SavePolicy(ABC):
    """Decides whether to save at a step; subclass it for a schedule of your own.

    Pass an instance as ``Checkpointer(save_policy=...)``. The Checkpointer asks it from
    :meth:`~ddpckpt.Checkpointer.should_save`, which every rank calls at the same steps;
    every rank holds its own instance. Policies whose answer depends on the clock (or on
    anything else that can differ between ranks) set ``needs_agreement``: the
    Checkpointer then asks rank 0's instance only and sends its answer to every rank, so
    the ranks never disagree.

    Attributes:
        needs_agreement: Whether rank 0 alone decides for every rank (``False``: each
            rank asks its own instance, which must then answer the same on every rank).
    """

    needs_agreement: bool = False

    @abstractmethod
    def should_save(self, step: int, now: float) -> bool:
        """Whether to save at ``step``; called once per :meth:`Checkpointer.should_save
        <ddpckpt.Checkpointer.should_save>` call that is not answered already (a step not
        newer than the last save, or a preemption, decides without asking).

        Args:
            step: The training step the loop passed.
            now: ``time.monotonic()`` on the calling rank.

        Returns:
            True to save at this step.
        """

    def saved(self, step: int, now: float) -> None:  # noqa: B027 - optional hook
        """Hook called on every rank after each save the Checkpointer made, and after a
        resume (with the step loaded); does nothing unless overridden.

        Args:
            step: The step saved or resumed.
            now: ``time.monotonic()`` on the calling rank.
        """


@dataclass
class EverySteps(SavePolicy):
    """Save when ``step`` is a multiple of ``n`` (``Checkpointer(every_steps=n)``).

    Attributes:
        n: The interval, in steps.

    Raises:
        ValueError: ``n`` is not a positive int.
    """

    n: int

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"every_steps must be a positive int, got {self.n!r}")

    def should_save(self, step: int, now: float) -> bool:
        return step % self.n == 0


@dataclass
class EverySeconds(SavePolicy):
    """Save when ``seconds`` have passed since the last save (or resume, or the first
    question) (``Checkpointer(every_seconds=seconds)``).

    It sets ``needs_agreement``: rank 0's clock decides for every rank.

    Attributes:
        seconds: The interval, in seconds.

    Raises:
        ValueError: ``seconds`` is not positive.
    """

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
    """Save when any of ``policies`` says so; every one of them is asked each time.

    Rank 0 decides for every rank if any of them sets ``needs_agreement``.

    Args:
        *policies: The policies to combine.
    """

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
    """What a :class:`Retention` knows of a committed checkpoint.

    Attributes:
        step: The checkpoint's step.
        metrics: The metrics passed to :meth:`Checkpointer.save
            <ddpckpt.Checkpointer.save>` for it (empty if none).
    """

    step: int
    metrics: Mapping[str, Any]


class Retention(ABC):
    """Chooses which committed checkpoints to keep; subclass it for a rule of your own.

    Pass an instance as ``Checkpointer(retention=...)``. After each save commits, the
    Checkpointer calls :meth:`keep` on the rank that writes the run directory (rank 0 on
    shared storage; the first rank of each node on node-local storage), under the run's
    lock, and deletes the committed checkpoints it does not keep. The newest one is always
    kept as well, whatever :meth:`keep` says, and others are deleted only after a newer
    checkpoint is committed. Its methods must not raise: an error here is no storage
    failure, and reaches the caller of the save.
    """

    @abstractmethod
    def keep(self, records: Sequence[Record]) -> set[int]:
        """The steps to keep.

        Args:
            records: Every committed checkpoint of the run, in no particular order.

        Returns:
            The steps of those to keep; the others are deleted (the newest never is).
        """

    def describe(self) -> dict[str, Any]:
        """The policy as JSON-compatible data, written to the run's ``run.json`` by the
        first save of a job, so that ``ddpckpt ls`` can show :meth:`why_kept` notes.

        Only the built-in policies are rebuilt from it (:func:`retention_from`); the
        default, ``{"type": <class name>}``, shows no notes.

        Returns:
            A dict with at least ``"type"``.
        """
        return {"type": type(self).__name__}

    def why_kept(self, records: Sequence[Record]) -> dict[int, str]:
        """Steps this policy keeps for a reason worth showing (``ddpckpt ls``), such as
        ``"best #1 by loss"``; keeping the newest ones needs no note.

        Args:
            records: Every committed checkpoint of the run.

        Returns:
            A note by step; empty by default.
        """
        return {}


@dataclass
class KeepAll(Retention):
    """Keep every checkpoint (``Checkpointer(keep_last=None)``)."""

    def keep(self, records: Sequence[Record]) -> set[int]:
        return {r.step for r in records}


@dataclass
class KeepLast(Retention):
    """Keep the ``n`` newest checkpoints (``Checkpointer(keep_last=n)``).

    Attributes:
        n: How many to keep.

    Raises:
        ValueError: ``n`` is not a positive int.
    """

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
    """Keep the ``k`` checkpoints with the best ``monitor`` metric
    (``Checkpointer(keep_best=k, monitor=..., mode=...)``).

    Checkpoints without the metric, or with a NaN, infinite or non-numeric value, never
    count as best; ties go to the newer checkpoint.

    Attributes:
        k: How many to keep.
        monitor: The name of a metric passed to :meth:`Checkpointer.save
            <ddpckpt.Checkpointer.save>`.
        mode: ``"min"`` or ``"max"``: which direction is better.

    Raises:
        ValueError: ``k`` is not a positive int, ``monitor`` is empty or not a string, or
            ``mode`` is neither ``"min"`` nor ``"max"``.
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
        """The steps of the (at most ``k``) best checkpoints.

        Args:
            records: The checkpoints to rank.

        Returns:
            Their steps, best first.
        """
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


class KeepAnyOf(Retention):
    """Keep what any of ``policies`` keeps.

    Args:
        *policies: The policies to combine.
    """

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
        # "Union": the name run.json files have held since the first release
        return {"type": "Union", "policies": [p.describe() for p in self.policies]}


def _retention_from(description: Mapping[str, Any]) -> Retention | None:
    """Rebuild a built-in retention policy from what its :meth:`Retention.describe` said
    (``ddpckpt ls`` does, from ``run.json``); local.

    Args:
        description: The dict :meth:`Retention.describe` returned.

    Returns:
        The policy, or ``None`` for a ``"type"`` it does not know (a policy of your own).
        A :class:`KeepAnyOf` drops the parts it does not know.

    Raises:
        KeyError: A built-in type's field is missing.
        ValueError: A field is invalid (as the policy's constructor checks).
    """
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
        parts = [_retention_from(p) for p in description.get("policies", [])]
        return KeepAnyOf(*(p for p in parts if p is not None))
    return None


class Never(SavePolicy):
    """No schedule: :meth:`should_save` is always False; call
    :meth:`Checkpointer.save <ddpckpt.Checkpointer.save>` yourself.

    The Checkpointer's default when neither ``every_steps`` nor ``every_seconds`` is given.
    """

    def should_save(self, step: int, now: float) -> bool:
        return False


def _schedule(every_steps: int | None, every_seconds: float | None) -> SavePolicy:
    """The save policy of ``Checkpointer(every_steps=..., every_seconds=...)``; local.

    Args:
        every_steps: An :class:`EverySteps` interval, or ``None``.
        every_seconds: An :class:`EverySeconds` interval, or ``None``.

    Returns:
        One of them, :class:`AnyOf` both, or :class:`Never` when both are ``None``.

    Raises:
        ValueError: An interval that is not positive.
    """
    policies: list[SavePolicy] = []
    if every_steps is not None:
        policies.append(EverySteps(every_steps))
    if every_seconds is not None:
        policies.append(EverySeconds(every_seconds))
    if not policies:
        return Never()
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def _keeping(
    keep_last: int | None, keep_best: int | None, monitor: str | None, mode: str
) -> Retention:
    """The retention of ``Checkpointer(keep_last=..., keep_best=..., monitor=..., mode=...)``;
    local.

    Args:
        keep_last: A :class:`KeepLast` count; ``None`` keeps all (:class:`KeepAll`).
        keep_best: A :class:`KeepBest` count, or ``None``.
        monitor: The metric ``keep_best`` ranks by.
        mode: ``"min"`` or ``"max"``.

    Returns:
        The policy; a :class:`KeepAnyOf` of both when ``keep_best`` is given.

    Raises:
        ValueError: ``keep_best`` without ``monitor``, or an invalid count or ``mode``.
    """
    parts: list[Retention] = [KeepLast(keep_last) if keep_last is not None else KeepAll()]
    if keep_best is not None:
        if monitor is None:
            raise ValueError("keep_best needs monitor=, the name of a metric passed to save()")
        parts.append(KeepBest(keep_best, monitor, mode))
    return parts[0] if len(parts) == 1 else KeepAnyOf(*parts)


def _best_first(committed: Mapping[int, Mapping[str, Any]], metric: str, mode: str) -> list[int]:
    """Rank checkpoints by a metric, as ``Checkpointer.resume(best=...)`` does; local.

    Args:
        committed: The metrics of each checkpoint, by step.
        metric: The metric's name.
        mode: ``"min"`` or ``"max"``: which direction is better.

    Returns:
        The steps with a finite numeric ``metric``, best first (ties: the newer first).

    Raises:
        ValueError: An empty ``metric``, or ``mode`` neither ``"min"`` nor ``"max"``.
    """
    records = [Record(step, dict(metrics)) for step, metrics in committed.items()]
    return KeepBest(max(len(records), 1), metric, mode).best(records)


def __getattr__(name: str) -> Any:
    """Earlier names, each with a DeprecationWarning naming what replaced it."""
    from ddpckpt._deprecation import warn_renamed

    if name in _RENAMED:
        warn_renamed(f"ddpckpt.policies.{name}", f"ddpckpt.policies.{_RENAMED[name]}")
        return globals()[_RENAMED[name]]
    if name in _INTERNAL:
        warn_renamed(
            f"ddpckpt.policies.{name}",
            "Checkpointer(every_steps=..., every_seconds=..., keep_last=..., keep_best=...) or "
            "the policy classes (it is internal now)",
        )
        return globals()[f"_{name}"]
    raise AttributeError(f"module 'ddpckpt.policies' has no attribute {name!r}")
