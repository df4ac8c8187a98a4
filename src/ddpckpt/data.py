"""Data loading that resumes exactly: the sampler, per-sample seeding and loader tracking.

ddpckpt saves the position of any ``torch.utils.data.DataLoader`` it sees before the
loader's first iteration (in a ``TrainingState``, a ``Checkpointer``'s ``extra``, or
``ddpckpt.load(..., extra=...)``). This module holds what makes that position exact:

* :class:`ResumableDistributedSampler`: ``DistributedSampler`` plus its own state (the
  epoch and the samples all ranks consumed); a resume continues with the exact next
  index, and after a world-size change the rest of the epoch is split over the new ranks.
* :class:`SeededDataset`: random augmentation as a function of (seed, epoch, index), so
  it does not depend on which loader worker ran a sample.
* :func:`track_loader`: track a loader that no checkpoint call has seen yet (a
  ``ddpckpt.save`` user's fresh run), so its first save records what training consumed.
"""

from __future__ import annotations

from typing import Any

from ddpckpt._training.data import ResumableDistributedSampler, SampleIndex, SeededDataset
from ddpckpt._training.loader import track_loader

__all__ = ["ResumableDistributedSampler", "SampleIndex", "SeededDataset", "track_loader"]


def _resumable_loader(old_name: str) -> Any:
    from ddpckpt._deprecation import warn_renamed
    from ddpckpt._training.loader import resumable_loader

    warn_renamed(
        old_name,
        "a torch DataLoader over ddpckpt.data.SeededDataset(dataset, seed), passed to the "
        "checkpoint in extra",
        stacklevel=4,
    )
    return resumable_loader


def __getattr__(name: str) -> Any:
    if name == "resumable_loader":
        return _resumable_loader("ddpckpt.data.resumable_loader")
    raise AttributeError(f"module 'ddpckpt.data' has no attribute {name!r}")
