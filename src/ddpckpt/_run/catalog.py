"""Finding and loading the newest checkpoint in a directory, without parsing names.

For code that saves with :func:`ddpckpt.save` under names of its own choosing
(``ckpt/step-{step}``, ``ckpt/epoch{epoch}``, ...); a :class:`~ddpckpt.Checkpointer` run
directory works too. :func:`latest` is local and read-only: any process may call it, also
while a job saves into the directory. :func:`load_latest` is collective, as
:func:`ddpckpt.load`: it loads the newest checkpoint that loads and verifies, falling back
past damaged ones with a warning, so a damaged newest checkpoint never makes every
restart of a job fail the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpckpt import _observe
from ddpckpt._coord.comm import Comm
from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, read_manifest
from ddpckpt._format.runfiles import CORRUPT_MARK
from ddpckpt._io.load import damage_of, load_from, none_loaded, partly_note
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._io.world_change import note_fewer_ranks
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._observe import Access
from ddpckpt._run.rundir import restore_unless_locked
from ddpckpt._state.capture import TrainingState
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    PartiallyRestoredError,
)
from ddpckpt.storage._errors import BucketNotFoundError
from ddpckpt.storage._layout import is_temp_name, previous_of
from ddpckpt.storage._location import Location, locate
from ddpckpt.storage._registry import configure

_log = get_logger(__name__)

SET_ASIDE_MARK = CORRUPT_MARK  # step-N.corrupt-<token>: moved aside by Checkpointer.resume


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest committed checkpoint directly inside ``directory``; local.

    Newest means the highest ``step`` recorded by ``save(..., step=)``; checkpoints saved
    without a step count as older than any with one and are ordered by when they were
    saved. Temporaries of unfinished saves, checkpoints moved aside as corrupt, and
    directories whose manifest is missing, damaged or lists a file that is missing or of
    the wrong size are skipped. A checkpoint that an interrupted overwrite left as
    ``.name.previous`` (on file systems without an atomic exchange) is put back as ``name``
    first, unless a live job holds the directory's lock (then that path is returned). Only
    the manifest and the files' sizes are checked (no data is read): a checkpoint with a
    flipped bit in its data is returned, and found when loaded (or by
    :func:`ddpckpt.verify`); :func:`load_latest` then falls back to the previous one.

    Local: any process may call it alone. Inside a run with a
    :class:`~ddpckpt.Checkpointer`, its :meth:`~ddpckpt.Checkpointer.latest_step` says the
    same as a step; to resume from the newest checkpoint that loads, call
    :func:`load_latest` (collective) instead.

    Args:
        directory: A run directory (or URL).

    Returns:
        The checkpoint's path, or ``None`` when there is none (also when ``directory``
        does not exist).

    Raises:
        FileNotFoundError: An object store's bucket does not exist.
    """
    directory = _observe.place(directory, "latest", Access.LOOKUP)  # check-resume: its own run
    found = newest_first(locate(directory))
    return os.path.join(directory, found[0][-1]) if found else None


Candidate = tuple[bool, int, float, str]  # has a step, step, created, name: newest sorts last


def newest_first(
    location: Location, caller: str = "latest()", *, every_file: bool = True
) -> list[Candidate]:
    """The committed checkpoints directly inside ``directory`` (checked as :func:`latest`
    describes), newest first. Without ``every_file``, of a checkpoint of file tables
    (format 7) only the files its manifest lists itself are checked (the others when they
    are loaded): what every rank of a job can afford, whatever its number of ranks."""
    directory = location.path
    try:
        names = location.storage.list(directory)
    except BucketNotFoundError:
        raise  # None would start a run afresh that can never save there
    except NotADirectoryError:  # None here would start afresh, then fail at the first save
        raise ValueError(
            f"{directory}: is a file, and {caller} looks for checkpoints inside a directory: "
            "pass the directory your saves go to, or move this file away"
        ) from None
    except FileNotFoundError:
        return []
    if MANIFEST_NAME in names:  # None here would start the run afresh
        raise ValueError(
            f"{directory}: is a checkpoint itself, and {caller} looks for checkpoints inside a "
            f"directory: pass the directory that holds it ({os.path.dirname(directory) or '.'}) "
            "or load this checkpoint directly"
        )
    names = restore_unless_locked(location, names)
    found: list[Candidate] = []
    for name in names:
        if is_temp_name(name) or SET_ASIDE_MARK in name:
            continue
        if (replaced := previous_of(name)) is not None and replaced in names:
            continue  # a replaced copy: the checkpoint is the one under its own name
        manifest = _committed(location.join(name), caller, every_file)
        if manifest is not None:
            found.append(candidate(name, manifest))
    return sorted(found, reverse=True)


def candidate(name: str, manifest: Manifest) -> Candidate:
    """How :func:`newest_first` ranks the checkpoint ``name`` whose manifest is
    ``manifest``: by its saved step (none counts as older than any), then when it was
    saved, then by name; pure, so that ``ddpckpt ls`` orders rows as the selection does."""
    step = manifest.step
    return (step is not None, step or 0, manifest.created, name)


def load_latest(
    directory: str | os.PathLike[str],
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
) -> CheckpointInfo | None:
    """Load the newest checkpoint in ``directory`` that loads and verifies; ``None`` when
    it holds none. Collective, as :func:`ddpckpt.load`, which takes the same arguments
    (``model=``, ``optimizer=``, ... or a :class:`TrainingState`).

    Every rank lists the directory (as :func:`latest` checks it, but of a checkpoint of
    more than 128 ranks only the files its manifest lists itself: the others are checked as
    they are loaded) and the lists are merged, so a node whose disk lacks a checkpoint
    still loads it (a copy is sent to it). The
    newest is loaded, every byte read verified; if it is damaged (a checksum fails, a file
    is missing or malformed) or deleted meanwhile, a warning names it and why, and the next
    newer one is loaded, which restores every object passed again (also after a damaged
    file was found halfway through writing them); a second warning then names the
    checkpoint loaded instead. A damaged checkpoint is left where it is: a run that saves
    the same step again later replaces it with ``save(..., overwrite=True)``. Raises
    :class:`CorruptCheckpointError` listing each checkpoint's problem when there are
    checkpoints but none loads (never a silent fresh start), or
    :class:`PartiallyRestoredError` if a failed load had begun writing into the objects
    (they must not be trained on or saved), and any other error of :func:`ddpckpt.load`
    (a mismatch of the objects passed is no damage: it is raised at once).
    """
    directory = _observe.place(directory, "load_latest", Access.LOOKUP)  # check-resume: its own
    configure(directory, storage_options)
    state = TrainingState.coerce(
        state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        extra=extra, rng=rng,
    )  # fmt: skip
    with Comm.open("ddpckpt.load_latest", path=directory, timeout=timeout) as comm:
        location = comm.locate(directory)  # a rank that cannot fails the call everywhere
        merged = comm.run_reduce(  # each rank reads manifests, not the O(N) file tables
            "list",
            lambda: newest_first(location, "load_latest()", every_file=False),
            _merged_candidates,
        )
    places = [location.join(name) for *_, name in merged]

    def load_one(place: Location) -> CheckpointInfo:
        return load_from(place, state, strict=strict, timeout=timeout)

    info = load_first(location.path, places, "load_latest()", load_one)
    if info is not None:
        note_fewer_ranks(info)
    return info


def load_first(
    directory: str,
    paths: list[Location],
    caller: str,
    load_one: Callable[[Location], CheckpointInfo],
) -> CheckpointInfo | None:
    """Collective (every rank with the same ``paths``): ``load_one`` of the first of
    ``paths`` that loads. A damaged one (a checksum fails, a file is missing or malformed,
    deleted meanwhile) is a WARNING naming it and why, and the next is loaded, which
    restores every object again; a second WARNING then names the one loaded instead.
    ``None`` when ``paths`` is empty; raises :class:`CorruptCheckpointError` listing each
    one's problem when none loads, :class:`PartiallyRestoredError` if the last failed load
    had begun writing into the objects, or ``load_one``'s error that is no damage (the
    objects do not match: the next would fail too)."""
    failures: list[str] = []
    skipped: list[str] = []
    partial: PartiallyRestoredError | None = None  # the last load that left them partly restored
    for path in paths:
        try:
            info = load_one(path)
        except (CorruptCheckpointError, CheckpointNotFoundError, PartiallyRestoredError) as exc:
            damage = damage_of(exc)
            if damage is None:
                raise  # e.g. the objects do not match it: no damage, the next would fail too
            if isinstance(exc, PartiallyRestoredError):
                partial = exc
            _log.warning(
                "%s: cannot load %s (%s); loading the previous checkpoint instead%s",
                caller,
                path,
                damage,
                partly_note(exc),
                extra=same_on_every_rank(exc),
            )
            failures.append(f"{path}: {damage}")
            skipped.append(path.path)
            continue
        if skipped:
            _log.warning(
                "%s: loaded %s%s instead of %s, which could not be loaded (see above); every "
                "object passed was restored from it, and nothing more needs doing",
                caller,
                path,
                f" (step {info.step})" if info.step is not None else "",
                ", ".join(skipped),
                extra=same_on_every_rank(),
            )
        return info
    if failures:
        raise none_loaded(directory, failures, partial)
    return None


def _merged_candidates(views: list[list[Candidate]]) -> list[Candidate]:
    """Every rank's candidates in one list, newest first (rank 0 merges them)."""
    return sorted({tuple(c) for view in views for c in view}, reverse=True)  # type: ignore[misc]


def _committed(location: Location, caller: str, every_file: bool = True) -> Manifest | None:
    """The manifest of the checkpoint at ``location`` if it is one and its files are all
    there (without ``every_file``: those its manifest lists itself, its file tables among
    them)."""
    store, path = location.storage, location.path
    if not store.is_dir(path):
        return None
    try:
        manifest = read_manifest(location)
    except (IncompleteCheckpointError, CheckpointNotFoundError):
        return None  # no manifest: an unfinished save, no checkpoint at all, or just deleted
    except CheckpointError as exc:
        _skipped(path, str(exc), caller)
        return None
    problems: list[str] = []
    files = manifest.files.readable(problems) if every_file else manifest.files.inline
    if problems:
        if store.is_dir(path):
            _skipped(path, problems[0], caller)
        return None
    for name, file in files.items():
        try:
            size = store.size(os.path.join(path, name))
        except OSError as exc:
            if not store.is_dir(path):
                return None  # deleted meanwhile (the retention of a job saving there): not damaged
            _skipped(path, f"{name}: {exc}", caller)
            return None
        if size != file.size:
            _skipped(path, f"{name} has {size} bytes, its manifest says {file.size}", caller)
            return None
    return manifest


def _skipped(path: str, why: str, caller: str) -> None:
    _log.warning("%s: skipping the damaged checkpoint %s (%s); it is not loaded", caller, path, why)
