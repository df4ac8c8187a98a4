"""A tracked DataLoader's position is what training consumed, through workers, epochs and
checkpoints (ddpckpt._training.loader)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ddpckpt
import ddpckpt._training.loader as loader_module
from ddpckpt._training.loader import resumable_loader
from ddpckpt.data import ResumableDistributedSampler, SeededDataset
from ddpckpt.errors import InexactResumeError, StateMismatchError
from toy_data import Augmented, Numbers


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_exactly_mid_epoch(workers) -> None:
    def make():
        sampler = ResumableDistributedSampler(Augmented(40), 2, 1, seed=3)
        return sampler, resumable_loader(
            Augmented(40), sampler=sampler, batch_size=3, num_workers=workers
        )

    sampler, loader = make()
    full = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        full += list(loader)
    sampler, loader = make()
    sampler.set_epoch(0)
    got = list(loader)
    sampler.set_epoch(1)
    iterator = iter(loader)
    got += [next(iterator) for _ in range(4)]
    state = {"sampler": sampler.state_dict(), "loader": loader.state_dict()}
    del iterator
    sampler, loader = make()
    sampler.load_state_dict(state["sampler"])
    loader.load_state_dict(state["loader"])
    sampler.set_epoch(1)
    got += list(loader)
    assert len(got) == len(full) and all(torch.equal(a, b) for a, b in zip(got, full, strict=True))


@pytest.mark.processes
def test_loader_and_sampler_roundtrip_through_a_checkpoint(tmp_path) -> None:
    model = torch.nn.Linear(1, 1)
    sampler = ResumableDistributedSampler(Numbers(20), 1, 0)
    loader = resumable_loader(Numbers(20), sampler=sampler, batch_size=4, num_workers=1)
    sampler.set_epoch(1)
    iterator = iter(loader)
    expected_rest = None
    for _ in range(2):
        next(iterator)
    ddpckpt.save(tmp_path / "c", model=model, extra={"sampler": sampler, "loader": loader})
    expected_rest = [b.tolist() for b in iterator]
    del iterator
    sampler2 = ResumableDistributedSampler(Numbers(20), 1, 0)
    loader2 = resumable_loader(Numbers(20), sampler=sampler2, batch_size=4, num_workers=1)
    ddpckpt.load(tmp_path / "c", model=model, extra={"sampler": sampler2, "loader": loader2})
    sampler2.set_epoch(1)
    assert [b.tolist() for b in loader2] == expected_rest
    with pytest.raises(StateMismatchError, match="per-rank state"):
        ddpckpt.load(tmp_path / "c", model=model, extra={"sampler": sampler2, "loader": sampler2})


def plain(sampler, workers=2, **kwargs) -> DataLoader:
    return DataLoader(SeededDataset(Augmented(40), 1), sampler=sampler, batch_size=3,
                      num_workers=workers, **kwargs)  # fmt: skip


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


SAMPLERS = {
    "resumable": lambda: ResumableDistributedSampler(Augmented(40), 2, 1, seed=3),
    "distributed": lambda: DistributedSampler(Augmented(40), 2, 1, seed=3),
    "random": lambda: torch.utils.data.RandomSampler(Augmented(40)),
}


@pytest.mark.processes
@pytest.mark.parametrize("kind", list(SAMPLERS))
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_tracked_loader_position_is_what_training_consumed(kind, workers, persistent) -> None:
    """Prefetching workers do not move the position; len() is what remains, all epoch."""
    options = {"persistent_workers": persistent}
    torch.manual_seed(0)
    sampler = SAMPLERS[kind]()
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(2)
    full = list(ddpckpt.data.track_loader(plain(sampler, workers, **options)))
    torch.manual_seed(0)
    sampler = SAMPLERS[kind]()
    loader = ddpckpt.data.track_loader(plain(sampler, workers, **options))
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(2)
    iterator = iter(loader)
    got = [next(iterator) for _ in range(4)]
    state = loader.state_dict()
    assert state["position"] == 4 and not state["finished"]
    del iterator
    resumed_sampler = SAMPLERS[kind]()
    resumed = ddpckpt.data.track_loader(plain(resumed_sampler, workers, **options))
    resumed.load_state_dict(state)
    if hasattr(resumed_sampler, "set_epoch"):
        resumed_sampler.set_epoch(2)
    assert len(resumed) == len(full) - 4
    rest = []
    torch.set_rng_state(
        state["seed_draw"]["rng"]
    )  # anything: iter() must not draw from the main stream
    before = torch.get_rng_state()
    for batch in resumed:
        assert len(resumed) == len(full) - 4  # fixed while the epoch is iterated
        rest.append(batch)
    assert torch.equal(torch.get_rng_state(), before)
    assert same(got + rest, full)


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["resumable", "distributed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_finished_epoch_is_neither_replayed_nor_skipped(kind, workers) -> None:
    """The imagenet pattern: save after the epoch's loop; restart at that epoch or the next."""
    sampler = SAMPLERS[kind]()
    loader = ddpckpt.data.track_loader(plain(sampler, workers))
    sampler.set_epoch(0)
    list(loader)
    state = loader.state_dict()
    assert state["finished"] and state["position"] == len(loader)
    sampler.set_epoch(1)
    epoch1 = list(loader)
    for restart in (0, 1):
        sampler = SAMPLERS[kind]()
        resumed = ddpckpt.data.track_loader(plain(sampler, workers))
        resumed.load_state_dict(state)
        seen = []
        for epoch in range(restart, 2):
            sampler.set_epoch(epoch)
            seen += list(resumed)
        assert same(seen, epoch1), restart


@pytest.mark.processes
def test_a_sampler_saved_without_its_prefetching_loader_is_refused(tmp_path) -> None:
    sampler = ResumableDistributedSampler(Numbers(16), 1, 0)
    loader = DataLoader(Numbers(16), sampler=sampler, batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ddpckpt.InexactResumeError, match="Save the loader too"):
        ddpckpt.save(tmp_path / "a", model=model, extra={"sampler": sampler})
    with pytest.raises(ddpckpt.InexactResumeError, match="first sees this DataLoader"):
        ddpckpt.save(tmp_path / "b", model=model, extra={"sampler": sampler, "loader": loader})
    del iterator


@pytest.mark.processes
def test_a_loader_tracked_by_the_checkpointer_saves_what_was_consumed(tmp_path) -> None:
    """extra={"sampler": ...} alone is exact when the loader is tracked (issue: 14 vs 18)."""
    sampler = ResumableDistributedSampler(Numbers(64), 2, 0)
    loader = DataLoader(Numbers(64), sampler=sampler, batch_size=2, num_workers=2)
    model = torch.nn.Linear(1, 1)
    ckpt = ddpckpt.Checkpointer(tmp_path / "run", model=model, extra={"loader": loader})
    sampler.set_epoch(0)
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(3)]
    ckpt.save(1, epoch=0)
    ddpckpt.save(tmp_path / "sampler-only", model=model, extra={"sampler": sampler})
    rest = [b.tolist() for b in iterator]
    ckpt.close()
    for extra in ("run", "sampler-only"):
        sampler2 = ResumableDistributedSampler(Numbers(64), 2, 0)
        loader2 = DataLoader(Numbers(64), sampler=sampler2, batch_size=2, num_workers=2)
        if extra == "run":
            with ddpckpt.Checkpointer(
                tmp_path / "run", model=model, extra={"loader": loader2}
            ) as again:
                again.resume()
        else:
            ddpckpt.load(tmp_path / extra, model=model, extra={"sampler": sampler2})
            ddpckpt.data.track_loader(loader2)
        sampler2.set_epoch(0)
        assert len(loader2) == len(rest) == 13
        assert [b.tolist() for b in loader2] == rest, extra
    assert len(first) == 3


@pytest.mark.processes
def test_a_checkpointer_built_while_its_loader_iterates_refuses_to_save(tmp_path) -> None:
    """Tracking a loader partway through its pass would save a position that leaves out
    the batches already yielded (the resume replayed them): the save says so instead."""
    loader = DataLoader(Numbers(20), batch_size=2, shuffle=True, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    ckpt = ddpckpt.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1),
                                extra={"loader": loader}, on_error="raise")  # fmt: skip
    with pytest.raises(ddpckpt.InexactResumeError, match=r"extra\['loader'\]"):
        ckpt.save(1)
    ckpt.close()
    assert ckpt.steps() == []


def test_a_dead_weak_proxy_elsewhere_does_not_break_a_save(tmp_path) -> None:
    """Whether a loader is being iterated is found among all live objects; a weakref.proxy
    whose object is gone (libraries keep them) must not make that search raise."""

    class Owner:
        pass

    owner = Owner()
    proxies = [weakref.proxy(owner)]
    del owner
    loader = DataLoader(Numbers(8), batch_size=2)
    ddpckpt.save(tmp_path / "c", model=torch.nn.Linear(1, 1), extra={"loader": loader})
    assert len(proxies) == 1


def test_a_stateful_iterable_dataset_resumes_with_num_workers_0() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __init__(self):
            self.at = 0

        def __iter__(self):
            while self.at < 10:
                self.at += 1
                yield self.at - 1

        def state_dict(self):
            return {"at": self.at}

        def load_state_dict(self, state):
            self.at = state["at"]

    loader = ddpckpt.data.track_loader(DataLoader(Stream(), batch_size=2))
    iterator = iter(loader)
    [next(iterator) for _ in range(2)]
    resumed = ddpckpt.data.track_loader(DataLoader(Stream(), batch_size=2))
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == [[4, 5], [6, 7], [8, 9]]


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_saved_after_an_epoch_starts_the_next_one_fresh(tmp_path, workers):
    """torchdata's own snapshot of a finished pass would override set_epoch at the next iter()."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        sampler = ResumableDistributedSampler(Numbers(24), 2, 0, seed=1)
        loader = stateful.StatefulDataLoader(Numbers(24), sampler=sampler, batch_size=3,
                                             num_workers=workers)  # fmt: skip
        return sampler, loader

    model = torch.nn.Linear(1, 1)
    sampler, loader = make()
    sampler.set_epoch(0)
    list(loader)
    ddpckpt.save(tmp_path / "end", model=model, extra={"loader": loader})
    sampler.set_epoch(1)
    epoch1 = [b.tolist() for b in loader]
    for restart in (0, 1):
        sampler, loader = make()
        ddpckpt.load(tmp_path / "end", model=model, extra={"loader": loader})
        seen = []
        for epoch in range(restart, 2):
            sampler.set_epoch(epoch)
            seen += [b.tolist() for b in loader]
        assert seen == epoch1, restart


def test_a_position_without_a_resumable_sampler_is_refused_on_another_world_size() -> None:
    loader = ddpckpt.data.track_loader(plain(DistributedSampler(Augmented(40), 2, 0), workers=0))
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = ddpckpt.data.track_loader(plain(DistributedSampler(Augmented(40), 3, 0), workers=0))
    resumed.load_state_dict(state)
    with pytest.raises(ddpckpt.InexactResumeError, match="ResumableDistributedSampler"):
        iter(resumed)


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["distributed", "random", "shuffle"])
def test_persistent_workers_resumed_after_an_epoch_end_do_not_shift_the_random_streams(
    kind,
) -> None:
    """Persistent workers keep their base seed across epochs: the resumed run's new workers
    must not draw one from the main random stream (dropout) or the loader's generator."""

    def make():
        if kind == "shuffle":
            generator = torch.Generator().manual_seed(5)
            loader = DataLoader(SeededDataset(Augmented(40), 1), batch_size=3, shuffle=True,
                                num_workers=2, persistent_workers=True, generator=generator)  # fmt: skip
            return None, ddpckpt.data.track_loader(loader)
        sampler = SAMPLERS[kind]()
        return sampler, ddpckpt.data.track_loader(plain(sampler, 2, persistent_workers=True))

    def epoch(sampler, loader, number):
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(number)
        batches = list(loader)
        generator = loader.generator
        return batches, torch.randn(4), None if generator is None else generator.get_state()

    torch.manual_seed(0)
    sampler, loader = make()
    epoch(sampler, loader, 0)
    state, rng = loader.state_dict(), torch.get_rng_state()
    expected = epoch(sampler, loader, 1)
    torch.manual_seed(1)  # a new process
    sampler, resumed = make()
    torch.set_rng_state(rng)
    resumed.load_state_dict(state)
    got = epoch(sampler, resumed, 1)
    assert same(got[0], expected[0])
    assert torch.equal(got[1], expected[1])  # the main stream continues as it would have
    if kind == "shuffle":
        assert torch.equal(got[2], expected[2])


@pytest.mark.processes
def test_a_dropped_loader_with_persistent_workers_stops_them_at_once() -> None:
    """Tracking once tied the loader and its worker iterator in a cycle: only the garbage
    collector freed them, after the iterator's queues, so each worker waited out torch's
    5 s timeout and was terminated (10 s for a loader of 2 workers, every time)."""
    loader = ddpckpt.data.track_loader(plain(SAMPLERS["random"](), 2, persistent_workers=True))
    list(loader)
    iterator = iter(loader)
    next(iterator)
    workers = loader._iterator._workers
    gone = weakref.ref(loader)
    gc.disable()
    try:
        del loader, iterator
        assert gone() is None  # freed by its last reference: torch stops the workers then
        assert [w.is_alive() for w in workers] == [False, False]
    finally:
        gc.enable()


def test_a_deep_copy_of_a_tracked_loader_records_its_own_position() -> None:
    """Its index stream belongs to the copy: the copy's mid-epoch state records the random
    state its order was drawn from, as the original's does."""
    import copy

    loader = ddpckpt.data.track_loader(plain(SAMPLERS["random"](), 0))
    twin = copy.deepcopy(loader)
    assert twin._ddpckpt_stream.loader is twin
    iterator = iter(twin)
    next(iterator)
    state = twin.state_dict()
    assert state["order_draw"] is not None and state["position"] == 1
    assert loader.state_dict()["started"] is False  # the original untouched


class Prefetching(DataLoader):
    """A wrapper as Ray Train's prepare_data_loader makes: it copies the DataLoader's
    attributes, iterates it, and holds the next batch ahead of training."""

    def __init__(self, base: DataLoader) -> None:
        self.__dict__.update(base.__dict__)
        self._dataloader = base
        self.held = None

    def __iter__(self):
        self.inner = iter(self._dataloader)
        self.held = next(self.inner, None)
        return self

    def __next__(self):
        batch, self.held = self.held, next(self.inner, None)
        if batch is None:
            raise StopIteration
        return batch

    def rest(self) -> list[list[int]]:
        """The batches left in this pass (no new pass: next() alone)."""
        return [b.tolist() for b in iter(lambda: next(self, None), None)]


def test_a_dataloader_that_iterates_another_it_wraps_is_refused_by_name() -> None:
    """It used to be tracked as a plain DataLoader: its own __iter__ bypassed the tracking,
    its saved position stayed at the epoch's start, and a resume silently trained the
    epoch's first batches again."""
    wrapper = Prefetching(DataLoader(Numbers(12), batch_size=2, shuffle=True))
    with pytest.raises(
        InexactResumeError, match=r"test_loader\.Prefetching is a DataLoader subclass"
    ):
        ddpckpt.TrainingState(model=torch.nn.Linear(1, 1), loader=wrapper)


def test_a_registered_prefetching_wrapper_saves_what_training_consumed(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setitem(loader_module._WRAPPERS, Prefetching, ("_dataloader", "held"))
    model = torch.nn.Linear(1, 1)

    def wrapped() -> Prefetching:
        torch.manual_seed(0)
        return Prefetching(DataLoader(Numbers(12), batch_size=2, shuffle=True))

    first = wrapped()
    state = ddpckpt.TrainingState(model=model, loader=first)
    iterator = iter(first)
    seen = [next(iterator).tolist() for _ in range(2)]  # the third batch is held ahead
    ddpckpt.save(tmp_path / "c", state)
    rest = iterator.rest()
    assert len(seen) + len(rest) == 6
    second = wrapped()
    ddpckpt.load(tmp_path / "c", ddpckpt.TrainingState(model=model, loader=second))
    assert second.state_dict()["position"] == 2  # loaded, not yet iterated: nothing held
    ddpckpt.save(tmp_path / "again", ddpckpt.TrainingState(model=model, loader=second))
    third = wrapped()
    ddpckpt.load(tmp_path / "again", ddpckpt.TrainingState(model=model, loader=third))
    assert [b.tolist() for b in third] == rest  # from the third batch, in the saved order


class Moving(DataLoader):
    """A subclass whose own __iter__ builds on DataLoader's: tracked as any DataLoader."""

    def __iter__(self):
        return (batch * 10 for batch in super().__iter__())


def test_a_subclass_iterating_through_super_resumes_exactly(tmp_path) -> None:
    model = torch.nn.Linear(1, 1)

    def loader() -> Moving:
        torch.manual_seed(0)
        return Moving(Numbers(12), batch_size=2, shuffle=True)

    first = loader()
    state = ddpckpt.TrainingState(model=model, loader=first)
    iterator = iter(first)
    next(iterator), next(iterator)
    ddpckpt.save(tmp_path / "c", state)
    rest = [b.tolist() for b in iterator]
    second = loader()
    ddpckpt.load(tmp_path / "c", ddpckpt.TrainingState(model=model, loader=second))
    assert [b.tolist() for b in second] == rest and len(rest) == 4


def test_the_tracked_loader_of_a_registered_wrapper_is_its_base_once_tracked(monkeypatch) -> None:
    monkeypatch.setitem(loader_module._WRAPPERS, Prefetching, ("_dataloader", "held"))

    class Later(Prefetching):  # a user's subclass of it: never swapped, so never tracked
        pass

    wrapper, other = Prefetching(DataLoader(Numbers(4))), Later(DataLoader(Numbers(4)))
    plain = DataLoader(Numbers(4))
    assert loader_module.tracked_loader(wrapper) is wrapper  # not tracked yet
    ddpckpt.data.track_loader(wrapper)
    ddpckpt.data.track_loader(plain)
    assert loader_module.tracked_loader(wrapper) is wrapper._dataloader
    assert loader_module.tracked_loader(plain) is plain
    assert loader_module.tracked_loader(other) is other


def test_a_loader_made_anew_from_a_tracked_loaders_class_is_tracked_from_its_start() -> None:
    """Lightning re-creates a loader with ``type(loader)(...)`` to give it a distributed
    sampler (and for ``predict``): made from a tracked loader, it had the tracking's methods
    without its state, and its first iteration raised AttributeError."""
    loader = DataLoader(Numbers(8), batch_size=2, shuffle=True)
    ddpckpt.data.track_loader(loader)
    again = type(loader)(loader.dataset, batch_size=2)
    assert [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert again.state_dict()["position"] == 4 and len(again) == 4
