"""ddpckpt: correct, safe and fast checkpoints for PyTorch DistributedDataParallel training.

The whole training state (model, optimizer, scheduler, GradScaler, RNG, any object with
``state_dict()``) goes into a directory of safetensors files and a JSON manifest:
no pickle, every byte checksummed, committed atomically. ``save`` and ``load`` are
collective under ``torch.distributed`` and work the same in a single process.
"""

from ._version import __version__
from .accumulation import GradientAccumulation
from .catalog import latest
from .checkpoint import (
    CheckpointInfo,
    PendingSave,
    load,
    load_state_dict,
    release_async_buffers,
    save,
    verify,
)
from .checkpointer import Checkpointer
from .data import ResumableDistributedSampler, SampleIndex, SeededDataset
from .errors import (
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
from .loader import resumable_loader, track_loader
from .preemption import Preemption
from .state import PerRank

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
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "__version__",
    "latest",
    "load",
    "load_state_dict",
    "release_async_buffers",
    "resumable_loader",
    "save",
    "track_loader",
    "verify",
]
