"""A directory of checkpoints saved with :func:`ddpckpt.save` (or an integration), read as
:func:`ddpckpt.load_latest` reads it, for ``ddpckpt ls``::

    ckpt/step-9/  ckpt/step-19/          a save loop's ``save(f"ckpt/step-{step}", step=step)``
    checkpoints/epoch=0-step=5.ckpt/     Lightning's (DdpckptCheckpointIO), and last.ckpt/
    out/checkpoint-64/                   transformers' Trainer (DdpckptTrainer)

Unlike a :class:`~ddpckpt.Checkpointer`'s run directory (:mod:`ddpckpt._run.rundir`), the
names mean nothing: each checkpoint's saved ``step`` orders them, as
:func:`~ddpckpt._run.catalog.newest_first` does, which is what says which one
``load_latest`` tries first. Local and read-only but for what ``newest_first`` itself does
(putting back a checkpoint an interrupted overwrite left); any one process may call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, read_manifest
from ddpckpt._format.runfiles import CORRUPT_MARK, RUN_MARKS, natural_key, parse_step
from ddpckpt._io.reader import read_metrics
from ddpckpt._run.catalog import Candidate, candidate, newest_first
from ddpckpt._run.rundir import size_problems
from ddpckpt.errors import CheckpointError, IncompleteCheckpointError
from ddpckpt.storage._layout import is_temp_name, previous_of
from ddpckpt.storage._location import Location

_CALLER = "load_latest()"  # newest_first's warnings say what load_latest would skip


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint directly inside the directory: ``status`` is ``committed`` (a
    candidate of ``load_latest``: its manifest reads, its files are all there and of their
    size, its metrics decode), ``incomplete`` or ``corrupt`` (``problem`` says why)."""

    name: str
    location: Location
    status: str
    manifest: Manifest | None = None
    problem: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.location.path

    @property
    def step(self) -> int | None:
        """The step it was saved with, ``None`` if none (or its manifest is unreadable)."""
        return self.manifest.step if self.manifest is not None else None


@dataclass(frozen=True)
class SavesListing:
    """What :func:`list_saves` found: the ``checkpoints``, oldest first in the order
    ``load_latest`` ranks them; ``newest_first``, the names of the committed ones in the
    order ``load_latest`` tries them; ``others``, the entries that are neither a checkpoint
    nor a temporary (a Trainer's ``runs/``, a user's notes), which nothing loads."""

    checkpoints: list[SavedCheckpoint]
    newest_first: list[str]
    others: list[str]


def is_run_layout(names: Sequence[str]) -> bool:
    """Whether a directory listing ``names`` is a Checkpointer's run directory: it has one
    of the run's files (``latest``, ``run.json``, ``.lock``, ...) or a checkpoint in the
    run's spelling (``step-00000100``, also as an interrupted overwrite or ``resume()``
    left it)."""
    if RUN_MARKS & set(names):
        return True
    return any(
        parse_step(previous_of(name) or name.split(CORRUPT_MARK)[0]) is not None for name in names
    )


def holds_saves(directory: Location, names: Sequence[str]) -> bool:
    """Whether ``directory`` (listed as ``names``) holds a checkpoint directly inside it
    (a directory with a manifest, damaged or not)."""
    return any(
        not is_temp_name(name)
        and directory.storage.exists(directory.join(name, MANIFEST_NAME).path)
        for name in names
    )


def list_saves(location: Location) -> SavesListing:
    """The checkpoints directly inside ``directory``, with their status, and the order in
    which :func:`ddpckpt.load_latest` would try them (its own :func:`newest_first`, whose
    warnings name the damaged ones it skips)."""
    order = newest_first(location, _CALLER)  # first: it may put back an interrupted overwrite
    committed = {c[-1] for c in order}
    store = location.storage
    names = store.list(location.path)
    found: list[tuple[Candidate, SavedCheckpoint]] = []
    others = []
    for name in names:
        if is_temp_name(name) or previous_of(name) in names:
            continue  # leftovers, listed as such (find_leftovers)
        at = location.join(name)
        if name not in committed and not store.exists(at.join(MANIFEST_NAME).path):
            others.append(name)
            continue
        entry = _saved(name, at, name in committed)
        key = candidate(name, entry.manifest) if entry.manifest else (False, 0, 0.0, name)
        found.append((key, entry))
    found.sort(key=lambda pair: pair[0])
    return SavesListing(
        [entry for _, entry in found], [c[-1] for c in order], sorted(others, key=natural_key)
    )


def _saved(name: str, location: Location, committed: bool) -> SavedCheckpoint:
    """The checkpoint at ``location``, read as ``newest_first`` judged it (``committed``)."""
    path = location.path
    try:
        manifest = read_manifest(location)
    except IncompleteCheckpointError as exc:
        return SavedCheckpoint(name, location, "incomplete", problem=str(exc))
    except CheckpointError as exc:
        return SavedCheckpoint(name, location, "corrupt", problem=str(exc))
    try:
        metrics = read_metrics(manifest, path)
    except CheckpointError as exc:  # load_latest finds it when it loads it, and falls back
        return SavedCheckpoint(name, location, "corrupt", manifest, str(exc))
    if not committed:
        why = f"{path}: load_latest() skips it (its files could not all be listed or read)"
        problems = size_problems(location, manifest) or [why]
        return SavedCheckpoint(name, location, "incomplete", manifest, problems[0], metrics)
    return SavedCheckpoint(name, location, "committed", manifest, metrics=metrics)
