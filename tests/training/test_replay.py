"""A tracked DataLoader resumes in the saved order whatever draws its order (ddpckpt._training.replay)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import ddpckpt


class WorkerSeeded(torch.utils.data.Dataset):
    """Each sample with the seed of the worker that loaded it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([i, -1 if info is None else info.seed])


def persistent(workers: int, with_generator: bool) -> DataLoader:
    options = {}
    if with_generator:
        options["generator"] = torch.Generator().manual_seed(1)
    loader = DataLoader(WorkerSeeded(), batch_size=2, shuffle=True, num_workers=workers,
                        persistent_workers=True, **options)  # fmt: skip
    return ddpckpt.data.track_loader(loader)


def rows(batches) -> list[list[int]]:
    return [row for batch in batches for row in batch.tolist()]


@pytest.mark.processes
@pytest.mark.parametrize(("workers", "with_generator"), [(1, False), (2, True)])
def test_persistent_workers_resume_mid_epoch_after_the_first(tmp_path, workers, with_generator):
    """Later passes of persistent workers draw no base seed, the replay's new iterator does."""
    model = torch.nn.Linear(1, 1)
    torch.manual_seed(0)
    loader = persistent(workers, with_generator)
    epochs = [rows(loader) for _ in range(3)]
    torch.manual_seed(0)
    loader = persistent(workers, with_generator)
    assert rows(loader) == epochs[0]
    iterator = iter(loader)
    got = rows(next(iterator) for _ in range(2))
    ddpckpt.save(tmp_path / "c", model=model, extra={"loader": loader})
    del iterator, loader
    torch.manual_seed(5)
    resumed = persistent(workers, with_generator)
    ddpckpt.load(tmp_path / "c", model=model, extra={"loader": resumed})
    before = torch.get_rng_state()
    rest = rows(resumed)
    assert torch.equal(torch.get_rng_state(), before)  # the main stream is left alone
    assert got + rest == epochs[1]  # same order and the original workers' seeds
    assert rows(resumed) == epochs[2]  # the next epoch as well


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


SAMPLERS = {
    "random": lambda: {"sampler": RandomSampler(range(12), generator=generator())},
    "replacement": lambda: {  # draws lazily, 32 indices at a time
        "sampler": RandomSampler(range(12), True, 70, generator=generator())
    },
    "weighted": lambda: {
        "sampler": WeightedRandomSampler(torch.arange(1.0, 13.0), 12, generator=generator())
    },
    "subset": lambda: {"sampler": SubsetRandomSampler(range(2, 12), generator=generator())},
    "batch": lambda: {
        "batch_sampler": BatchSampler(RandomSampler(range(12), generator=generator()), 2, False)
    },
}


def own(kind: str, workers: int) -> DataLoader:
    options = SAMPLERS[kind]()
    if "batch_sampler" not in options:
        options["batch_size"] = 2
    return ddpckpt.data.track_loader(DataLoader(list(range(12)), num_workers=workers, **options))


@pytest.mark.processes
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_sampler_with_its_own_generator_resumes_in_its_order(kind) -> None:
    workers = 2 if kind == "replacement" else 0
    loader = own(kind, workers)
    epochs = [rows(loader) for _ in range(3)]
    assert epochs[1] != epochs[2]
    loader = own(kind, workers)
    rows(loader)
    iterator = iter(loader)
    got = rows(next(iterator) for _ in range(3))
    state = loader.state_dict()
    del iterator
    resumed = own(kind, workers)
    resumed.load_state_dict(state)
    assert got + rows(resumed) == epochs[1], "mid-epoch"
    assert rows(resumed) == epochs[2]
    loader = own(kind, workers)
    rows(loader)
    resumed = own(kind, workers)
    resumed.load_state_dict(loader.state_dict())
    assert [rows(resumed), rows(resumed)] == epochs[1:], "after a finished epoch"


def test_a_sampler_generator_that_cannot_be_saved_is_refused(tmp_path) -> None:
    class PythonShuffle(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.generator = random.Random(0)

        def __len__(self) -> int:
            return 8

        def __iter__(self):
            order = list(range(8))
            self.generator.shuffle(order)
            return iter(order)

    loader = ddpckpt.data.track_loader(DataLoader(list(range(8)), sampler=PythonShuffle()))
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ddpckpt.InexactResumeError, match=r"Random.*torch\.Generator"):
        ddpckpt.save(tmp_path / "c", model=torch.nn.Linear(1, 1), extra={"loader": loader})


def test_a_mid_epoch_state_without_the_draws_is_refused() -> None:
    """A loader state saved before the random draws were recorded cannot replay its order."""
    loader = own("random", 0)
    iterator = iter(loader)
    next(iterator)
    state = {k: v for k, v in loader.state_dict().items() if k not in ("seed_draw", "order_draw")}
    with pytest.raises(ddpckpt.errors.StateMismatchError, match="earlier ddpckpt"):
        own("random", 0).load_state_dict(state)
    with pytest.raises(ddpckpt.errors.StateMismatchError, match="1 generator"):
        ddpckpt.data.track_loader(DataLoader(list(range(12)), batch_size=2)).load_state_dict(
            loader.state_dict()
        )
