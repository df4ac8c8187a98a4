"""What makes a tracked loader's resume inexact is refused or said, never silent
(ddpckpt._training.loader_checks)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ddpckpt
from toy_data import Augmented


def test_an_untrackable_iterable_dataset_is_refused() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(ddpckpt.InexactResumeError, match="IterableDataset"):
        ddpckpt.data.track_loader(DataLoader(Stream(), batch_size=2))


def resumed_at(saved_at, restart, sampler_class=DistributedSampler) -> DataLoader:
    """A loader saved in epoch 1 after ``saved_at`` batches (None: at its end), loaded into a
    new one whose sampler is then set to epoch ``restart``."""
    sampler = sampler_class(Augmented(40), 2, 1, seed=3)
    loader = ddpckpt.data.track_loader(DataLoader(Augmented(40), sampler=sampler, batch_size=3))
    sampler.set_epoch(1)
    iterator = iter(loader)
    for _ in range(len(loader) if saved_at is None else saved_at):
        next(iterator)
    if saved_at is None:
        assert next(iterator, None) is None  # the pass ended
    state = loader.state_dict()
    sampler = sampler_class(Augmented(40), 2, 1, seed=3)
    resumed = ddpckpt.data.track_loader(DataLoader(Augmented(40), sampler=sampler, batch_size=3))
    resumed.load_state_dict(state)
    sampler.set_epoch(restart)
    return resumed


@pytest.mark.parametrize(
    ("saved_at", "restart", "message"),
    [
        (4, 2, "the remaining 3 batches of epoch 1 are skipped"),  # mid-epoch, restart at E + 1
        (4, 0, "epoch 0 is run again and epoch 1 from its start"),
        (None, 3, "epoch 2 is skipped"),  # saved at the epoch's end, restart at E + 2
        (None, 0, "epochs 0 to 1 are run again"),
    ],
)
def test_a_restart_at_another_epoch_than_the_saved_one_warns(
    saved_at, restart, message, caplog
) -> None:
    """The loop's epoch after a resume skips or repeats data: said on stderr, not silent."""
    resumed = resumed_at(saved_at, restart)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        iter(resumed)
    assert message in caplog.text and f"first epoch after the resume is {restart}" in caplog.text


def test_the_batches_skipped_are_counted_when_the_sampler_keeps_the_position(caplog) -> None:
    """A ResumableDistributedSampler keeps the position itself: the warning said 'the
    remaining -4 batches'."""
    resumed = resumed_at(4, 2, ddpckpt.data.ResumableDistributedSampler)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        iter(resumed)
    assert "the remaining 3 batches of epoch 1 are skipped" in caplog.text


@pytest.mark.parametrize(("saved_at", "restart"), [(4, 1), (None, 1), (None, 2)])
def test_a_restart_that_continues_the_saved_epoch_does_not_warn(saved_at, restart, caplog) -> None:
    resumed = resumed_at(saved_at, restart)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        list(resumed)
    assert "DataLoader" not in caplog.text
