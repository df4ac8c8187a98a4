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

Storage (:class:`StorageOptions`): ``sharing`` says whether the nodes share the directory
(``"auto"``, ``"shared"`` or ``"local"``; see :mod:`ddpckpt._coord.topology`), ``timeout`` bounds every collective wait, ``lock_stale_after`` is when
a lock whose holder stopped refreshing it may be taken over, and ``read_only`` opens a run
another job writes: no lock, nothing cleaned, moved or written.

The fast tier (:class:`FastTier`, ``fast_tier``): a second, node-local directory in host
memory that ``save()`` writes as often as every step, which ``resume()`` prefers when it
holds a newer step than the durable run directory (see :mod:`ddpckpt._run.fast_tier`).
"""

from __future__ import annotations

import hashlib
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ddpckpt._coord.limits import resolve_timeout
from ddpckpt._coord.topology import resolve_storage_mode
from ddpckpt._io.async_saver import async_mode
from ddpckpt._run.signals import Preemption, grace_period
from ddpckpt._state.training_state import TrainingState
from ddpckpt.policies import Retention, SavePolicy, _keeping, _schedule


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
class StorageOptions:
    """Where and how the run directory is used."""

    sharing: str | None  # "auto", "shared" or "local"
    timeout: float | None
    lock_stale_after: float
    read_only: bool
    partners: int | None = None  # node-local storage: the domains keeping each one's rank files


@dataclass(frozen=True)
class FastTier:
    """``Checkpointer(fast_tier=...)``: a checkpoint in every node's host memory, as often as
    every step, that a restarted job resumes from (a directory alone means its defaults).

    Every rank passes the same options; the Checkpointer checks them when it is made (the
    fast-tier page of the documentation shows it used).

    Attributes:
        directory: The same path on every node, in node-local memory that outlives the
            worker processes (a tmpfs such as ``/dev/shm/<job>``); each node keeps there
            a complete copy of the newest steps' shared state (model, optimizer), with its
            own ranks' files and those of the ``partners`` nodes before it. Not a
            URL, and neither inside the run directory nor holding it. ``None`` (or
            ``fast_tier="auto"``): ``/dev/shm/ddpckpt-<uid>-<hash of the run's identity>``,
            named by the first ``resume()`` or ``save()`` (:func:`auto_directory`): the same
            on every node and at every launch of a job writing the same run directory,
            another for another run directory or user (a directory named ``auto`` is
            ``"./auto"``).
        every_steps: The steps whose ``save()`` it takes (every step by default;
            :meth:`~ddpckpt.Checkpointer.should_save` says True then).
        keep: How many steps it keeps (1 by default; one more while a save is written).
        overlap: Whether a fast save with an optimizer copies parameters and optimizer
            state during the next forward/backward (``async_save="overlap"``; the default),
            or before ``save()`` returns (``async_save=True``: the training thread waits
            for the copy, and ``optimizer.step()`` is never held up by it).
        partners: How many other nodes keep a copy of each node's own files (its ranks'
            random streams, data position and other per-rank state), 1 by default: the
            nodes after it in the ring of nodes. A fast save costs each node that many
            transfers, whatever the number of nodes, and a resume survives the loss of
            any ``partners`` neighbouring nodes (a replaced node receives its ranks' files
            from a partner); more partners survive more, at more memory and transfers.

    The directory is this user's alone: created ``0700`` (its files ``0600``); an
    existing one that is a symbolic link, another user's, or writable by its group or
    others is refused (an ERROR; the job goes on with the durable tier), never read or
    written. See the fast-tier page of the documentation.

    Raises:
        ValueError: From the ``Checkpointer``: ``every_steps`` or ``keep`` is not a
            positive int, ``overlap`` is not a bool, ``directory`` is a URL or nests with
            the run directory (links resolved), or the Checkpointer is ``read_only``.
    """

    directory: str | os.PathLike[str] | None = None
    every_steps: int = 1
    keep: int = 1
    overlap: bool = True
    partners: int = 1

    @classmethod
    def of(cls, value: str | os.PathLike[str] | FastTier | None) -> FastTier | None:
        """The options ``Checkpointer(fast_tier=value)`` stands for (``None``: no fast tier)."""
        if value is None or isinstance(value, FastTier):
            return value
        if value == AUTO:
            return cls(None)
        if isinstance(value, (str, os.PathLike)):
            return cls(value)
        raise TypeError(
            "fast_tier must be a directory, 'auto' or a ddpckpt.FastTier, got "
            f"{type(value).__qualname__}"
        )

    def check(self, durable: str, read_only: bool) -> None:
        """Refuse what this fast tier cannot be next to the durable run directory ``durable``."""
        if read_only:
            raise ValueError("fast_tier= saves checkpoints; a read_only Checkpointer cannot")
        if self.directory is None:
            if not os.path.isdir(AUTO_ROOT):
                raise ValueError(
                    f"fast_tier='auto' keeps the fast tier under {AUTO_ROOT}, which this "
                    "machine lacks: give fast_tier= a directory in node-local memory (a tmpfs)"
                )
            directory = auto_directory("")  # any run's: its parent is what may nest
        else:
            directory = os.fspath(self.directory)
        if "://" in directory:
            raise ValueError(
                f"fast_tier must be a directory on each node (a tmpfs such as /dev/shm/<job>), "
                f"got {directory!r}"
            )
        for name, value in (
            ("every_steps", self.every_steps),
            ("keep", self.keep),
            ("partners", self.partners),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"FastTier({name}=...) must be a positive int, got {value!r}")
        if type(self.overlap) is not bool:
            raise ValueError(f"FastTier(overlap=...) must be True or False, got {self.overlap!r}")
        if "://" not in durable and nests(directory, durable):
            raise ValueError(
                f"fast_tier {directory!r} and the run directory {durable!r} must not hold "
                "one another (symbolic links resolved): the fast tier is a directory of its "
                "own (in host memory)"
            )


AUTO = "auto"  # fast_tier="auto": FastTier(directory=None)
AUTO_ROOT = "/dev/shm"  # node-local memory that outlives the workers, on Linux


def auto_directory(identity: str, uid: int | None = None) -> str:
    """The fast tier ``fast_tier="auto"`` names for the run whose identity (the run
    directory's ``fast-tier-owner``) is ``identity``, for the user ``uid`` (this process's
    by default): ``/dev/shm/ddpckpt-<uid>-<16 hex digits of its SHA-256>``. Local, pure."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return os.path.join(AUTO_ROOT, f"ddpckpt-{os.getuid() if uid is None else uid}-{digest}")


def nests(a: str, b: str) -> bool:
    """Whether the local paths ``a`` and ``b`` are one directory or one holds the other,
    once symbolic links are resolved (``os.path.realpath``; what does not exist yet is
    taken as written)."""
    real_a, real_b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([real_a, real_b]) in (real_a, real_b)


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every option of a Checkpointer, grouped (see the module docstring)."""

    schedule: Schedule
    keeping: Keeping
    failures: FailureHandling
    asynchronous: Asynchronous
    storage: StorageOptions
    fast_tier: FastTier | None = None


@dataclass(frozen=True, kw_only=True)
class Arguments:
    """The Checkpointer's option keywords as given, with their defaults: the one list of
    them (a test checks it against ``Checkpointer.__init__``'s signature)."""

    keep_last: int | None = 3
    keep_best: int | None = None
    monitor: str | None = None
    mode: str = "min"
    every_steps: int | None = None
    every_seconds: float | None = None
    save_policy: SavePolicy | None = None
    retention: Retention | None = None
    on_error: str = "warn"
    retries: int = 2
    retry_backoff: float = 1.0
    async_save: bool | str = False
    sharing: str | None = None
    timeout: float | None = None
    lock_stale_after: float = 600.0
    read_only: bool = False
    preemption: bool | Preemption = False
    fast_tier: str | os.PathLike[str] | FastTier | None = None

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Arguments:
        """The arguments among ``given`` (a call's ``locals()``), by name."""
        return cls(**{f.name: given[f.name] for f in fields(cls)})


def resolve(
    arguments: Arguments = Arguments(),
    *,
    state: TrainingState | None = None,
    directory: str = "",
) -> CheckpointerOptions:
    """The grouped options of ``Checkpointer(**arguments)``; raises ``ValueError`` or
    ``TypeError`` naming the argument for anything it cannot honour. Local, no side effects.
    ``state``: the objects saved (``async_save="overlap"`` needs an optimizer in it);
    ``directory``: the run directory (the fast tier must be another)."""
    a = arguments
    if a.on_error not in ("warn", "raise"):
        raise ValueError(f"on_error must be 'warn' or 'raise', got {a.on_error!r}")
    if type(a.retries) is not int or a.retries < 0:
        raise ValueError(f"retries must be a non-negative int, got {a.retries!r}")
    _check_seconds("retry_backoff", a.retry_backoff, zero=True)
    _check_seconds("every_seconds", a.every_seconds)
    _check_seconds("timeout", a.timeout)
    _check_seconds("lock_stale_after", a.lock_stale_after)
    resolve_storage_mode(a.sharing)  # "auto", "shared", "local" (or $DDPCKPT_STORAGE)
    resolve_timeout(a.timeout)  # or $DDPCKPT_TIMEOUT
    _check_policy("save_policy", a.save_policy, SavePolicy, every_steps=a.every_steps,
                  every_seconds=a.every_seconds)  # fmt: skip
    _check_policy("retention", a.retention, Retention, keep_best=a.keep_best, monitor=a.monitor)
    if a.mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {a.mode!r}")
    if a.monitor is not None and a.keep_best is None and a.retention is None:
        raise ValueError("monitor= only matters with keep_best=; pass keep_best=K as well")
    overlap = async_mode(a.async_save, state if state is not None else TrainingState())
    watched = Preemption.of(a.preemption)
    if watched is not None:
        if a.read_only:
            raise ValueError("preemption= saves a checkpoint; a read_only Checkpointer cannot")
        watched.signal_numbers()  # a bad value fails now, not at the signal
        grace_period(watched.grace_seconds)
    fast = FastTier.of(a.fast_tier)
    if fast is not None:
        fast.check(directory, a.read_only)
    return CheckpointerOptions(
        schedule=Schedule(a.save_policy or _schedule(a.every_steps, a.every_seconds), watched),
        keeping=Keeping(
            a.retention or _keeping(a.keep_last, a.keep_best, a.monitor, a.mode), a.mode
        ),
        failures=FailureHandling(a.on_error, a.retries, a.retry_backoff),
        asynchronous=Asynchronous(bool(a.async_save), overlap),
        storage=StorageOptions(a.sharing, a.timeout, a.lock_stale_after, a.read_only),
        fast_tier=fast,
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
