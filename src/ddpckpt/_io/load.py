"""The collective :func:`load`: find the checkpoint on every rank, check, then restore.

``load`` is collective under ``torch.distributed``: every rank calls it, in the same order,
with the same arguments (rank 0's path is used everywhere); it works unchanged in a single
process. It finds the checkpoint on every rank (repairing node-local copies,
:mod:`ddpckpt._coord.replicate`), checks every object against it, then reads checksum-verified
tensors (:class:`~ddpckpt._io.reader.FileSource`) into the live objects
(:mod:`ddpckpt._io.restore`, through :mod:`ddpckpt._state`). A failure on any rank raises
the same error on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ddpckpt import _observe
from ddpckpt._coord.comm import Comm
from ddpckpt._format.manifest import Manifest, read_manifest
from ddpckpt._format.rankparts import rank_has, rank_part
from ddpckpt._io.async_saver import DEFAULT_SAVER, wait_for_live_copies
from ddpckpt._io.load_checks import check_state
from ddpckpt._io.progress import Progress
from ddpckpt._io.reader import CheckpointInfo, FileSource, read_metrics
from ddpckpt._io.restore import Began, restore_objects
from ddpckpt._io.world_change import note_fewer_ranks
from ddpckpt._log import get_logger
from ddpckpt._observe import Access, Loaded
from ddpckpt._state.capture import TrainingState
from ddpckpt._state.partial import clear, mark
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PartiallyRestoredError,
    RankFailureError,
    error_class,
)
from ddpckpt.storage._location import Location
from ddpckpt.storage._registry import configure

_log = get_logger(__name__)

T = TypeVar("T")


def load(
    path: str | os.PathLike[str],
    state: TrainingState | None = None,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: MutableMapping[str, Any] | None = None,
    strict: bool = True,
    rng: bool | None = None,
    timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Restore the checkpoint at ``path`` into the live objects; collective.

    Every rank calls it, in the same order as its other ddpckpt calls, after building its
    model, optimizer etc. (before or after wrapping in DDP or ``torch.compile``), passed as
    a :class:`~ddpckpt.TrainingState` or its keyword shorthand, as to
    :func:`ddpckpt.save`. Tensors are read straight into the live tensors (the model's, and
    an optimizer's once it has state), so they land on each rank's own devices and a load
    holds no second copy of the state. Every byte read is verified against its checksum,
    and every check runs, on every rank, before anything is modified. It first waits until
    every save in flight in this process (of :func:`ddpckpt.save` and of every
    :class:`~ddpckpt.Checkpointer`) has copied the tensors it saves, so that none of them
    holds loaded values.

    Objects not passed are left alone; an object passed but absent from the checkpoint is
    an error naming it. Stateful ``extra`` objects get ``load_state_dict``; plain values
    are written back into the ``extra`` mapping (or the TrainingState) and returned in
    :attr:`CheckpointInfo.extra <ddpckpt.CheckpointInfo.extra>`.

    Args:
        path: A committed checkpoint directory (or URL).
        state: The objects to restore, by the names they were saved under.
        model: The model (plain, DDP, DataParallel or compiled).
        optimizer: Its optimizer.
        scheduler: Its learning-rate scheduler.
        scaler: Its ``GradScaler``.
        extra: Names mapped to stateful objects or plain values, as saved.
        strict: ``False`` loads the model keys that match and warns about the rest.
        rng: Restore each rank's random generators (default: if saved). Ranks the
            checkpoint has no state for get a deterministic derived state and a warning.
        timeout: Seconds a rank waits for a silent one.
        storage_options: Configures an ``s3://`` URL's client (endpoint, region,
            credentials: :meth:`S3Storage.from_options <ddpckpt.storage.s3.S3Storage.from_options>`).

    Returns:
        The checkpoint's metadata and plain ``extra`` values.

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
        StateMismatchError: The objects do not match the checkpoint (lists every
            difference).
        CorruptCheckpointError: A file does not match its checksum (names it), found
            before anything was written into the objects.
        PartiallyRestoredError: The load failed (the error chained as ``__cause__``, e.g. a
            :class:`CorruptCheckpointError` for a file found damaged while it was read)
            after it began writing into the objects, on any rank: tensors are read straight
            into the live ones, so the objects hold part of this checkpoint's state. Load a
            checkpoint into them (:func:`ddpckpt.load_latest` and
            :meth:`Checkpointer.resume <ddpckpt.Checkpointer.resume>` fall back to the
            previous one so) before training on them; saving them raises this error until
            a load into them succeeds.
        CollectiveTimeoutError: A rank did not arrive within ``timeout``.
    """
    path = os.fspath(path)
    configure(path, storage_options)  # an s3:// URL's client
    path = _observe.place(path, "load", Access.READ)  # under check-resume: what its run wrote
    state = TrainingState.coerce(
        state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        extra=extra, rng=rng,
    )  # fmt: skip
    info = load_from(path, state, strict=strict, timeout=timeout)
    note_fewer_ranks(info)
    return info


def load_from(
    place: Location | str,
    state: TrainingState,
    *,
    strict: bool = True,
    timeout: float | None = None,
) -> CheckpointInfo:
    """:func:`load` of the checkpoint at ``place`` into ``state``; collective, as
    :func:`load`. What ``load`` runs with the path it was given (resolved here, inside the
    call), and ``load_latest`` and a ``Checkpointer``'s resume with the locations they
    resolved once."""
    wait_for_live_copies()  # a save in flight (any Checkpointer's) may still copy them
    DEFAULT_SAVER.join()
    with Comm.open("ddpckpt.load", path=str(place), timeout=timeout) as comm:
        comm.run("previous save", DEFAULT_SAVER.raise_unseen)  # every rank raises if one does
        location = comm.locate(place)  # a rank that cannot fails the call everywhere
        path = location.path
        manifest = find_manifest(comm, location)
        with Progress(f"loading {location.name}", manifest.nbytes) as bar:
            source = FileSource(location, manifest, progress=bar)
            own = _unless_changed(
                location, manifest, lambda: own_tensors(manifest, comm.rank, location)
            )
            source.own = comm.run("rank part", own)

            def check() -> None:
                check_state(manifest, source, state, strict, path)
                read_metrics(manifest, path)  # what the info returns: damage found before writing

            comm.run("check", _unless_changed(location, manifest, check))
            began = Began()
            restore = _unless_changed(
                location,
                manifest,
                lambda: restore_objects(
                    manifest, source, state, strict, location, comm.rank, began
                ),
            )
            info = _restore_on_every_rank(comm, path, state, restore, began)
    _observe.tell(Loaded(path, state, info))
    return info


def failure_of(error: BaseException) -> BaseException:
    """What stopped a load: ``error`` itself, or the failure a
    :class:`PartiallyRestoredError` chains. Callers that fall back past a damaged checkpoint
    (``load_latest``, ``Checkpointer.resume``) decide by it: damage falls back (the next
    load restores every object again), a mismatch of the objects is raised."""
    if isinstance(error, PartiallyRestoredError) and error.__cause__ is not None:
        return error.__cause__
    return error


def damage_of(error: BaseException) -> BaseException | None:
    """The damage that stopped a load, which a fallback to another checkpoint steps over
    (:func:`failure_of` ``error``, when it is a damaged or missing checkpoint); ``None``
    for any other failure (the objects do not match it: another would fail too)."""
    cause = failure_of(error)
    return cause if isinstance(cause, (CorruptCheckpointError, CheckpointNotFoundError)) else None


def partly_note(error: BaseException) -> str:
    """What a fallback's warning adds when the failed load had written into the objects."""
    if not isinstance(error, PartiallyRestoredError):
        return ""
    return " (the objects were partly restored from it: loading another restores every one again)"


def none_loaded(
    directory: str, failures: list[str], partial: PartiallyRestoredError | None
) -> CheckpointError:
    """The error when ``directory`` holds checkpoints but none of them loads (``failures``:
    why each failed): a :class:`PartiallyRestoredError` if a failed load (``partial``) left
    the objects partly restored, never "nothing to resume"."""
    listing = "\n  ".join(failures)
    if partial is not None:
        error: CheckpointError = PartiallyRestoredError(
            f"{directory}: holds checkpoints but none can be loaded, and a failed load left "
            "the objects partly restored: load a checkpoint into them (or build them afresh) "
            "before training on or saving them; saving them is refused until a load into "
            f"them succeeds. Why each failed:\n  {listing}"
        )
        error.__cause__ = partial
        return error
    return CorruptCheckpointError(
        f"{directory}: holds checkpoints but none can be loaded:\n  {listing}"
    )


@dataclass
class _Attempt:
    """This rank's restore: its result, or what stopped it."""

    info: CheckpointInfo | None = None
    error: Exception | None = None


def _restore_on_every_rank(
    comm: Comm,
    path: str,
    state: TrainingState,
    restore: Callable[[], CheckpointInfo],
    began: Began,
) -> CheckpointInfo:
    """Run ``restore`` on every rank; collective. Returns this rank's info when it succeeded
    on every rank, and clears the objects' marks (:mod:`ddpckpt._state.partial`).

    If it failed on any rank, every rank raises the same error; and if any rank had begun
    writing into its objects, every rank raises :class:`PartiallyRestoredError` (chaining
    that error) and marks its objects, so that saving them is refused until a load into
    them succeeds. Whether writing began is combined across ranks, not taken per rank: a
    rank that restored everything holds the checkpoint's state while another holds part of
    it, which no checkpoint describes either. A failure before any rank wrote raises what
    it is (e.g. :class:`CorruptCheckpointError`). If the ranks cannot combine it (a rank
    silent or interrupted), each rank decides by its own writes.
    """
    attempt = _Attempt()

    def run() -> dict[str, bool]:
        try:
            attempt.info = restore()
        except Exception as exc:  # raised on every rank below, once every rank says how it went
            attempt.error = exc
        return {"failed": attempt.error is not None, "began": began.writing}

    try:
        verdict = comm.run_reduce("restore", run, _combined)
    except BaseException as exc:
        if began.writing:
            mark(state, path)
            if isinstance(exc, Exception):
                raise _partly_restored(path, exc) from exc
        raise
    if not verdict["failed"] and attempt.info is not None:
        clear(state)  # saving them is allowed again
        return attempt.info

    def fail() -> None:
        if attempt.error is not None:
            raise attempt.error

    try:
        comm.run("restore failed", fail)  # every rank raises what failed (where it failed)
    except Exception as exc:
        if not verdict["began"]:
            raise  # no rank wrote into its objects: as if the load had failed in its checks
        mark(state, path)
        raise _partly_restored(path, exc) from exc
    raise RankFailureError(f"{path}: restoring failed on a rank that did not say why")


def _combined(outcomes: list[dict[str, bool]]) -> dict[str, bool]:
    """Rank 0's reduction of every rank's restore: whether any failed, any began writing."""
    return {key: any(o[key] for o in outcomes) for key in ("failed", "began")}


def _partly_restored(path: str, error: BaseException) -> PartiallyRestoredError:
    """The error of a load that failed (``error``) after it began writing into the objects."""
    partial = PartiallyRestoredError(
        f"{path}: loading failed after it began writing into the objects passed, so they are "
        "partly restored from this checkpoint (part of its state, part of what they held "
        "before). Load a checkpoint into them (the previous one: ddpckpt.load_latest() and "
        "Checkpointer.resume() fall back past a damaged one) before training on or saving "
        f"them; saving them is refused until then. The load failed with: {error}"
    )
    if isinstance(error, CheckpointError):
        partial.failures = error.failures
    return partial


def _unless_changed(
    location: Location, manifest: Manifest, step: Callable[[], T]
) -> Callable[[], T]:
    """``step``, whose missing or damaged file is reported as :class:`CheckpointNotFoundError`
    if the checkpoint at ``location`` is gone or another one by then: the job saving into that
    directory deleted it (its retention) or saved that step again while this process read
    it, which is no corruption."""

    def run() -> T:
        try:
            return step()
        except CorruptCheckpointError as exc:
            try:
                now = read_manifest(location).id
            except (CheckpointNotFoundError, IncompleteCheckpointError):
                now = None  # deleted (an object store's retention removes the manifest first)
            except CorruptCheckpointError:
                now = manifest.id  # the manifest itself is damaged now: the first error stands
            if now == manifest.id:
                raise
            what = "deleted" if now is None else "replaced (that step saved again)"
            raise CheckpointNotFoundError(
                f"{location}: the checkpoint was {what} while it was being loaded, by the job "
                "saving there; load the newest checkpoint again"
            ) from exc

    return run


def find_manifest(comm: Comm, location: Location) -> Manifest:
    """Read the manifest at ``location`` on every rank; collective.

    The decision is the same on every rank: if no rank has a committed checkpoint there,
    :class:`CheckpointNotFoundError` (or the error of an incomplete or corrupt one); if
    some storage domains lack it (node-local disks, a replaced node), they receive a copy
    first (:mod:`ddpckpt._coord.replicate`). Returns this rank's manifest.
    """
    found: dict[str, Manifest] = {}

    def read() -> dict[str, Any]:
        try:
            found["manifest"] = read_manifest(location)
        except CheckpointNotFoundError as exc:  # the message may say what the path is instead
            return {"missing": str(exc)}
        except CorruptCheckpointError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"id": found["manifest"].id}

    verdict = comm.run_reduce("locate", read, lambda statuses: _verdict(statuses, location.path))
    if "error" in verdict:
        raise error_class(verdict["error"])(verdict["message"])
    if not verdict["lacking"]:
        return found["manifest"]
    from ddpckpt._coord.replicate import repair_copies

    lacking = set(verdict["lacking"])
    repair_copies(comm, location, [r not in lacking for r in range(comm.world_size)])
    return comm.run("reread", lambda: read_manifest(location))


def _verdict(statuses: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """Rank 0's decision from every rank's ``locate`` status: an error, or the ranks that lack
    the checkpoint (usually none: every rank then receives a few bytes)."""
    ids = [s.get("id") for s in statuses]
    present = [i for i in ids if i is not None]
    if not present:
        errors = [s for s in statuses if "error" in s]
        if errors:
            return errors[0]
        return {"error": "CheckpointNotFoundError", "message": statuses[0]["missing"]}
    if len(set(present)) > 1:
        listing = ", ".join(f"rank {r}: {i}" for r, i in enumerate(ids) if i is not None)
        return {
            "error": "CorruptCheckpointError",
            "message": f"{path}: ranks see different checkpoints under this name ({listing}); "
            "node-local copies from different runs? Remove the stale ones",
        }
    return {"lacking": [r for r, i in enumerate(ids) if i is None]}


def own_tensors(manifest: Manifest, rank: int, location: Location) -> dict[str, str]:
    """Where ``rank``'s own values are of the shared tensors that differed between ranks at
    save time (parameters DDP ignores, a model without DDP ...): shared name -> stored name.

    Reads ``rank``'s part of the checkpoint (its rank file, nobody else's). A rank that
    did not exist at save time gets none: it loads rank 0's, with a warning.
    """
    if rank < manifest.world_size:
        own = rank_part(manifest, location, rank).get("own", {})
        return {name: f"rank{rank}/{stored}" for name, stored in own.items()}
    rank_part(manifest, location, 0)  # what this rank starts from (RNG, per-rank extras)
    if rank_has(manifest, "own"):
        _log.warning(
            "%s: saved with %d rank%s, some state per rank (it differed between ranks); rank %d "
            "has none stored and starts from rank 0's",
            location,
            manifest.world_size,
            "" if manifest.world_size == 1 else "s",
            rank,
        )
    return {}
