"""ddpckpt.integrations.lightning against the real Lightning: a DDP run SIGKILLed inside an
epoch resumes bit for bit; the CheckpointIO on its own; a missing Lightning."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpckpt
from killed_run import assert_resumed_exactly, launch_killed_run
from launch import WORKER

# Lightning is imported by the tests that run, not at collection (every xdist worker collects).
pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="no lightning extra")
SCRIPT = WORKER.with_name("lightning_worker.py")


@pytest.fixture
def io() -> Any:
    from ddpckpt.integrations.lightning import DdpckptCheckpointIO

    return DdpckptCheckpointIO()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_run_killed_inside_an_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    run = launch_killed_run(SCRIPT, tmp_path)
    assert_resumed_exactly(run, resumed_from=9, steps=7)  # inside the second epoch of 8 steps
    steps = [step for step, metrics in run.result(0)["logged"]]
    assert steps == [12, 12, 15, 15]  # the checkpoints after the resume, and last.ckpt
    for _, metrics in run.result(0)["logged"]:
        assert metrics["checkpoint/size_bytes"] > 0 and metrics["checkpoint/verified"] == 1.0
    last = tmp_path / "checkpoints-ddpckpt" / "last.ckpt"
    assert (last / "manifest.json").is_file()
    ddpckpt.verify(str(last))


def test_the_checkpoint_io_round_trips_lightnings_dict(tmp_path: Path, io: Any) -> None:
    from lightning.pytorch.utilities.parsing import AttributeDict

    checkpoint = {
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": AttributeDict(lr=0.1, layers=[4, 2]),
        "epoch": 1,
        "global_step": 9,
    }
    path = tmp_path / "epoch=1-step=9.ckpt"
    io.save_checkpoint(checkpoint, path)
    io.save_checkpoint({**checkpoint, "global_step": 10}, path)  # last.ckpt: saved again
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["global_step"] == 10
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": [4, 2]}
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    assert ddpckpt.latest(tmp_path) == str(path)
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # gone already: nothing to do


def test_a_file_that_is_not_a_checkpoint_is_not_removed(tmp_path: Path, io: Any, caplog) -> None:
    path = tmp_path / "old.ckpt"
    path.write_bytes(b"a torch.save file")
    io.remove_checkpoint(path)
    assert path.exists()
    assert "not a ddpckpt checkpoint" in caplog.text


def test_it_composes_with_lightnings_async_checkpoint_io(tmp_path: Path, io: Any) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    wrapped = AsyncCheckpointIO(io)
    weights = torch.ones(3)
    wrapped.save_checkpoint({"state_dict": {"w": weights}, "global_step": 1}, tmp_path / "a.ckpt")
    weights.add_(1)  # training goes on while the save runs: the checkpoint keeps the old value
    wrapped.teardown()  # waits for the save
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(3))
