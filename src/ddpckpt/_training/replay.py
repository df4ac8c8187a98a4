"""Replaying a DataLoader's saved pass: where it stopped and the random states it drew from.

A tracked loader (:mod:`ddpckpt._training.loader`) takes its indices from an
:class:`IndexStream`, which at a resume is fast-forwarded past the batches training
consumed before any worker sees an index (skipped samples are never loaded), and draws
the sampler's order from the saved random states (:func:`capture_draw`,
:func:`restore_draw`) whatever the new iterator drew before it. :func:`replay_iter` gives
new workers the saved base seed. The global RNG is restored after each replayed draw,
so the main random stream (dropout) is not shifted.

Everything here is local to the calling rank; ``loader`` is a tracked DataLoader.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpckpt._observe import observer
from ddpckpt._training.data import ResumableDistributedSampler, SampleIndex, SeededDataset
from ddpckpt.errors import InexactResumeError

_END = object()


def _innermost_batch_sampler(loader: DataLoader) -> Any:
    """The batch sampler that batches the sampler's indices, below wrappers that take
    their batches from it (``.batch_sampler``: accelerate's ``BatchSamplerShard``)."""
    batch_sampler = loader.batch_sampler
    for _ in range(8):
        inner = getattr(batch_sampler, "batch_sampler", None)
        if inner is None:
            break
        batch_sampler = inner
    return batch_sampler


def user_sampler(loader: DataLoader) -> Any:
    """The sampler that orders the data (inside a batch sampler if there is one)."""
    return getattr(_innermost_batch_sampler(loader), "sampler", loader.sampler)


def _samplers(loader: DataLoader) -> list[Any]:
    """The loader's batch sampler, the batch samplers it wraps, and its samplers."""
    found, batch_sampler = [], loader.batch_sampler
    for _ in range(8):
        if batch_sampler is None:
            break
        found.append(batch_sampler)
        batch_sampler = getattr(batch_sampler, "batch_sampler", None)
    return [*found, user_sampler(loader), loader.sampler]


def sampler_keeps_position(loader: DataLoader) -> bool:
    return isinstance(user_sampler(loader), ResumableDistributedSampler)


class IndexStream:
    """The loader's index sampler, fast-forwarded at a resume and counted as indices leave it.

    The base DataLoader iterator reads ``loader._index_sampler`` once (persistent workers
    keep it across passes), so this object stays in place and is re-armed per pass.
    """

    def __init__(self, inner: Any, loader: Any) -> None:
        self.inner = inner
        # Weak: the loader's worker iterator holds this stream, so a strong reference makes
        # a cycle that only the garbage collector frees, and it frees the iterator's queues
        # before the iterator can tell its persistent workers to stop (each then waits out
        # torch's 5 s timeout and is terminated).
        self._loader = weakref.ref(loader)
        self.skip = 0
        self.sizes: deque[int] = deque()  # indices per batch handed out, not yet yielded
        self.replay: Mapping[str, Any] | None = None  # the saved order draw, for the next pass
        self.draws = 0  # order draws so far (the sampler's first index of a pass)
        self.before_draw: Any = None  # called once at the next pass's first index
        # len() of the loader: what the pass has left at its start, or (for a framework that
        # counts the batches it consumed against the length, as Lightning does) the whole pass
        self.whole_pass_len = False
        # the index batches handed out, not yet yielded: only under ddpckpt check-resume
        self.handed: deque[Any] | None = deque() if observer() else None

    @property
    def loader(self) -> Any:
        loader = self._loader()
        if loader is None:  # a tracked loader's iterators keep it alive
            raise ReferenceError("the DataLoader this index stream belonged to is gone")
        return loader

    def __deepcopy__(self, memo: dict[int, Any]) -> IndexStream:
        """A copy that belongs to the copy of its loader (``copy.deepcopy`` of a tracked
        loader), not to the original: a weak reference is copied as the same reference."""
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in vars(self).items():
            if key != "_loader":
                setattr(new, key, copy.deepcopy(value, memo))
        loader = self._loader()
        new._loader = weakref.ref(memo.get(id(loader), loader))
        return new

    def __len__(self) -> int:
        if self.whole_pass_len:
            return len(self.inner)
        return max(0, len(self.inner) - self.loader._planned_skip())

    def __iter__(self) -> Iterator[Any]:
        self.sizes.clear()
        if self.handed is not None:
            self.handed.clear()
        return self._counted(self.skip, self.loader._ddpckpt_now, self.replay)

    def _counted(
        self, skip: int, record: dict[str, Any] | None, replay: Mapping[str, Any] | None
    ) -> Iterator[Any]:
        # Everything happens at the first index taken: that is when the sampler draws its
        # order in the saved run, whatever the DataLoader's iterator drew before it.
        hook, self.before_draw = self.before_draw, None
        if hook is not None:
            hook()
        if skip and skip >= len(self.inner):
            return  # nothing left: the saved run drew nothing more here
        self.draws += 1
        if replay is None:
            if record is not None:
                record["order_draw"] = capture_draw(self.loader)
            indices = iter(self.inner)
        else:
            main_rng = torch.get_rng_state()
            try:
                restore_draw(self.loader, replay)
                indices = iter(self.inner)
                first = next(indices, _END)
            finally:
                torch.set_rng_state(main_rng)
            if first is _END:
                return
            indices = itertools.chain([first], indices)
        for _ in range(skip):  # indices only: the skipped samples are never loaded
            if next(indices, _END) is _END:
                return
        batched = self.loader._auto_collation
        epoch = getattr(user_sampler(self.loader), "epoch", None)
        # The epoch to tag indices with: only for a SeededDataset, and only when known.
        tag = epoch if isinstance(self.loader.dataset, SeededDataset) else None
        for item in indices:
            self.sizes.append(len(item) if batched else 1)
            if self.handed is not None:
                self.handed.append(item)
            if tag is not None and batched:
                item = [i if isinstance(i, SampleIndex) else SampleIndex(int(i), tag) for i in item]
            elif tag is not None and not isinstance(item, SampleIndex):
                item = SampleIndex(int(item), tag)
            yield item


def pass_length(loader: Any) -> int | None:
    """Batches in a whole pass, where the loader (not the sampler) keeps the position."""
    if sampler_keeps_position(loader) or isinstance(loader.dataset, IterableDataset):
        return None
    return len(loader._ddpckpt_stream.inner)


def check_same_pass(loader: Any, record: Mapping[str, Any]) -> None:
    saved, now = record.get("batches"), pass_length(loader)
    if saved is not None and now is not None and saved != now:
        raise InexactResumeError(
            f"the DataLoader's epoch had {saved} batches on this rank when the checkpoint was "
            f"saved and has {now} now (another dataset, batch size or world size), so its saved "
            f"position ({record['position']} batches) means nothing here. To resume on another "
            "world size, order the data with ddpckpt.data.ResumableDistributedSampler"
        )


def sampler_generators(loader: Any) -> list[torch.Generator]:
    """The torch generators of the loader's (batch) sampler, other than ``loader.generator``."""
    found: list[torch.Generator] = []
    for obj in _samplers(loader):
        generator = getattr(obj, "generator", None)
        if not isinstance(generator, torch.Generator) or generator is loader.generator:
            continue
        if all(generator is not seen for seen in found):
            found.append(generator)
    return found


def refuse_uncapturable_samplers(loader: Any) -> None:
    for obj in _samplers(loader):
        generator = getattr(obj, "generator", None)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InexactResumeError(
                f"the DataLoader's {type(obj).__qualname__} draws its order from a "
                f"{type(generator).__qualname__}, whose state ddpckpt cannot save, so a resumed "
                "run would visit other samples. Give it a torch.Generator (generator="
                "torch.Generator().manual_seed(seed)) or use ddpckpt.data.ResumableDistributedSampler"
            )


def capture_draw(loader: Any, *, samplers: bool = True) -> dict[str, Any]:
    """The random states the loader's next draw comes from."""
    generator = loader.generator
    return {
        "rng": torch.get_rng_state(),
        "generator": None if generator is None else generator.get_state(),
        "sampler_generators": (
            [g.get_state() for g in sampler_generators(loader)] if samplers else []
        ),
    }


def restore_draw(loader: Any, draw: Mapping[str, Any]) -> None:
    """Set the states ``draw`` captured (the caller restores the global RNG afterwards)."""
    torch.set_rng_state(draw["rng"])
    if loader.generator is not None and draw["generator"] is not None:
        loader.generator.set_state(draw["generator"])
    saved = draw["sampler_generators"]  # none for a base seed draw
    for generator, state in zip(sampler_generators(loader) if saved else [], saved, strict=True):
        generator.set_state(state)


def iter_with_saved_workers_seed(loader: Any, seed_draw: Mapping[str, Any]) -> Any:
    """``iter()`` whose new workers get the saved base seed, drawn from nothing live.

    For persistent workers after a pass that ended: the saved run's workers lived on into
    the next pass without drawing a seed, so neither may the resumed run's new ones; the
    sampler's order is then drawn from the live random states, as in the saved run.
    """
    generator = loader.generator
    live_rng = torch.get_rng_state()
    live_generator = None if generator is None else generator.get_state()

    def back_to_live() -> None:
        torch.set_rng_state(live_rng)
        if live_generator is not None:
            generator.set_state(live_generator)

    restore_draw(loader, seed_draw)
    loader._ddpckpt_seed_draw = seed_draw
    loader._ddpckpt_stream.before_draw = back_to_live
    try:
        return super(type(loader), loader).__iter__()
    finally:
        if loader._ddpckpt_stream.before_draw is back_to_live:  # no index taken yet
            loader._ddpckpt_stream.before_draw = None
            back_to_live()


def replay_iter(loader: Any, record: Mapping[str, Any], new_iterator: bool) -> Any:
    """``iter()`` as the saved pass drew it; the stream replays the sampler's draw."""
    generator, stream = loader.generator, loader._ddpckpt_stream
    generator_before = None if generator is None else generator.get_state()
    draws = stream.draws
    with torch.random.fork_rng(devices=[]):
        if new_iterator and record.get("seed_draw") is not None:
            restore_draw(loader, record["seed_draw"])  # the saved workers' base seed
            loader._ddpckpt_seed_draw = record["seed_draw"]
        inner = super(type(loader), loader).__iter__()
    if stream.draws == draws and generator_before is not None:
        generator.set_state(generator_before)  # the order draw (if any) sets it again
    return inner
