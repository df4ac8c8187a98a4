"""The layout of a run directory, as :class:`~ddpckpt.Checkpointer` keeps it::

    run/
      step-00000100/      a committed checkpoint (it has its manifest.json)
      step-00000200/
      latest              "step-00000200": moved only after that checkpoint is durable
      run.json            the retention policy, so `ddpckpt ls` can mark the best ones
      .lock               the job writing here (host, pid, job id)
      .step-00000300.tmp-1a2b3c/   a save in progress, or left by a crash: never loaded

Local operations only; :mod:`ddpckpt.checkpointer` decides which rank calls them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError
from .manifest import Manifest, read_manifest
from .storage import (
    fsync_dir,
    is_temp_name,
    new_token,
    remove_tree,
    temp_dir_for,
    write_bytes_atomic,
)
from .tree import decode

__all__ = [
    "Entry",
    "clean_temporaries",
    "read_latest",
    "remove_checkpoint",
    "scan",
    "step_dirname",
    "write_latest",
]

LATEST = "latest"
RUN_FILE = "run.json"
_STEP = re.compile(r"^step-(\d+)$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


@dataclass
class Entry:
    """A checkpoint directory of a run: ``status`` is ``committed``, ``incomplete`` or ``corrupt``."""

    step: int
    path: str
    status: str
    manifest: Manifest | None = None
    problem: str = ""

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics saved with it (empty unless committed)."""
        if self.manifest is None:
            return {}

        def no_tensor(name: str) -> Any:
            raise CheckpointError(f"{self.path}: metrics refer to a tensor ({name})")

        return decode(self.manifest.metrics, no_tensor, where=self.path)


def scan(directory: str) -> list[Entry]:
    """Every ``step-N`` directory, oldest first, with its manifest read (not its data)."""
    if not os.path.isdir(directory):
        return []
    entries = []
    for name in os.listdir(directory):
        step = parse_step(name)
        if step is None:
            continue
        path = os.path.join(directory, name)
        try:
            entries.append(Entry(step, path, "committed", read_manifest(path)))
        except CheckpointError as exc:
            status = "incomplete" if "did not finish" in str(exc) else "corrupt"
            entries.append(Entry(step, path, status, problem=str(exc)))
    return sorted(entries, key=lambda e: e.step)


def read_latest(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_latest(directory: str, name: str) -> None:
    """Point ``latest`` at ``name``, atomically and durably."""
    write_bytes_atomic(os.path.join(directory, LATEST), f"{name}\n".encode())


def write_run_file(directory: str, policy: dict[str, object]) -> None:
    write_bytes_atomic(os.path.join(directory, RUN_FILE), json.dumps(policy, indent=1).encode())


def read_run_file(directory: str) -> dict[str, object]:
    try:
        with open(os.path.join(directory, RUN_FILE)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {}


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that a crash midway can never leave a damaged ``step-N``.

    It is first renamed to a temporary name (atomic), which a later cleanup removes if
    this process dies before finishing.
    """
    doomed = temp_dir_for(path, new_token())
    os.rename(path, doomed)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    remove_tree(doomed)


def clean_temporaries(directory: str) -> list[str]:
    """Remove what interrupted saves and deletions left behind; returns the names removed.

    Call it only while holding the run's lock, when no save of this job is in flight.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        if is_temp_name(name):
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                remove_tree(path)
            else:
                os.unlink(path)
            removed.append(name)
    return removed
