"""What the checked runs leave outside the check's directory, said in the report.

Only the script's ddpckpt calls are redirected (:mod:`.isolate`): what it writes itself
(``open``, ``torch.save``, a metrics file next to its checkpoints) goes where it puts it, in
every run of the check, over whatever was there. The directories the runs created for the
script are removed where still empty, and the files the script wrote there named
(:func:`remove_created`); the files that changed during the check in the directories of the
script's checkpoint paths, and in the directories holding them, are named too
(:func:`changed_beside`), so that a result file of the user's own that a checked run
replaced is never replaced silently.

Only the checker's process calls these, once, at the end of a check.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ddpckpt._resumecheck.records import read_records

_SHOWN = 5


def leftover_notes(out: str, routes: Sequence[Mapping[str, Any]], since: float) -> list[str]:
    """The report's notes on what the runs of the check whose directory is ``out`` left
    outside it (see the module docstring); removes the empty directories they created.
    ``routes``: where the script's paths went; ``since``: the check's start (``time.time``)."""
    notes = []
    left = remove_created(out)
    for path, names in left.items():
        notes.append(
            f"{path} did not exist; the check made it for the script (its checkpoints' "
            f"directory is mapped) and left it, because the script wrote its own files "
            f"there, which only ddpckpt's calls are redirected from: {_shown(names)}"
        )
    for path, names in changed_beside(routes, since, skip=left).items():
        notes.append(
            f"{path}: files there changed while the check ran: {_shown(names)}. The script's "
            "own writes (not through ddpckpt) are not redirected: its checked runs write "
            "them there for real, replacing any copy that was there before the check"
        )
    return notes


def remove_created(out: str) -> dict[str, list[str]]:
    """Remove the directories the checked runs created for the script (see
    :mod:`.isolate`) where they are still empty; deepest first. Returns those left, each with
    what the script wrote there itself (not through ddpckpt, so not redirected)."""
    created: set[str] = set()
    runs = os.path.join(out, "runs")
    for name in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
        for processes in read_records(os.path.join(runs, name)).values():
            for events in processes:
                created.update(p for e in events if e["event"] == "created" for p in e["paths"])
    left: dict[str, list[str]] = {}
    for path in sorted(created, key=lambda p: p.count(os.sep), reverse=True):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:  # not empty: the script wrote its own files there
            left[path] = sorted(os.listdir(path))
    return {p: [n for n in names if os.path.join(p, n) not in left] for p, names in left.items()}


def changed_beside(
    routes: Sequence[Mapping[str, Any]], since: float, skip: Collection[str] = ()
) -> dict[str, list[str]]:
    """The regular files modified at or after ``since`` in the directory of each local path
    the script gave ddpckpt that the check mapped, and in the directory holding it; each
    directory once, those in ``skip`` left out. Not recursive: a directory's own
    subdirectories are not looked into."""
    folders: list[str] = []
    for route in routes:
        path = str(route["path"])
        if route["how"] == "input" or "://" in path:
            continue
        path = os.path.abspath(path)  # relative to the script's directory, which is ours
        for folder in (path, os.path.dirname(path)):
            if folder not in folders and folder not in skip:
                folders.append(folder)
    changed: dict[str, list[str]] = {}
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                names = sorted(
                    e.name
                    for e in entries
                    if e.is_file(follow_symlinks=False)
                    and e.stat(follow_symlinks=False).st_mtime >= since
                )
        except (FileNotFoundError, NotADirectoryError):
            continue
        if names:
            changed[folder] = names
    return changed


def _shown(names: Sequence[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
