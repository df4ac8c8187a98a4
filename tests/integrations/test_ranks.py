"""Per-rank state of the integrations: packed for the store and back unchanged; every
generator captured and restored; a rank the checkpoint has no state for."""

from __future__ import annotations

import logging
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ddpckpt.integrations import _ranks
from ddpckpt.integrations._ranks import capture_streams, own_streams, pack, restore_streams, unpack


def test_a_state_goes_through_the_store_unchanged() -> None:
    value = {
        "rng": capture_streams(),
        "loaders": [OrderedDict(position=3, finished=False, epoch=None)],
        "tensors": (torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.empty(0)),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    back = unpack(pack(value), "here")
    assert back["loaders"] == value["loaders"] and type(back["loaders"][0]) is OrderedDict
    assert all(torch.equal(a, b) for a, b in zip(back["tensors"], value["tensors"], strict=True))
    assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], value["half"])
    assert torch.equal(back["rng"]["torch"], value["rng"]["torch"])
    assert back["rng"]["python"] == value["rng"]["python"]


def test_every_generator_comes_back_numpy_included() -> None:
    streams = capture_streams()
    assert torch.is_tensor(streams["numpy"]["state"]["key"])  # any CheckpointIO stores it
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)  # training moved them on
    restore_streams(unpack(pack(streams), "here"), "here")
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_rank_beyond_the_saved_world_gets_derived_streams_and_rank_0_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    saved = [{"rng": capture_streams()}]
    monkeypatch.setattr(_ranks, "world_size", lambda: 4)
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert own_streams(saved, "ExactResume") is saved[0]["rng"]
    assert "saved on 1 ranks, resumed on 4: ranks 1 and up" in caplog.text
    monkeypatch.setenv("RANK", "3")
    derived = own_streams(saved, "ExactResume")
    assert not torch.equal(derived["torch"], saved[0]["rng"]["torch"])
    assert torch.equal(derived["torch"], own_streams(saved, "ExactResume")["torch"])  # the same
    restore_streams(derived, "here")  # numpy's key in the form restore_streams takes


@pytest.mark.parametrize(
    "state",
    [[], {"python": None, "torch": None, "numpy": {"no": "state"}}, {"numpy": 3}],
    ids=["not-a-dict", "numpy-without-state", "numpy-not-a-dict"],
)
def test_random_streams_that_are_not_ones_are_a_damaged_checkpoint(state) -> None:
    from ddpckpt.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match="ExactResume"):
        restore_streams(state, "ExactResume")
