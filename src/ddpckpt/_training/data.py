"""Data order that resumes exactly: a resumable sampler and per-sample seeding.

* :class:`ResumableDistributedSampler` is ``torch.utils.data.DistributedSampler`` (same
  arguments, same order for the same seed and epoch) plus ``state_dict()`` /
  ``load_state_dict()``: the epoch and how many samples of it all ranks consumed. Resuming
  mid-epoch continues with the exact next index without touching the skipped samples;
  after a world-size change the rest of the epoch is split over the new ranks.
* :class:`SeededDataset` makes random augmentation a function of (seed, epoch, index), not
  of which worker ran it or how far that worker's random stream had advanced, so a resumed
  run augments every sample exactly as the uninterrupted one did.

A DataLoader with workers takes indices from the sampler ahead of training, so the
sampler alone cannot know what training consumed: a tracked loader (:mod:`ddpckpt._training.loader`)
tells it. Saving the sampler without its loader while an untracked loader prefetches from
it is refused at the save.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

from ddpckpt._log import get_logger
from ddpckpt.errors import StateMismatchError

_log = get_logger(__name__)


class SampleIndex(int):
    """A dataset index that also knows its epoch (read by :class:`SeededDataset`).

    An ``int`` in every other respect; :class:`ResumableDistributedSampler` yields them,
    and the epoch survives being sent to a loader's worker process.

    Args:
        value: The index.
        epoch: The epoch it belongs to.

    Attributes:
        epoch: The epoch it belongs to.
    """

    epoch: int

    def __new__(cls, value: int, epoch: int) -> SampleIndex:
        index = super().__new__(cls, value)
        index.epoch = epoch
        return index

    def __reduce__(self) -> tuple[Any, ...]:  # keep the epoch when sent to a worker
        return (SampleIndex, (int(self), self.epoch))


def _epoch_total(length: int, replicas: int, drop_last: bool) -> int:
    """How many indices an epoch has over ``replicas`` ranks (DistributedSampler's total_size)."""
    if drop_last and length % replicas != 0:
        return math.ceil((length - replicas) / replicas) * replicas
    return math.ceil(length / replicas) * replicas


def _epoch_order(
    length: int, replicas: int, epoch: int, seed: int, shuffle: bool, drop_last: bool
) -> list[int]:
    """The whole epoch's index order, padded or cut as DistributedSampler does for ``replicas``."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(length, generator=generator).tolist()
    else:
        order = list(range(length))
    total = _epoch_total(length, replicas, drop_last)
    if total <= len(order):
        return order[:total]
    padding = total - len(order)
    return order + (order * math.ceil(padding / len(order)))[:padding]


def _even(indices: list[int], replicas: int, drop_last: bool) -> list[int]:
    """Pad (repeating from the front) or cut ``indices`` to a multiple of ``replicas``."""
    extra = len(indices) % replicas
    if extra == 0 or not indices:
        return indices
    if drop_last:
        return indices[: len(indices) - extra]
    padding = replicas - extra
    return indices + (indices * math.ceil(padding / len(indices)))[:padding]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose position in the epoch is saved and restored.

    Use it exactly like ``DistributedSampler`` (``sampler.set_epoch(epoch)`` before each
    epoch), one per rank with the same arguments, and save the DataLoader that it feeds in
    the checkpoint's ``extra`` (the loader saves the sampler's state, counted from the
    batches it yielded to training; the sampler alone suffices only with
    ``num_workers=0``). After a resume, calling ``set_epoch`` with the restored epoch keeps
    the restored position; another epoch starts from its beginning. A resume at an epoch's
    end yields nothing for that epoch, so no epoch is repeated or skipped whichever epoch
    the loop restarts from. After a world-size change the rest of the epoch is split over
    the new ranks (a WARNING says so: the global batch changes).

    The indices are :class:`SampleIndex` ints carrying the epoch. The arguments are
    ``DistributedSampler``'s, and give the same order for the same seed and epoch.

    Args:
        dataset: A map-style dataset with ``__len__``.
        num_replicas: The number of ranks (default: the process group's world size).
        rank: This rank (default: the process group's rank).
        shuffle: Shuffle the indices, by ``seed`` and the epoch.
        seed: The shuffle's seed; the same on every rank.
        drop_last: Drop the tail that does not divide evenly among the ranks, instead of
            repeating samples to pad it.

    Raises:
        ValueError: ``rank`` is not in ``[0, num_replicas)``.
        RuntimeError: ``num_replicas`` or ``rank`` is left out and no process group is
            initialized.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self._order_replicas = self.num_replicas  # the world size that defines this epoch's order
        self._start = 0  # global position the next pass over this epoch starts at
        self._consumed = 0  # global position consumed so far
        self._pass_done = False  # the last pass reached the epoch's end
        self._checked_consumer = False
        self._loader_tracked = False  # a tracked DataLoader reports what training consumed
        self._feeder: str | None = None  # names an untracked loader that prefetches from us

    def _length(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError("ResumableDistributedSampler needs a dataset with __len__")
        return len(self.dataset)

    def _remaining(self) -> list[int]:
        order = _epoch_order(
            self._length(),
            self._order_replicas,
            self.epoch,
            self.seed,
            self.shuffle,
            self.drop_last,
        )
        rest = order[self._start :]
        if self._order_replicas != self.num_replicas:
            rest = _even(rest, self.num_replicas, self.drop_last)
        return rest

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass; local, on every rank before each epoch.

        The epoch a checkpoint restored keeps its restored position; any other epoch
        starts from its beginning.

        Args:
            epoch: The epoch about to start.
        """
        if epoch != self.epoch:
            self._start = self._consumed = 0
            self._pass_done = False
            self._order_replicas = self.num_replicas
        super().set_epoch(epoch)

    def _total(self) -> int:
        return self._start + len(self._remaining())

    def __iter__(self) -> Iterator[int]:
        if not self._checked_consumer:
            self._checked_consumer = True
            self._feeder = None if self._loader_tracked else _prefetching_feeder()
        if self._pass_done:  # another pass over this epoch (no set_epoch) starts afresh
            self._start = self._consumed = 0
            self._pass_done = False
        if self._start == 0:  # a fresh pass over the epoch
            self._order_replicas = self.num_replicas
        rest = self._remaining()
        mine = rest[self.rank :: self.num_replicas]
        self._consumed = self._start
        total = self._start + len(rest)
        step = self.num_replicas
        epoch = self.epoch

        def indices() -> Iterator[int]:
            for index in mine:
                if not self._loader_tracked:
                    self._consumed = min(self._consumed + step, total)
                yield SampleIndex(index, epoch)
            if not self._loader_tracked:
                self._pass_finished()

        return indices()

    def _delivered(self, count: int) -> None:
        """A tracked loader yielded a batch of ``count`` of this rank's samples to training."""
        self._consumed = min(self._consumed + count * self.num_replicas, self._total())

    def _pass_finished(self) -> None:
        self._consumed = self._total()
        self._pass_done = True

    def __len__(self) -> int:
        """This rank's samples in the current pass (the rest of the epoch after a resume)."""
        if self._pass_done or (self._start == 0 and self._order_replicas == self.num_replicas):
            return self.num_samples
        return len(self._remaining()) // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """The position to save; ddpckpt calls it when the sampler or its loader is in a
        checkpoint.

        Returns:
            The epoch, the samples of it all ranks consumed, and what defines the order
            (the dataset's length, ``seed``, ``shuffle``, ``drop_last`` and the world size
            of the epoch's order).
        """
        return {
            "epoch": self.epoch,
            "consumed": self._consumed,
            "order_replicas": self._order_replicas,
            "dataset_len": self._length(),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position :meth:`state_dict` returned; ddpckpt calls it on every rank
        when it loads the sampler or its loader.

        Args:
            state: What :meth:`state_dict` returned, on any number of ranks.

        Raises:
            StateMismatchError: The dataset's length, ``seed``, ``shuffle`` or
                ``drop_last`` differ from the checkpoint's (the position would mean other
                samples).
        """
        for key in ("dataset_len", "seed", "shuffle", "drop_last"):
            mine = self._length() if key == "dataset_len" else getattr(self, key)
            if state[key] != mine:
                raise StateMismatchError(
                    f"ResumableDistributedSampler: the checkpoint was taken with {key}="
                    f"{state[key]!r}, this sampler has {mine!r}; the saved position in the "
                    "data means nothing for a different order"
                )
        self.epoch = int(state["epoch"])
        self._start = self._consumed = int(state["consumed"])
        self._pass_done = False
        self._order_replicas = int(state["order_replicas"])
        total = _epoch_total(self._length(), self._order_replicas, self.drop_last)
        if self._start == 0 or self._start >= total or self._order_replicas == self.num_replicas:
            if self._start == 0:
                self._order_replicas = self.num_replicas
            return
        _log.warning(
            "ResumableDistributedSampler: epoch %d was %d%% done on %d ranks and continues on %d: "
            "the rest of its samples is split over the new ranks, and the global batch "
            "(world size x batch size) changes by a factor of %d/%d",
            self.epoch,
            100 * self._start // max(total, 1),
            self._order_replicas,
            self.num_replicas,
            self.num_replicas,
            self._order_replicas,
        )


def _prefetching_feeder() -> str | None:
    """Best effort: the kind of untracked multi-worker DataLoader iterating us, if any."""
    base = getattr(torch.utils.data.dataloader, "_MultiProcessingDataLoaderIter", None)
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None or base is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, base):
            stateful = type(owner).__module__.startswith("torchdata")
            return "torchdata StatefulDataLoader" if stateful else "DataLoader"
        frame = frame.f_back
    return None


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed Python, numpy and torch's CPU generator for one sample; put the caller's states
    back. Only the CPU generator: ``torch.manual_seed`` also seeds every accelerator's
    generators, which a sample must not touch (and, before CUDA is initialized, queues that
    seeding with the formatted stack: up to a millisecond a sample)."""
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    torch_state = torch.get_rng_state()
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.set_rng_state(torch_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


class SeededDataset(Dataset):
    """Wraps a map-style dataset so each sample's randomness depends only on what it is.

    Before ``dataset[index]`` runs, Python's ``random``, numpy (if imported) and torch's
    CPU generator are seeded from ``(seed, epoch, index)`` (the epoch comes from the
    :class:`SampleIndex` a :class:`ResumableDistributedSampler` yields, else from
    :meth:`set_epoch`), and the caller's generator states are restored afterwards.
    Augmentation is then the same in any worker, in any order, before and after a resume.
    Every rank wraps its dataset with the same ``seed``.

    Args:
        dataset: The map-style dataset to wrap.
        seed: Mixed into every sample's seed.
    """

    def __init__(self, dataset: Dataset, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used for indices that carry none (plain ints, not
        :class:`SampleIndex`); local.

        Args:
            epoch: The current epoch.
        """
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        epoch = getattr(index, "epoch", self.epoch)
        with _seeded(_sample_seed(self.seed, epoch, int(index))):
            return self.dataset[int(index)]
