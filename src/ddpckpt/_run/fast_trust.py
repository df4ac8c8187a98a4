"""Whether a directory may be a run's fast tier (:mod:`ddpckpt._run.fast_tier`), and the
files that say whose it is.

Ownership and trust (:meth:`FastDirectory._set_up`, before anything is read from the directory
or written there, on every rank): the directory is this user's alone, made ``0700`` with
files ``0600`` (:meth:`~ddpckpt.storage._posix.PosixStorage.make_private_dir`); one that is
a symbolic link, another user's, or writable by its group or others is refused. It must
then be a fast tier: its marker (``owner.json``, :class:`~ddpckpt._format.runfiles.FastTierMarker`)
names the run whose steps it holds; a directory without one is used only if it holds
nothing but ddpckpt's bookkeeping (a lock, temporaries), and one with a durable run's
identity file never. Steps are deleted (with a WARNING) only where a valid marker names
another run; a marker written by the previous release (the bare identity, format 0) is
this run's if it names this run, and is refused otherwise. A refused tier, a damaged
marker among its reasons, is reported as a :class:`~ddpckpt.errors.CheckpointWriteError`
(the tier cannot be written), a damaged run identity as the
:class:`~ddpckpt.errors.CorruptCheckpointError` its parser raised: an ERROR either way, at
``resume()`` (which goes on with the durable tier) or at a fast save.
"""

from __future__ import annotations

import platform
import uuid

from ddpckpt._format.runfiles import (
    FAST_TIER_FORMAT,
    FAST_TIER_MARKER,
    LATEST,
    LOCK_NAME,
    RUN_DIR_IDENTITY,
    RUN_FILE,
    FastTierMarker,
    parse_step,
    read_fast_tier_marker,
    read_run_identity,
)
from ddpckpt._run.options import nests
from ddpckpt._run.saving import run_storage_errors
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._layout import is_temp_name
from ddpckpt.storage._location import Location

AVOID = (
    "give fast_tier= a directory of this user's own that does not exist yet (it is created "
    "private), or fast_tier='auto' (one named for this user and run), or remove this one"
)


def check_here(
    location: Location, run: str, owner: str
) -> tuple[str | None, FastTierMarker | None]:
    """On every rank, before anything is read from ``location`` or written there: why
    this node's directory may not be the fast tier of the run ``owner`` (whose run
    directory is ``run``), or ``None``; and then its marker, if it has one (the
    directory then exists, private)."""
    directory = location.path
    where = f"{directory} on {platform.node()}"
    with run_storage_errors(location, "setting up the fast tier"):
        if "://" not in run and nests(directory, run):
            return (
                f"{where} is the run directory {run}, or one of them holds the other "
                f"once symbolic links are resolved: {AVOID}"
            ), None
        store = location.storage
        make_private = getattr(store, "make_private_dir", None)
        if make_private is None:  # FastTier.check refuses URLs: a storage of the user's
            return f"{where} is not on a local file system: {AVOID}", None
        problem = make_private(directory)
        if problem is not None:
            return f"{where}: {problem}: {AVOID}", None
        names = set(store.list(directory))
        if RUN_DIR_IDENTITY in names:
            return (
                f"{where} is a durable run directory (it holds {RUN_DIR_IDENTITY}, a run's "
                f"identity), not a fast tier: check fast_tier= (a typo, swapped paths?); "
                f"{AVOID}"
            ), None
        try:
            found = read_fast_tier_marker(location)
        except CorruptCheckpointError as exc:
            return (
                f"{where}: its marker is damaged ({exc}): remove the directory if no job "
                "uses it (it holds only copies in memory), or give fast_tier= another one"
            ), None
    if found is None:
        foreign = sorted(n for n in names if n != LOCK_NAME and not is_temp_name(n))
        if foreign:
            steps = [n for n in foreign if parse_step(n) is not None]
            marks = [n for n in foreign if n in (LATEST, RUN_FILE)]
            what = "checkpoints of a run" if steps or marks else "files of another program"
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            return (
                f"{where} is no fast tier (it has no {FAST_TIER_MARKER}) and holds {what} "
                f"({shown}): nothing there is used or deleted; check fast_tier= (a typo, "
                f"swapped paths?) and {AVOID}"
            ), None
    elif found.format < FAST_TIER_FORMAT and found.run != owner:
        return (
            f"{where} was marked by an earlier release of ddpckpt for another run "
            f"({found.run_directory!r}): its steps are not used or deleted; {AVOID}"
        ), None
    return None, found


def run_identity(location: Location) -> str:
    """On rank 0: the identity of the durable run directory ``run``, a random token kept
    in it (made by the first resume with a fast tier), so that a run directory deleted and
    made anew is another run. A damaged one (no regular file, too large, not UTF-8 text)
    raises :class:`CorruptCheckpointError` saying what to do; it is never replaced."""
    store, run, path = location.storage, location.path, location.join(RUN_DIR_IDENTITY).path
    try:
        found = read_run_identity(location)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc}. The fast tier is not used while the run's identity is unreadable: "
            f"delete {path} to give the run a new one (the fast tier's steps then count as "
            "another run's, and are deleted at the next start)"
        ) from None
    if found is not None:
        return found
    token = f"{run}#{uuid.uuid4().hex}"
    store.make_dirs(run)  # a job that saves the fast tier before the durable one
    store.replace(path, token.encode())
    return token


def write_marker(directory: Location, owner: str) -> None:
    """Mark the fast tier ``directory`` as the run ``owner``'s (replaced atomically)."""
    directory.storage.replace(
        directory.join(FAST_TIER_MARKER).path, FastTierMarker(owner).as_bytes()
    )


def by_problem(problems: list[str | None]) -> dict[str, list[int]]:
    """On rank 0: each problem the ranks found (those of a node find the same), with the
    ranks that found it."""
    found: dict[str, list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem is not None:
            found.setdefault(problem, []).append(rank)
    return found
