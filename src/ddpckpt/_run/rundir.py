"""The layout of a run directory, as :class:`~ddpckpt.Checkpointer` keeps it::

    run/
      step-00000100/      a committed checkpoint (it has its manifest.json)
      step-00000200/
      latest              "step-00000200": moved only after that checkpoint is durable
      run.json            the retention policy, so `ddpckpt ls` can mark the best ones
      .lock               the job writing here (host, pid, job id)
      .step-00000300.tmp-1a2b3c/   a save in progress, or left by a crash: never loaded
      .step-00000200.previous/     step-00000200 while an overwrite replaces it where the
                                   file system has no atomic exchange: put back at the
                                   next start if the overwrite was interrupted
      step-00000300.corrupt-4d5e6f/ moved aside by ``resume()``: never loaded

Local operations only; :mod:`ddpckpt._run.checkpointer` decides which rank calls them.
What these files hold is parsed by :mod:`ddpckpt._format.runfiles`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ddpckpt._format.manifest import Manifest, read_manifest
from ddpckpt._format.runfiles import (
    CORRUPT_MARK,
    LATEST,
    LOCK_NAME,
    RUN_FILE,
    is_stray_step,
    parse_step,
    read_latest,
    read_lock,
    run_file_text,
    warn_stray,
)
from ddpckpt._format.runfiles import step_dirname as step_dirname  # the run's layout
from ddpckpt._io.reader import read_metrics
from ddpckpt._log import get_logger
from ddpckpt._run.runlock import RunLock
from ddpckpt.errors import CheckpointError, CheckpointLockedError, IncompleteCheckpointError
from ddpckpt.policies import Record, Retention
from ddpckpt.storage._commit import restore_interrupted
from ddpckpt.storage._layout import is_temp_name, new_token, previous_name, previous_of
from ddpckpt.storage._location import Location

_log = get_logger(__name__)


@dataclass
class Entry:
    """A checkpoint directory of a run: ``status`` is ``committed``, ``incomplete`` or ``corrupt``."""

    step: int
    location: Location
    status: str
    manifest: Manifest | None = None
    problem: str = ""

    @property
    def path(self) -> str:
        return self.location.path

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics saved with it (empty unless committed; :func:`scan` lists one whose
        metrics cannot be decoded as corrupt)."""
        if self.manifest is None:
            return {}
        return read_metrics(self.manifest, self.path)


def scan(directory: Location) -> list[Entry]:
    """Every ``step-N`` directory, oldest first, with its manifest read (not its data).

    A ``step-N`` that an interrupted overwrite left as ``.step-N.previous`` (see
    :class:`~ddpckpt.storage.RenameCommit`) is listed with that path until it is put back.
    """
    store = directory.storage
    if not store.is_dir(directory.path):
        return []
    names = store.list(directory.path)
    for name in names:
        if parse_step(name) is None and previous_of(name) is None and is_stray_step(name):
            warn_stray(directory.path, name)
    found = [(parse_step(name), name) for name in names]
    found += [
        (parse_step(target), name)
        for name in names
        if (target := previous_of(name)) is not None and target not in names
    ]
    entries = [_entry(step, directory.join(name)) for step, name in found if step is not None]
    return sorted(entries, key=lambda e: e.step)


def _entry(step: int, location: Location) -> Entry:
    """The checkpoint at ``location``: committed if its manifest reads and its metrics decode
    (what ``resume(best=...)``, retention and ``ddpckpt ls`` rank by), else why not."""
    try:
        entry = Entry(step, location, "committed", read_manifest(location))
        entry.metrics  # noqa: B018 - decoded here, so that a damaged one is listed as corrupt
        return entry
    except IncompleteCheckpointError as exc:
        return Entry(step, location, "incomplete", problem=str(exc))
    except CheckpointError as exc:
        return Entry(step, location, "corrupt", problem=str(exc))


def checkpoint_path(directory: Location, step: int) -> Location:
    """Where checkpoint ``step`` of the run is: ``step-N``, or ``.step-N.previous`` while an
    interrupted overwrite left it there (see :func:`scan`)."""
    path = directory.join(step_dirname(step))
    store = directory.storage
    if not store.exists(path.path) and store.exists(previous_name(path.path)):
        return Location(store, previous_name(path.path))
    return path


def restore_overwrites(directory: Location) -> None:
    """Put back the checkpoints that interrupted overwrites left as ``.step-N.previous``,
    and delete those already replaced (see :class:`~ddpckpt.storage.RenameCommit`). Call
    it holding the run's lock, when no save of this job is in flight."""
    store, path = directory.storage, directory.path
    if store.is_dir(path):
        restore_interrupted(store, path, store.list(path))


def restore_unless_locked(directory: Location, names: list[str]) -> list[str]:
    """:func:`restore_overwrites` for processes that take no lock (``ddpckpt.latest()``,
    ``ddpckpt ls``), given the directory's listing ``names``; the listing afterwards.

    Nothing is done while a live job holds the run's lock (its own start does it, and it
    may be replacing a checkpoint right now), or when storage refuses (a read-only mount):
    the copy is then listed where it is (see :func:`scan`)."""
    if not any(previous_of(name) for name in names):
        return names
    store = directory.storage
    if RunLock(directory).held_live():
        return names
    try:
        restore_interrupted(store, directory.path, names)
        return store.list(directory.path)
    except OSError as exc:
        _log.warning(
            "%s: could not put back a checkpoint an interrupted overwrite left (%s); it is "
            "read where it is, and the next start of the run puts it back",
            directory,
            exc,
        )
        return names


def size_problems(location: Location, manifest: Manifest) -> list[str]:
    """Files of a checkpoint that are missing or not the size its manifest records: the
    cheap check (no data read) that catches a truncated copy, never a bit flip."""
    store, path = location.storage, location.path
    problems: list[str] = []
    for name, file in sorted(manifest.files.readable(problems).items()):
        try:
            actual = store.size(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(
                f"{os.path.join(path, name)}: missing, a data file the checkpoint lists"
            )
            continue
        if actual != file.size:
            problems.append(
                f"{os.path.join(path, name)}: file is {actual} bytes, the manifest records {file.size}"
            )
    return problems


def write_latest(directory: Location, name: str) -> bool:
    """Point ``latest`` at ``name``, atomically and durably; whether it was written.

    ``latest`` is this library's file, replaced whole: a stale link or another file under
    that name becomes the file it should be. A directory there cannot be replaced
    atomically and may hold someone's data, so it is left as it is, with a warning (once
    per process for each run directory), and ``latest`` is not written: nothing depends on
    it (``resume()``, ``ddpckpt.latest()`` and ``ddpckpt ls`` list the run's checkpoints,
    and report a ``latest`` they cannot read, ignoring it).
    """
    store, location = directory.storage, directory.join(LATEST).path
    try:
        store.replace(location, f"{name}\n".encode())
    except OSError:
        if not store.is_dir(location):
            raise
        if location not in _LATEST_LEFT:
            _LATEST_LEFT.add(location)
            _log.warning(
                "%s is a directory, not the file this library keeps there, so it was left as "
                "it is and does not name the newest checkpoint (%s), now or after later "
                "saves; nothing depends on it (resume() and ddpckpt ls list the checkpoints). "
                "Move it away to have latest written again",
                location,
                name,
            )
        return False
    return True


_LATEST_LEFT: set[str] = set()  # the ``latest`` directories already reported by this process


def set_aside(directory: Location, reasons: dict[int, str]) -> None:
    """Rename the checkpoints of the steps in ``reasons`` (what is wrong with each) to
    ``step-N.corrupt-<token>``; local, one rank per storage domain. One already gone
    (another domain's rank, same storage) is skipped."""
    store = directory.storage
    for step, reason in sorted(reasons.items()):
        source = directory.join(step_dirname(step)).path
        if store.exists(source):
            target = f"{source}{CORRUPT_MARK}{new_token()}"
            store.commit.set_aside(store, source, target)
            _log.warning("moved %s aside to %s; it is never loaded (%s)", source, target, reason)


def point_latest(directory: Location, step: int) -> None:
    """Make ``latest`` name checkpoint ``step`` unless it already does; local."""
    if read_latest(directory) != step_dirname(step):
        write_latest(directory, step_dirname(step))


def write_run_file(directory: Location, policy: dict[str, Any]) -> None:
    """Record ``{"retention": <the policy's describe()>}`` in ``run.json``."""
    directory.storage.replace(directory.join(RUN_FILE).path, run_file_text(policy))


def remove_checkpoint(location: Location) -> None:
    """Delete a checkpoint so that a crash midway can never leave a damaged ``step-N``.

    On a file system it is first renamed to a temporary name (atomic), which a later
    cleanup removes if this process dies before finishing; on an object store its manifest
    is deleted first.
    """
    store = location.storage
    store.commit.discard(store, location.path)


def committed_records(directory: Location) -> list[Record]:
    """What a :class:`~ddpckpt.policies.Retention` knows of each committed checkpoint."""
    return [Record(e.step, e.metrics) for e in scan(directory) if e.status == "committed"]


def apply_retention(directory: Location, retention: Retention) -> list[str]:
    """Delete the committed checkpoints ``retention`` does not keep (never the newest);
    returns their paths. Call it only while holding the run's lock."""
    committed = [e for e in scan(directory) if e.status == "committed"]
    records = [Record(e.step, e.metrics) for e in committed]
    keep = retention.keep(records) | {max((r.step for r in records), default=-1)}
    deleted = [e.location for e in committed if e.step not in keep]
    for location in deleted:
        remove_checkpoint(location)
    return [location.path for location in deleted]


def clean_temporaries(directory: Location) -> list[str]:
    """Remove what interrupted saves and deletions left behind; returns the names removed.

    Call it only while holding the run's lock, when no save of this job is in flight.
    """
    store = directory.storage
    removed: list[str] = []
    if not store.is_dir(directory.path):
        return removed
    restore_overwrites(directory)
    for name in store.list(directory.path):
        if is_temp_name(name):
            store.delete_tree(directory.join(name).path)
            removed.append(name)
    for name, path in _unfinished_overwrites(directory):
        store.delete_tree(path)
        removed.append(name)
    return removed


def _unfinished_overwrites(directory: Location) -> list[tuple[str, str]]:
    """``(step-N/part, path)`` for what interrupted overwrites left inside committed
    checkpoints (``step-N/.next-<token>/`` on object stores)."""
    store = directory.storage
    found = []
    for name in sorted(store.list(directory.path)):
        if parse_step(name) is not None:
            for path in store.commit.unfinished(store, directory.join(name).path):
                found.append((f"{name}/{os.path.basename(path)}", path))
    return found


@dataclass
class Leftover:
    """Something in a run directory that is no checkpoint and takes space.

    ``kind`` is ``temporary`` (a save in progress, or left by a crash or an interrupted
    deletion; also an interrupted overwrite's ``step-N/.next-<token>``, or the
    ``.step-N.previous`` it replaced) or ``corrupt`` (a checkpoint ``resume()`` moved aside).
    """

    name: str
    path: str
    kind: str
    nbytes: int


def find_leftovers(directory: Location) -> list[Leftover]:
    """The temporaries and moved-aside corrupt checkpoints of a run directory, by name."""
    found = []
    store = directory.storage
    names = store.list(directory.path)
    for name in sorted(names):
        if is_temp_name(name) or previous_of(name) in names:  # a replaced copy, not deleted
            kind = "temporary"
        elif parse_step(name.split(CORRUPT_MARK)[0]) is not None and CORRUPT_MARK in name:
            kind = "corrupt"
        else:
            continue
        path = directory.join(name).path
        found.append(Leftover(name, path, kind, store.tree_bytes(path)))
    for name, path in _unfinished_overwrites(directory):
        found.append(Leftover(name, path, "temporary", store.tree_bytes(path)))
    return found


def clean_leftovers(directory: Location, *, corrupt: bool = False) -> list[Leftover]:
    """Delete a run directory's temporaries (and, with ``corrupt``, the checkpoints moved
    aside as corrupt); returns what was removed. Local; one process.

    Takes the run's lock for the duration, so it raises
    :class:`~ddpckpt.errors.CheckpointLockedError` while a live job holds it (a temporary
    may then be a save in progress). Committed checkpoints are never touched.
    """
    store = directory.storage
    if not store.is_dir(directory.path):
        raise FileNotFoundError(f"{directory}: no such directory")
    _refuse_own_jobs_lock(directory)
    lock = RunLock(directory)
    lock.acquire()
    try:
        restore_overwrites(directory)
        doomed = [
            leftover
            for leftover in find_leftovers(directory)
            if leftover.kind == "temporary" or corrupt
        ]
        for leftover in doomed:
            store.delete_tree(leftover.path)
        return doomed
    finally:
        lock.release()


def _refuse_own_jobs_lock(directory: Location) -> None:
    """Raise :class:`CheckpointLockedError` if the lock names this process's own job.

    :class:`RunLock` takes such a lock over (it is an elastic restart's); a cleaner started
    inside the trainer's job (a shell in the same SLURM allocation) must not.
    """
    ours = [os.environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")]
    try:
        holder = read_lock(directory.join(LOCK_NAME))
    except CheckpointError:
        return  # torn or damaged: RunLock decides (a torn lock is taken over once old)
    if holder is None or not holder.job or holder.job == "none" or holder.job not in ours:
        return
    raise CheckpointLockedError(
        f"{directory} is in use by another job: pid {holder.pid} on {holder.host} holds its "
        f"lock, and it belongs to this same job ({holder.job}), so it may be writing here now. "
        "If that job is over, delete the .lock file"
    )
