"""Each rank's own state saved beside a framework's checkpoint (one process here; 2 ranks
under Lightning in test_lightning.py): the reference round-trips, a forged one is refused
before anything is read, and pruning keeps what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpckpt.errors import CorruptCheckpointError, InexactResumeError
from ddpckpt.integrations._rank_files import load_own, prune_own, save_own


def _state(seed: int) -> dict:
    return {"rng": {"torch": torch.arange(seed, seed + 4)}, "loaders": [{"position": seed}]}


def test_a_rank_s_state_comes_back_and_a_later_save_under_the_same_name_is_told_apart(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    first = save_own(checkpoint, 7, _state(1))
    assert first["saved"] == ".ddpckpt-ranks/last.ckpt@step-0000000007"
    state, world = load_own(checkpoint, first)
    assert world == 1 and state["loaders"] == [{"position": 1}]
    assert torch.equal(state["rng"]["torch"], torch.arange(1, 5))
    second = save_own(checkpoint, 7, _state(2))  # replaced: the same name and step
    assert second["id"] != first["id"]
    with pytest.raises(InexactResumeError, match="a later save of this checkpoint"):
        load_own(checkpoint, first)
    assert load_own(checkpoint, second)[0]["loaders"] == [{"position": 2}]


@pytest.mark.parametrize(
    "reference",
    [
        None,
        [],
        {"saved": "../outside@step-0000000001", "id": "a"},
        {"saved": ".ddpckpt-ranks/../x@step-0000000001", "id": "a"},
        {"saved": ".ddpckpt-ranks/..@step-0000000001", "id": "a"},
        {"saved": "/abs/.ddpckpt-ranks/x@step-0000000001", "id": "a"},
        {"saved": ".ddpckpt-ranks/x@step-1", "id": "a"},
        {"saved": ".ddpckpt-ranks/x@step-0000000001", "id": 5},
    ],
)
def test_a_forged_reference_is_refused_before_anything_is_read(tmp_path, reference) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"last\.ckpt"):
        load_own(str(tmp_path / "last.ckpt"), reference)


def test_a_reference_to_state_that_is_gone_says_what_to_do(tmp_path: Path) -> None:
    reference = save_own(str(tmp_path / "a" / "last.ckpt"), 1, _state(1))
    with pytest.raises(InexactResumeError, match=r"which is gone: copy or move the checkpoint"):
        load_own(str(tmp_path / "b" / "last.ckpt"), reference)  # moved without it


def test_pruning_keeps_the_newest_of_one_checkpoint_and_nothing_else(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_own(str(tmp_path / "last.ckpt"), step, _state(step))
    save_own(str(tmp_path / "epoch=0-step=3.ckpt"), 3, _state(3))
    prune_own(str(tmp_path / "last.ckpt"), keep=2)
    names = sorted(p.name for p in (tmp_path / ".ddpckpt-ranks").iterdir())
    assert names == [
        "epoch=0-step=3.ckpt@step-0000000003",
        "last.ckpt@step-0000000002",
        "last.ckpt@step-0000000003",
    ]
    prune_own(str(tmp_path / "epoch=0-step=3.ckpt"), keep=0)
    prune_own(str(tmp_path / "never-saved.ckpt"), keep=0)
    assert sorted(p.name for p in (tmp_path / ".ddpckpt-ranks").iterdir()) == names[1:]
