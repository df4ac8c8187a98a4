"""Where a :class:`~ddpckpt.integrations.transformers.DdpckptTrainer` run's checkpoints lie
and what they hold beside the state: the committed ``checkpoint-<step>`` directories of a run
directory, the strings saved in a checkpoint's manifest, and the ``trainer_state.json``
written next to its files; each through the storage serving the path (a local directory or
an object store).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from transformers import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import ddpckpt
from ddpckpt._format.codec import decode
from ddpckpt._format.manifest import MANIFEST_NAME, read_manifest
from ddpckpt._format.sections import StateSections
from ddpckpt.storage._location import Location, locate

TRAINER_STATE_NAME = "trainer_state.json"


def _checkpoints(run_dir: str) -> list[str]:
    """The committed ``checkpoint-<step>`` directories of ``run_dir``, oldest step first,
    listed through the storage serving it (a local directory or an object store), resolved
    once however many there are."""
    run = locate(run_dir)
    try:
        names = run.storage.list(run.path)
    except FileNotFoundError:
        return []
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    steps = sorted(
        int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()
    )
    places = [run.join(f"{prefix}{step}") for step in steps]
    return [p.path for p in places if _committed(p)]


def _is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (a path the Trainer hands over) is a committed checkpoint."""
    return _committed(locate(path))


def _committed(checkpoint: Location) -> bool:
    return checkpoint.storage.exists(checkpoint.join(MANIFEST_NAME).path)


def _state_json(state: TrainerState) -> str:
    """What ``TrainerState.save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _write_trainer_state(directory: str, text: str) -> None:
    """``trainer_state.json`` in the checkpoint this process has just committed, through the
    storage serving it: atomically (a new file renamed over any old one, never written
    through a link), so a reader sees the previous file or this one."""
    place = locate(directory)
    place.storage.replace(place.join(TRAINER_STATE_NAME).path, text.encode())


def _saved_value(checkpoint: str, name: str) -> str:
    """The string saved as the ``extra`` value ``name``, read from the manifest; local."""
    manifest = read_manifest(locate(checkpoint))
    entry = StateSections.from_json(manifest.state, checkpoint).extra.get(name)
    value = None if entry is None or entry.kind != "value" else decode(entry.state, _no_tensor)
    if not isinstance(value, str):
        raise ddpckpt.errors.StateMismatchError(
            f"{checkpoint}: not a checkpoint of DdpckptTrainer (it holds no {name!r})"
        )
    return value


def _no_tensor(name: str) -> torch.Tensor:
    raise ddpckpt.CorruptCheckpointError(f"a tensor ({name}) where a string was saved")
