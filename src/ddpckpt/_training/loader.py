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
bookkeeping (:mod:`ddpckpt._training.loader_tracking`; nothing else changes). A loader first seen at a save cannot say what it
already consumed: that save raises.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ddpckpt._training.data import ResumableDistributedSampler, SeededDataset
from ddpckpt._training.loader_checks import refuse_untrackable
from ddpckpt._training.loader_tracking import Tracking, loader_base
from ddpckpt._training.replay import user_sampler
from ddpckpt._training.worker_signals import IgnoringPreemptionSignals
from ddpckpt._training.wrappers import is_stateful
from ddpckpt.errors import InexactResumeError


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
            return loader_base(self).state_dict()
        state: dict[str, Any] = {"ddpckpt_finished_pass": True}
        sampler = user_sampler(self)
        if is_stateful(sampler):
            state["sampler"] = sampler.state_dict()
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self: Any, state: Mapping[str, Any]) -> None:
        if not state.get("ddpckpt_finished_pass"):
            loader_base(self).load_state_dict(state)
            return
        loader_base(self).load_state_dict({})
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


def tracked_loader(loader: DataLoader) -> DataLoader:
    """The DataLoader whose iteration :func:`track_loader` tracks for ``loader``: ``loader``
    itself, or the one a registered wrapper iterates (its stream and sampler are that
    loader's)."""
    wrapped = _wrapped_class(loader)
    swapped = _SUBCLASSES.get(wrapped) is type(loader)  # by track_loader, not a user subclass
    return _base_of(loader) if swapped and wrapped in _WRAPPERS else loader


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
    _swap_class(loader, Tracking)
    cast(Tracking, loader)._ddpckpt_init()  # its class now has Tracking's methods
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
