"""A run directory's path taken by something that is no directory (a file, a symbolic link
to none), or lying under a file: the user's mistake, refused plainly at the set-up.

Left to the storage, it would surface as a bare errno (``[Errno 17] File exists``) from
wherever the directory is first created or listed, or, for a reader, as a fresh start.
"""

from __future__ import annotations

import os

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.failures import rank_list
from ddpckpt.storage._location import Location


def refuse_no_directory(comm: Comm, location: Location, create: bool) -> None:
    """Collective: raise :class:`ValueError` on every rank if, on any rank, the run
    directory ``location`` is no directory or cannot be one (see :func:`in_the_way`).

    Args:
        comm: The call every rank is in.
        location: The run directory.
        create: Create it where missing (a Checkpointer that saves); a read-only one
            creates nothing.

    Raises:
        ValueError: Naming what is in the way, and what to do.
    """
    found = comm.run_reduce(
        "run directory", lambda: in_the_way(location, create), _first_with_ranks
    )
    if found is None:
        return
    problem, ranks = found
    if len(ranks) < comm.world_size:  # node-local storage: other nodes have a directory there
        problem += f" (seen on rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)})"
    # Every rank raises it, from the reduced answer: so rank 0 leaves the call only after the
    # others (its process may hold their store).
    raise comm.everywhere(ValueError(problem))


def in_the_way(location: Location, create: bool) -> str | None:
    """Local: why ``location`` cannot be a run directory on this rank, naming the paths as
    the user gave them; ``None`` if nothing is in its way. With ``create``, the directory
    is created (as the set-up does next); another failure to create it is left to the
    set-up, which reports it."""
    store, path = location.storage, location.path
    if create:
        try:
            store.make_dirs(path)
            return None
        except (FileExistsError, NotADirectoryError):
            pass
        except OSError:
            return None
    elif not store.exists(path) or store.is_dir(path):
        return None
    blocker = _blocker(location)
    if blocker == path:
        action = (
            "pass the directory your saves should go to (a missing one is created)"
            if create
            else "pass the run directory the saving job writes to"
        )
        return (
            f"{path}: {_what(path)}, not a directory, and a Checkpointer keeps a run's "
            f"checkpoints inside a directory: {action}, or move this file away"
        )
    return (
        f"{path}: cannot be a run directory: {blocker} {_what(blocker)}, not a directory: "
        f"pass a path that is not under a file, or move {blocker} away"
    )


def _blocker(location: Location) -> str:
    """The path itself, or the nearest of its parents, that exists and is no directory
    (the path itself if none is found: it vanished meanwhile)."""
    store, path = location.storage, location.path
    candidate = path
    while candidate:
        if store.exists(candidate) and not store.is_dir(candidate):
            return candidate
        parent = os.path.dirname(candidate.rstrip("/"))
        if parent == candidate:
            break
        candidate = parent
    return path


def _what(path: str) -> str:
    """What ``path``, found to be no directory, is ("is a file"), for a message."""
    if os.path.islink(path):
        return f"is a symbolic link to {os.readlink(path)}"
    return "is a file"


def _first_with_ranks(found: list[str | None]) -> tuple[str, list[int]] | None:
    """Rank 0's reduction: the first problem found, and the ranks that found it."""
    first = next((p for p in found if p is not None), None)
    if first is None:
        return None
    return first, [rank for rank, p in enumerate(found) if p == first]
