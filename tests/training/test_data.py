"""The resumable sampler and per-sample randomness survive a resume exactly (ddpckpt._training.data)."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from ddpckpt.data import ResumableDistributedSampler, SeededDataset
from ddpckpt.errors import StateMismatchError
from toy_data import Augmented, Numbers


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60), replicas=st.integers(1, 6), shuffle=st.booleans(),
    drop_last=st.booleans(), seed=st.integers(0, 99), epoch=st.integers(0, 5),
)  # fmt: skip
def test_same_order_as_distributed_sampler(n, replicas, shuffle, drop_last, seed, epoch) -> None:
    if drop_last and n < replicas:
        return
    for rank in range(replicas):
        theirs = DistributedSampler(Numbers(n), replicas, rank, shuffle, seed, drop_last)
        ours = ResumableDistributedSampler(Numbers(n), replicas, rank, shuffle, seed, drop_last)
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def take(sampler, count: int) -> list[int]:
    iterator = iter(sampler)
    return [next(iterator) for _ in range(count)]


def test_resume_mid_epoch_continues_with_the_next_index() -> None:
    sampler = ResumableDistributedSampler(Numbers(50), 2, 1, seed=4)
    sampler.set_epoch(3)
    expected = list(sampler)
    sampler.set_epoch(3)
    first = take(sampler, 7)
    resumed = ResumableDistributedSampler(Numbers(50), 2, 1, seed=4)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(3)  # the usual loop calls set_epoch with the restored epoch: position kept
    assert len(resumed) == len(expected) - 7
    assert first + list(resumed) == expected
    resumed.set_epoch(3)
    assert list(resumed) == expected  # a new pass over the epoch starts from its beginning
    resumed.set_epoch(4)
    assert len(list(resumed)) == 25


def test_resume_at_an_epoch_boundary_neither_repeats_nor_skips() -> None:
    sampler = ResumableDistributedSampler(Numbers(12), 2, 0)
    sampler.set_epoch(0)
    list(sampler)  # the whole epoch 0
    state = sampler.state_dict()
    for restart in (0, 1):  # the loop may restart at the finished epoch or the next one
        resumed = ResumableDistributedSampler(Numbers(12), 2, 0)
        resumed.load_state_dict(state)
        seen = []
        for epoch in range(restart, 2):
            resumed.set_epoch(epoch)
            seen += list(resumed)
        fresh = ResumableDistributedSampler(Numbers(12), 2, 0)
        fresh.set_epoch(1)
        assert seen == list(fresh)


@pytest.mark.parametrize("new_world", [1, 2, 3, 5])
def test_world_size_change_covers_the_rest_of_the_epoch_once(new_world, caplog) -> None:
    n, old_world, batch, steps = 60, 4, 3, 2
    consumed = []
    samplers = [
        ResumableDistributedSampler(Numbers(n), old_world, r, seed=1) for r in range(old_world)
    ]
    for sampler in samplers:
        sampler.set_epoch(2)
        consumed += take(sampler, batch * steps)
    state = samplers[0].state_dict()
    rest = []
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for rank in range(new_world):
            sampler = ResumableDistributedSampler(Numbers(n), new_world, rank, seed=1)
            sampler.load_state_dict(state)
            sampler.set_epoch(2)
            rest += list(sampler)
    counts = Counter(consumed + rest)
    assert set(counts) == set(range(n))
    padding = -(n - len(consumed)) % new_world
    assert sum(counts.values()) - n == padding  # only DistributedSampler-style padding repeats
    if new_world != old_world:
        assert "continues on" in caplog.text and "global batch" in caplog.text


def test_a_different_dataset_or_seed_is_refused() -> None:
    state = ResumableDistributedSampler(Numbers(10), 1, 0, seed=1).state_dict()
    with pytest.raises(StateMismatchError, match="dataset_len=10"):
        ResumableDistributedSampler(Numbers(11), 1, 0, seed=1).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="seed=1"):
        ResumableDistributedSampler(Numbers(10), 1, 0, seed=2).load_state_dict(state)


def test_seeded_dataset_randomness_depends_only_on_the_sample() -> None:
    data = SeededDataset(Augmented(10), seed=5)
    sampler = ResumableDistributedSampler(Augmented(10), 1, 0)
    sampler.set_epoch(1)
    indices = list(sampler)
    forward = {int(i): data[i] for i in indices}
    backward = {int(i): data[i] for i in reversed(indices)}
    assert all(torch.equal(forward[i], backward[i]) for i in forward)
    sampler.set_epoch(2)
    other_epoch = {int(i): data[i] for i in sampler}
    assert not torch.equal(forward[0], other_epoch[0])  # each epoch augments anew
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    data[indices[0]]
    assert torch.equal(torch.rand(3), expected)  # the caller's generators are left alone


def test_a_sample_seeds_no_accelerators_generator(monkeypatch) -> None:
    """A sample used to seed CUDA's (and every accelerator's) generators through
    torch.manual_seed without putting them back: a GPU run's dropout stream was reseeded
    by each sample it loaded (before CUDA's start, its seeding queued, with a formatted
    stack each time: up to 1 ms a sample). Only the CPU generator is seeded, and restored."""
    seeded = []
    for backend in (torch.cuda, torch.xpu, torch.mtia):
        monkeypatch.setattr(backend, "manual_seed_all", seeded.append)
        monkeypatch.setattr(backend, "manual_seed", seeded.append)
    data = SeededDataset(Augmented(10), seed=5)
    first = data[3]
    torch.manual_seed(7)  # the caller's own seeding reaches them
    assert seeded == [7, 7, 7]
    assert torch.equal(data[3], first)
    assert seeded == [7, 7, 7]
