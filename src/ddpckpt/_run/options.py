"""A :class:`~ddpckpt.Checkpointer`'s options, grouped by what they decide and checked once.

The Checkpointer takes them as flat keyword arguments; :func:`resolve` turns those into the
groups below (available read-only as ``Checkpointer.options``) and refuses bad values and
combinations before anything is touched.

When to save (:class:`Schedule`): ``every_steps`` and/or ``every_seconds`` (rank 0's clock
decides), or a :class:`~ddpckpt.policies.SavePolicy` as ``save_policy``; and, with
``preemption``, when the job is told to stop (see :mod:`ddpckpt._run.preemption`).

What to keep (:class:`Keeping`): the ``keep_last`` newest (``None`` keeps all) and, with
``keep_best`` and ``monitor``, the ``keep_best`` best by that metric (``mode`` ``"min"`` or
``"max"``), or a :class:`~ddpckpt.policies.Retention` as ``retention``. The newest committed
checkpoint is always kept; others are deleted only after a newer one is committed.
``mode`` is also the default of ``resume(best=...)`` and ``best()``.

Failures (:class:`FailureHandling`): a save that fails in storage (disk full, I/O error) is
retried ``retries`` times with exponential backoff (``retry_backoff`` seconds, doubling)
when the error is transient, then, with ``on_error="warn"`` (the default), logged as an
ERROR (on stderr unless ``logging`` is configured; by rank 0 and any rank with a failure of
its own) while training goes on; with ``"raise"`` it raises on every rank. Programming
errors (a value that cannot be stored, ranks holding different state) always raise.

Asynchronous saves (:class:`Asynchronous`): with ``async_save=True``, ``save()`` returns
once this rank's share of the state is copied to reusable host buffers; writing, commit,
``latest`` and retention follow in the background (one save in flight; the next call waits
for it). ``async_save="overlap"`` also copies parameters and optimizer state during the next
forward/backward, and ``optimizer.step()`` waits for that copy.

Storage (:class:`Storage`): ``sharing`` says whether the nodes share the directory
(``"auto"``, ``"shared"`` or ``"local"``; see :mod:`ddpckpt._coord.topology`), ``timeout`` bounds every collective wait, ``lock_stale_after`` is when
a lock whose holder stopped refreshing it may be taken over, and ``read_only`` opens a run
another job writes: no lock, nothing cleaned, moved or written.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ddpckpt._coord.limits import resolve_timeout
from ddpckpt._coord.topology import resolve_storage_mode
from ddpckpt._io.async_saver import async_mode
from ddpckpt._run.signals import Preemption, grace_period
from ddpckpt._state.training_state import TrainingState
from ddpckpt.policies import Retention, SavePolicy, keeping, schedule


@dataclass(frozen=True)
class Schedule:
    """When to save: the policy asked at every ``should_save``, and preemption (or ``None``)."""

    policy: SavePolicy
    preemption: Preemption | None


@dataclass(frozen=True)
class Keeping:
    """What to keep after each commit; ``mode`` is the default direction of ``best``."""

    retention: Retention
    mode: str


@dataclass(frozen=True)
class FailureHandling:
    """What a save that fails in storage does: retry transient errors, then warn or raise."""

    on_error: str
    retries: int
    retry_backoff: float


@dataclass(frozen=True)
class Asynchronous:
    """Whether saves finish in the background, and whether the copy overlaps the next step."""

    enabled: bool
    overlap: bool


@dataclass(frozen=True)
class Storage:
    """Where and how the run directory is used."""

    sharing: str | None  # "auto", "shared" or "local"
    timeout: float | None
    lock_stale_after: float
    read_only: bool


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every option of a Checkpointer, grouped (see the module docstring)."""

    schedule: Schedule
    keeping: Keeping
    failures: FailureHandling
    asynchronous: Asynchronous
    storage: Storage


def resolve(
    *,
    state: TrainingState | None = None,
    keep_last: int | None = 3,
    keep_best: int | None = None,
    monitor: str | None = None,
    mode: str = "min",
    every_steps: int | None = None,
    every_seconds: float | None = None,
    save_policy: SavePolicy | None = None,
    retention: Retention | None = None,
    on_error: str = "warn",
    retries: int = 2,
    retry_backoff: float = 1.0,
    async_save: bool | str = False,
    sharing: str | None = None,
    timeout: float | None = None,
    lock_stale_after: float = 600.0,
    read_only: bool = False,
    preemption: bool | Preemption = False,
) -> CheckpointerOptions:
    """The grouped options of ``Checkpointer(**arguments)``; raises ``ValueError`` or
    ``TypeError`` naming the argument for anything it cannot honour. Local, no side effects.
    ``state``: the objects saved (``async_save="overlap"`` needs an optimizer in it)."""
    if on_error not in ("warn", "raise"):
        raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
    if type(retries) is not int or retries < 0:
        raise ValueError(f"retries must be a non-negative int, got {retries!r}")
    _check_seconds("retry_backoff", retry_backoff, zero=True)
    _check_seconds("every_seconds", every_seconds)
    _check_seconds("timeout", timeout)
    _check_seconds("lock_stale_after", lock_stale_after)
    resolve_storage_mode(sharing)  # "auto", "shared", "local" (or $DDPCKPT_STORAGE)
    resolve_timeout(timeout)  # or $DDPCKPT_TIMEOUT
    _check_policy("save_policy", save_policy, SavePolicy, every_steps=every_steps,
                  every_seconds=every_seconds)  # fmt: skip
    _check_policy("retention", retention, Retention, keep_best=keep_best, monitor=monitor)
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if monitor is not None and keep_best is None and retention is None:
        raise ValueError("monitor= only matters with keep_best=; pass keep_best=K as well")
    overlap = async_mode(async_save, state if state is not None else TrainingState())
    watched = Preemption.of(preemption)
    if watched is not None:
        if read_only:
            raise ValueError("preemption= saves a checkpoint; a read_only Checkpointer cannot")
        watched.signal_numbers()  # a bad value fails now, not at the signal
        grace_period(watched.grace_seconds)
    return CheckpointerOptions(
        schedule=Schedule(save_policy or schedule(every_steps, every_seconds), watched),
        keeping=Keeping(retention or keeping(keep_last, keep_best, monitor, mode), mode),
        failures=FailureHandling(on_error, retries, retry_backoff),
        asynchronous=Asynchronous(bool(async_save), overlap),
        storage=Storage(sharing, timeout, lock_stale_after, read_only),
    )


def _check_seconds(name: str, value: object, zero: bool = False) -> None:
    """Refuse a ``name=`` that is not ``None`` nor a positive (or zero) number of seconds."""
    if value is None:
        return
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or not (value >= 0 if zero else value > 0):  # type: ignore[operator]
        kind = "non-negative" if zero else "positive"
        raise ValueError(f"{name} must be a {kind} number of seconds, got {value!r}")


def _check_policy(name: str, policy: object, kind: type, **replaced: object) -> None:
    """Refuse a policy object of the wrong type, or one given with the arguments it replaces."""
    if policy is None:
        return
    if not isinstance(policy, kind):
        raise TypeError(
            f"{name} must be a ddpckpt.policies.{kind.__name__}, got {type(policy).__qualname__}"
        )
    given = [f"{k}=" for k, v in replaced.items() if v is not None]
    if given:
        raise ValueError(f"{name}= replaces {', '.join(given)}; pass one or the other")
