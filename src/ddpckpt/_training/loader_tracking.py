"""The bookkeeping a tracked DataLoader's class gains: the record of its current pass, kept
as training takes batches, and the state a save records and a load arms the next pass with
(what it records, and how a resume continues: :mod:`ddpckpt._training.loader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

from torch.utils.data import DataLoader, IterableDataset

from ddpckpt._observe import BatchYielded, observer
from ddpckpt._training.data import ResumableDistributedSampler
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
from ddpckpt._training.wrappers import is_stateful
from ddpckpt.errors import StateMismatchError


def loader_base(loader: Any) -> Any:
    """``super()`` of a loader whose class ddpckpt swapped at run time (for a direct subclass
    with a mixin's methods: :func:`ddpckpt._training.loader._swap_class`): its own class,
    the user's, which no static type knows."""
    return super(type(loader), loader)


class _StatefulDataset(Protocol):
    """An ``IterableDataset`` a tracked loader accepts: it keeps its own position."""

    def state_dict(self) -> Any: ...


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


class Tracking:
    """The bookkeeping mixed into a tracked DataLoader's class (see
    :mod:`ddpckpt._training.loader`)."""

    ddpckpt_per_rank = True  # each rank consumes its own shard: saved per rank

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        """A new loader of a tracked loader's class (``type(loader)(...)``: Lightning makes
        one to give it a distributed sampler, or for ``predict``) is tracked from its start:
        it had the tracking's methods without its state."""
        loader_base(self).__init__(*args, **kwargs)
        self._ddpckpt_init()

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
            keep_workers_seed = self.persistent_workers and new_iterator
            if (
                record is None
                and keep_workers_seed
                and ended is not None
                and ended.get("seed_draw") is not None
            ):
                inner = iter_with_saved_workers_seed(self, ended["seed_draw"])
            elif record is None:
                if new_iterator:
                    self._ddpckpt_seed_draw = capture_draw(self, samplers=False)
                inner = loader_base(self).__iter__()  # the loader class that was tracked
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
            # refuse_untrackable (above) refused an IterableDataset without state_dict()
            state["dataset"] = cast(_StatefulDataset, self.dataset).state_dict()
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
