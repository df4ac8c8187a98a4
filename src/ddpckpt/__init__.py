"""ddpckpt: correct, safe and fast checkpoints for PyTorch DistributedDataParallel training.

The whole training state (model, optimizer, scheduler, GradScaler, RNG, any object with
``state_dict()``) goes into a directory of safetensors files and a JSON manifest:
no pickle, every byte checksummed, committed atomically. ``save`` and ``load`` are
collective under ``torch.distributed`` and work the same in a single process.
"""

from typing import Any

from ddpckpt import _observe, convert, data, errors, policies, storage
from ddpckpt._io.dict_checkpoint import load_dict, remove_checkpoint, save_dict
from ddpckpt._io.load import load
from ddpckpt._io.reader import CheckpointInfo, load_state_dict, verify
from ddpckpt._io.save import PendingSave, release_async_buffers, save
from ddpckpt._run.catalog import latest, load_latest
from ddpckpt._run.checkpointer import Checkpointer
from ddpckpt._run.options import FastTier
from ddpckpt._run.preemption import Preemption
from ddpckpt._state.objects import PerRank
from ddpckpt._state.training_state import TrainingState
from ddpckpt._training.accumulation import GradientAccumulation
from ddpckpt._version import __version__
from ddpckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    InexactResumeError,
    PartiallyRestoredError,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CorruptCheckpointError",
    "FastTier",
    "GradientAccumulation",
    "InexactResumeError",
    "PartiallyRestoredError",
    "PendingSave",
    "PerRank",
    "Preemption",
    "TrainingState",
    "__version__",
    "convert",
    "data",
    "errors",
    "latest",
    "load",
    "load_dict",
    "load_latest",
    "load_state_dict",
    "policies",
    "release_async_buffers",
    "remove_checkpoint",
    "save",
    "save_dict",
    "storage",
    "verify",
]

_observe.observer()  # under ddpckpt check-resume only: it records from the script's first call

_MOVED_TO_DATA = ("ResumableDistributedSampler", "SampleIndex", "SeededDataset", "track_loader")


def __getattr__(name: str) -> Any:
    """Old top-level names (deprecated): the data helpers, now in :mod:`ddpckpt.data`, and
    the errors that are public in :mod:`ddpckpt.errors` only (the top level keeps the ones
    a training script catches)."""
    module = data if name in _MOVED_TO_DATA else errors if name in errors.__all__ else None
    if module is not None:
        from ddpckpt._deprecation import warn_renamed

        warn_renamed(f"ddpckpt.{name}", f"{module.__name__}.{name}")
        return getattr(module, name)
    if name == "resumable_loader":
        return data._resumable_loader("ddpckpt.resumable_loader")
    raise AttributeError(f"module 'ddpckpt' has no attribute {name!r}")
