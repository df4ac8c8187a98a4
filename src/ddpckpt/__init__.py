"""ddpckpt: correct, safe and fast checkpoints for PyTorch DistributedDataParallel training.

The whole training state (model, optimizer, scheduler, GradScaler, RNG, any object with
``state_dict()``) goes into a directory of safetensors files and a JSON manifest:
no pickle, every byte checksummed, committed atomically. ``save`` and ``load`` are
collective under ``torch.distributed`` and work the same in a single process.
"""

from ddpckpt._io.dict_checkpoint import load_dict, remove_checkpoint, save_dict
from ddpckpt._io.load import load
from ddpckpt._io.reader import CheckpointInfo, load_state_dict, verify
from ddpckpt._io.save import PendingSave, release_async_buffers, save
from ddpckpt._run.catalog import latest, load_latest
from ddpckpt._run.checkpointer import Checkpointer
from ddpckpt._run.preemption import Preemption
from ddpckpt._state.objects import PerRank
from ddpckpt._state.training_state import TrainingState
from ddpckpt._training.accumulation import GradientAccumulation
from ddpckpt._training.data import ResumableDistributedSampler, SampleIndex, SeededDataset
from ddpckpt._training.loader import resumable_loader, track_loader
from ddpckpt._version import __version__
from ddpckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointStepError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InexactResumeError,
    InsufficientSpaceError,
    RankFailureError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointStepError",
    "CheckpointWriteError",
    "Checkpointer",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "GradientAccumulation",
    "IncompleteCheckpointError",
    "InexactResumeError",
    "InsufficientSpaceError",
    "PendingSave",
    "PerRank",
    "Preemption",
    "RankFailureError",
    "ResumableDistributedSampler",
    "SampleIndex",
    "SeededDataset",
    "StateMismatchError",
    "TrainingState",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "__version__",
    "latest",
    "load",
    "load_dict",
    "load_latest",
    "load_state_dict",
    "release_async_buffers",
    "remove_checkpoint",
    "resumable_loader",
    "save",
    "save_dict",
    "track_loader",
    "verify",
]
