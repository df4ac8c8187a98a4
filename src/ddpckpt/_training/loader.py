"""A ``torch.utils.data.DataLoader`` whose saved position is what training consumed.

A tracked loader records, for its current pass (one ``iter()``): the batches yielded to the
training loop, the sampler's epoch when the pass began, whether the pass finished, and two
random states: the one the workers' base seed was drawn from (for persistent workers, at
their first pass) and the one the sampler drew its order from, at its first index (the
global torch RNG, ``loader.generator`` and the sampler's own ``generator``). Workers that
prefetch ahead of training change none of it.

At a resume the next ``iter()`` over the saved epoch continues after the last yielded
batch, in the saved order, with the saved workers' seed (see
:mod:`ddpckpt._training.replay`). A pass that had finished yields nothing when the loop
restarts at the same epoch, and a fresh epoch when it restarts at the next one.
``len(loader)`` is the number of batches the current pass has left at its start, and stays
so until the next pass. A :class:`~ddpckpt.data.ResumableDistributedSampler` keeps the position
itself; the loader sets it from the batches it yielded.

Any DataLoader is tracked once ddpckpt sees it before it iterates: created by
passed to :func:`track_loader`, put in a
:class:`~ddpckpt.TrainingState`, a :class:`~ddpckpt.Checkpointer`'s ``extra`` or
:func:`ddpckpt.load`'s ``extra``. Its class is swapped for a subclass that adds the
bookkeeping (nothing else changes). A loader first seen at a save cannot say what it
already consumed: that save raises.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ddpckpt._observe import BatchYielded, observer
from ddpckpt._training.data import ResumableDistributedSampler, SeededDataset
from ddpckpt._training.loader_checks import refuse_untrackable, warn_epoch_gap
from ddpckpt._training.replay import (
    IndexStream,
    capture_draw,
    check_same_pass,
    iter_with_saved_workers_seed,
    pass_length,
    refuse_uncapturable_samplers,
    replay_iter,
    sampler_generators,
    sampler_keeps_position,
    user_sampler,
)
from ddpckpt._training.worker_signals import IgnoringPreemptionSignals
from ddpckpt._training.wrappers import is_stateful
from ddpckpt.errors import InexactResumeError, StateMismatchError


class _TrackedIterator:
    """What ``iter(loader)`` returns: the DataLoader's iterator, counting what it yields."""

    def __init__(self, loader: Any, inner: Any, pass_id: int) -> None:
        self._loader = loader
        self._inner = inner
        self._pass_id = pass_id

    def __iter__(self) -> _TrackedIterator:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        before = self._loader.__dict__.get("_ddpckpt_before_next")
        if before is not None:
            self._loader.__dict__["_ddpckpt_before_next"] = None
            before()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._loader._pass_ended(self._pass_id)
            raise
        self._loader._yielded(self._pass_id)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Tracking:
    """The bookkeeping mixed into a tracked DataLoader's class (see the module docstring)."""

    ddpckpt_per_rank = True  # each rank consumes its own shard: saved per rank

    def _ddpckpt_init(self: Any) -> None:
        inner = DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]
        self.__dict__["_ddpckpt_stream"] = IndexStream(inner, self)
        self.__dict__["_ddpckpt_pass"] = 0
        self.__dict__["_ddpckpt_now"] = None  # the current pass's record
        self.__dict__["_ddpckpt_resume"] = None  # a loaded record, applied at the next iter()
        self.__dict__["_ddpckpt_seed_draw"] = None  # what the live workers' base seed came from
        # called once, before the next batch is taken (a framework integration's resume)
        self.__dict__["_ddpckpt_before_next"] = None
        sampler = user_sampler(self)
        if isinstance(sampler, ResumableDistributedSampler):
            sampler._loader_tracked = True
        iterator = getattr(self, "_iterator", None)  # persistent workers made before tracking
        if iterator is not None:
            iterator._index_sampler = self._ddpckpt_stream

    @property
    def _index_sampler(self: Any) -> Any:
        return self._ddpckpt_stream

    # ------------------------------------------------------------------ the pass

    def _resume_applies(self: Any) -> bool:
        record = self._ddpckpt_resume
        if record is None or not record["started"]:
            return False
        epoch = getattr(user_sampler(self), "epoch", None)
        if record["finished"] and epoch is None:
            return False  # no epochs: the pass after a finished one is simply the next one
        return record["epoch"] == epoch

    def _planned_skip(self: Any) -> int:
        """Batches the next (or current) pass starts after."""
        if self._ddpckpt_resume is None:
            return self._ddpckpt_stream.skip
        if not self._resume_applies() or sampler_keeps_position(self):
            return 0
        if isinstance(self.dataset, IterableDataset):
            return 0  # the dataset keeps its own position
        record = self._ddpckpt_resume
        inner = len(self._ddpckpt_stream.inner)
        return inner if record["finished"] else min(inner, int(record["position"]))

    def __iter__(self: Any) -> Any:
        refuse_untrackable(self)
        applies = self._resume_applies()
        record = self._ddpckpt_resume if applies else None
        resuming = self._ddpckpt_resume is not None
        ended = self._ddpckpt_resume if resuming and self._ddpckpt_resume["finished"] else None
        if resuming and not applies:
            warn_epoch_gap(
                self._ddpckpt_resume,
                getattr(user_sampler(self), "epoch", None),
                None
                if isinstance(self.dataset, IterableDataset)
                else len(self._ddpckpt_stream.inner),
            )
        self._ddpckpt_stream.skip = self._planned_skip() if resuming else 0
        self._ddpckpt_resume = None
        self._ddpckpt_pass += 1
        if record is not None:
            check_same_pass(self, record)
        now = {
            "epoch": getattr(user_sampler(self), "epoch", None),
            "batches": pass_length(self),
            "position": 0 if record is None else record["position"],
            "finished": False,
            "order_draw": None if record is None else record.get("order_draw"),
        }
        self._ddpckpt_now = now
        self._ddpckpt_stream.replay = now["order_draw"]
        # A new iterator draws the workers' base seed; persistent workers keep theirs.
        new_iterator = self._iterator is None or not self.persistent_workers
        try:
            keep_workers_seed = self.persistent_workers and new_iterator and ended is not None
            if record is None and keep_workers_seed and ended.get("seed_draw") is not None:
                inner = iter_with_saved_workers_seed(self, ended["seed_draw"])
            elif record is None:
                if new_iterator:
                    self._ddpckpt_seed_draw = capture_draw(self, samplers=False)
                inner = super(type(self), self).__iter__()  # the loader class that was tracked
            else:
                inner = replay_iter(self, record, new_iterator)
        finally:
            self._ddpckpt_stream.replay = None
        now["seed_draw"] = self._ddpckpt_seed_draw
        return _TrackedIterator(self, inner, self._ddpckpt_pass)

    def _yielded(self: Any, pass_id: int) -> None:
        if pass_id != self._ddpckpt_pass:
            return  # an older iterator still in use: the newest pass is the position
        self._ddpckpt_now["position"] += 1
        sizes = self._ddpckpt_stream.sizes
        count = sizes.popleft() if sizes else 0
        handed = self._ddpckpt_stream.handed
        if handed and (tool := observer()) is not None:
            tool.tell(BatchYielded(self, handed.popleft()))
        sampler = user_sampler(self)
        if isinstance(sampler, ResumableDistributedSampler):
            sampler._delivered(count)

    def _pass_ended(self: Any, pass_id: int) -> None:
        if pass_id != self._ddpckpt_pass:
            return
        self._ddpckpt_now["finished"] = True
        sampler = user_sampler(self)
        if isinstance(sampler, ResumableDistributedSampler):
            sampler._pass_finished()

    # ------------------------------------------------------------------ state

    def state_dict(self: Any) -> dict[str, Any]:
        """This rank's position: the record of the current pass (or of the one loaded)."""
        refuse_untrackable(self)
        refuse_uncapturable_samplers(self)
        record = self._ddpckpt_resume or self._ddpckpt_now
        state: dict[str, Any] = {"started": record is not None}
        if record is not None:
            keys = ("epoch", "batches", "position", "finished", "seed_draw", "order_draw")
            state.update({k: record.get(k) for k in keys})
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        state["sampler_generators"] = [g.get_state() for g in sampler_generators(self)]
        sampler = user_sampler(self)
        if is_stateful(sampler):
            state["sampler"] = sampler.state_dict()
        if isinstance(self.dataset, IterableDataset):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self: Any, state: Mapping[str, Any]) -> None:
        """Arm the next ``iter()`` to continue where the saved pass stopped."""
        if "started" not in state:
            raise StateMismatchError(
                f"{type(self).__qualname__}.load_state_dict: not a ddpckpt loader state "
                f"(keys: {sorted(state)})"
            )
        if state["started"] and not state["finished"] and "seed_draw" not in state:
            raise StateMismatchError(
                f"{type(self).__qualname__}.load_state_dict: this mid-epoch loader state was "
                "saved by an earlier ddpckpt that did not record the random states the order "
                "was drawn from, so the order cannot be replayed. Resume from a checkpoint saved "
                "after an epoch's loop ended, or leave the loader out of extra to start the epoch "
                "over"
            )
        generators = sampler_generators(self)
        saved = state.get("sampler_generators", [])
        if len(saved) != len(generators):
            raise StateMismatchError(
                f"{type(self).__qualname__}.load_state_dict: the saved DataLoader's samplers "
                f"had {len(saved)} generator(s) of their own, this one's have {len(generators)}: "
                "build the loader (sampler, generator=) as in the saved run"
            )
        for generator, generator_state in zip(generators, saved, strict=True):
            generator.set_state(generator_state)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])
        sampler = user_sampler(self)
        if "sampler" in state and is_stateful(sampler):
            sampler.load_state_dict(state["sampler"])
        if "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])
        self._ddpckpt_resume = dict(state) if state["started"] else None
        self._ddpckpt_stream.skip = 0


class _FinishedPass:
    """Mixed into a torchdata ``StatefulDataLoader``: a finished pass is saved as finished.

    Its own snapshot of a finished pass is re-applied at the next ``iter()``, after the
    loop's ``set_epoch``: the next epoch would yield nothing or replay the finished one.
    Saved here instead: "finished" and the sampler's state, so the next epoch starts fresh
    and a restart at the finished epoch yields nothing (the sampler is at its end).
    """

    def state_dict(self: Any) -> dict[str, Any]:
        iterator = self._iterator
        if iterator is None or not iterator._finished:
            return super(type(self), self).state_dict()
        state: dict[str, Any] = {"ddpckpt_finished_pass": True}
        sampler = user_sampler(self)
        if is_stateful(sampler):
            state["sampler"] = sampler.state_dict()
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self: Any, state: Mapping[str, Any]) -> None:
        if not state.get("ddpckpt_finished_pass"):
            super(type(self), self).load_state_dict(state)
            return
        super(type(self), self).load_state_dict({})
        sampler = user_sampler(self)
        if "sampler" in state and is_stateful(sampler):
            sampler.load_state_dict(state["sampler"])
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])


class _AheadOfTraining:
    """Mixed into a registered wrapper (:func:`register_wrapper`): a DataLoader subclass that
    iterates a tracked plain DataLoader, its *base*, one batch ahead of training (Ray
    Train's prepared loader prefetches the next batch when it hands one out). Its position
    is the base's, less the batch it holds; loading it arms the base."""

    ddpckpt_per_rank = True

    def state_dict(self: Any) -> dict[str, Any]:
        held = getattr(self, _WRAPPERS[_wrapped_class(self)][1], None) is not None
        return held_back(_base_of(self), held)

    def load_state_dict(self: Any, state: Mapping[str, Any]) -> None:
        _base_of(self).load_state_dict(state)


_SUBCLASSES: dict[type, type] = {}


def held_back(base: Any, holding: bool = True) -> dict[str, Any]:
    """The state of ``base``, a tracked loader that a wrapper iterates one batch ahead of
    training: its position less the batch the wrapper is ``holding``, during a live pass
    (a loaded record, not yet iterated, was corrected when it was saved)."""
    state = base.state_dict()
    live = base._ddpckpt_resume is None
    if live and holding and state["started"] and not state.get("finished"):
        state["position"] -= 1  # the batch held ahead of training
    return state


# wrapper class -> (the attribute holding its base loader, the one holding the batch ahead)
_WRAPPERS: dict[type, tuple[str, str]] = {}


def register_wrapper(cls: type, base: str, held: str) -> None:
    """For an integration: instances of ``cls``, a DataLoader subclass whose iteration is
    that of the plain DataLoader in its attribute ``base``, holding the next batch (or
    ``None``) in its attribute ``held``, are tracked through that loader
    (:class:`_AheadOfTraining`) rather than refused."""
    _WRAPPERS[cls] = (base, held)


def _wrapped_class(wrapper: Any) -> type:
    return type(wrapper).__mro__[1]  # _swap_class made a direct subclass


def _base_of(wrapper: Any) -> Any:
    return getattr(wrapper, _WRAPPERS[_wrapped_class(wrapper)][0])


def consumed(loader: Any) -> dict[str, Any] | None:
    """What a tracked loader (or registered wrapper) has consumed, for comparing runs: its
    ``epoch``, ``position`` and ``finished``; ``None`` before its first pass."""
    keys = ("epoch", "position", "finished")
    if _wrapped_class(loader) in _WRAPPERS:
        state = loader.state_dict()
        return {k: state[k] for k in keys} if state["started"] else None
    record = loader._ddpckpt_resume or loader._ddpckpt_now
    return {k: record[k] for k in keys} if record else None


def is_tracked(obj: Any) -> bool:
    return type(obj) in _SUBCLASSES.values()


def _wraps_another(loader: Any) -> bool:
    """Whether ``loader`` is a wrapper: a DataLoader subclass with an ``__iter__`` of its own
    that holds another DataLoader over the same dataset, which it iterates instead of
    itself. A subclass whose ``__iter__`` builds on ``super().__iter__()`` is tracked as any
    DataLoader (also one that holds another loader over other data, a validation loader)."""
    if type(loader).__iter__ is DataLoader.__iter__:
        return False
    return any(
        isinstance(v, DataLoader) and v is not loader and v.dataset is loader.dataset
        for v in vars(loader).values()
    )


def _is_torchdata_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and type(obj).__module__.startswith("torchdata")


def _is_plain_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and not _is_torchdata_loader(obj)


def _swap_class(obj: Any, mixin: type) -> None:
    """Make ``obj`` an instance of a direct subclass of its class with ``mixin``'s methods."""
    cls = type(obj)
    if cls not in _SUBCLASSES:  # a direct subclass, so that the object's layout is the same
        methods = {k: v for k, v in vars(mixin).items() if k not in ("__dict__", "__weakref__")}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})
    obj.__class__ = _SUBCLASSES[cls]


def track_loader(loader: DataLoader) -> DataLoader:
    """Make ``loader`` record its position, so that its first save records what training
    consumed.

    Call it before the loader's first iteration, on every rank (local: no collective);
    passing the loader in a :class:`~ddpckpt.TrainingState`, a Checkpointer's or
    :func:`ddpckpt.load`'s ``extra`` before the loop does it for you. Idempotent. Its
    worker processes ignore the preemption signals while a Checkpointer with
    ``preemption`` is open.

    Args:
        loader: A ``torch.utils.data.DataLoader`` (not torchdata's ``StatefulDataLoader``,
            which tracks itself); its class is swapped in place for a tracking subclass.

    Returns:
        ``loader`` itself.

    Raises:
        TypeError: ``loader`` is not a plain torch ``DataLoader``.
        InexactResumeError: Its position cannot be tracked: an ``IterableDataset``
            without ``state_dict``/``load_state_dict``, or one with ``num_workers > 0``,
            or ``in_order=False``.
    """
    if is_tracked(loader):
        return loader
    if not _is_plain_loader(loader):
        raise TypeError(f"track_loader needs a torch DataLoader, got {type(loader).__qualname__}")
    if type(loader) in _WRAPPERS:
        track_loader(getattr(loader, _WRAPPERS[type(loader)][0]))
        _swap_class(loader, _AheadOfTraining)
        return loader
    if _wraps_another(loader):
        kind = f"{type(loader).__module__}.{type(loader).__qualname__}"
        raise InexactResumeError(
            f"a {kind} is a DataLoader subclass that iterates another DataLoader it holds, "
            "not itself, so ddpckpt cannot see which batches training consumed and a resume "
            "would not continue where it stopped. Save the plain torch DataLoader it "
            "iterates instead (a framework's integration with ddpckpt may do it for you: "
            "see the documentation's integration pages)"
        )
    refuse_untrackable(loader)
    _swap_class(loader, _Tracking)
    loader._ddpckpt_init()
    loader.worker_init_fn = IgnoringPreemptionSignals(loader.worker_init_fn)
    return loader


def adopt_loaders(extra: Mapping[str, Any] | None, *, idle_only: bool = False) -> None:
    """Track every plain DataLoader in ``extra`` (before a loop: a TrainingState, a load).

    With ``idle_only`` a loader partway through a pass stays untracked: its position would
    leave out the batches already yielded, so its save raises instead (:func:`check_data_extra`).
    """
    for obj in (extra or {}).values():
        if _is_plain_loader(obj):
            if not (idle_only and not is_tracked(obj) and _iterating(obj)):
                track_loader(obj)
        elif _is_torchdata_loader(obj) and not is_tracked(obj):
            _swap_class(obj, _FinishedPass)


def _iterating(loader: DataLoader) -> bool:
    """Whether an iterator over ``loader`` is alive (it may be partway through its pass)."""
    if getattr(loader, "_iterator", None) is not None:
        return True
    index_sampler = loader._index_sampler
    return any(  # by type: isinstance() on a dead weakref.proxy raises ReferenceError
        issubclass(type(obj), _BaseDataLoaderIter) and obj._index_sampler is index_sampler
        for obj in gc.get_objects()
    )


def check_data_extra(extra: Mapping[str, Any]) -> None:
    """At a save: track plain loaders, and refuse what would resume at the wrong sample."""
    for name, obj in extra.items():
        if _is_plain_loader(obj) and not is_tracked(obj):
            if _iterating(obj):
                raise InexactResumeError(
                    f"extra[{name!r}]: ddpckpt first sees this DataLoader at this save, while "
                    "it is being iterated, so it cannot know which batches training consumed. "
                    "Call ddpckpt.data.track_loader(loader), or put it in the TrainingState or "
                    "the Checkpointer's extra, before the loop"
                )
            track_loader(obj)
        elif _is_torchdata_loader(obj) and not is_tracked(obj):
            _swap_class(obj, _FinishedPass)
    loaders = [o for o in extra.values() if isinstance(o, DataLoader)]
    for name, obj in extra.items():
        if not isinstance(obj, ResumableDistributedSampler) or obj._feeder is None:
            continue
        if any(user_sampler(loader) is obj for loader in loaders):
            continue
        raise InexactResumeError(
            f"extra[{name!r}]: this ResumableDistributedSampler feeds a {obj._feeder} with "
            "workers, which takes indices ahead of training, so the sampler's own position is "
            "ahead of what training consumed. Save the loader too: "
            f"extra={{{name!r}: sampler, 'loader': loader}} (or the loader alone), or use "
            "num_workers=0"
        )


def resumable_loader(
    dataset: Dataset,
    *,
    sampler: ResumableDistributedSampler,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A tracked ``DataLoader`` over ``SeededDataset(dataset, seed)``; no torchdata needed.

    Its position follows the batches training consumed (see :mod:`ddpckpt._training.loader`), and
    each sample's random augmentation depends only on (seed, epoch, index). It has a
    private generator, so ``iter()`` never draws from the global torch RNG. Put it in the
    checkpoint's ``extra`` (``extra={"loader": loader}``); it is saved per rank, with its
    sampler's state. ``kwargs`` go to ``DataLoader`` (``persistent_workers``,
    ``pin_memory``, ``drop_last``, ``collate_fn`` ...).
    """
    generator = torch.Generator()
    generator.manual_seed(seed)
    loader = DataLoader(
        SeededDataset(dataset, seed),
        sampler=sampler,
        batch_size=batch_size,
        num_workers=num_workers,
        generator=generator,
        **kwargs,
    )
    return track_loader(loader)
