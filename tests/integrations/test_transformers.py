"""ddpckpt.integrations.transformers against the real Trainer: a DDP run SIGKILLed inside an
epoch resumes bit for bit (losses, logged losses, weights), and its checkpoint exports to a
from_pretrained directory."""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import pytest

import ddpckpt
from killed_run import assert_resumed_exactly, launch_killed_run
from launch import WORKER

pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="no transformers extra")

SCRIPT = WORKER.with_name("transformers_worker.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_run_killed_inside_an_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    run = launch_killed_run(SCRIPT, tmp_path)
    assert_resumed_exactly(run, resumed_from=9, steps=7)  # inside the second epoch of 8 steps
    for rank in (0, 1):  # the first logged loss after 9 averages steps 9 and 10
        assert run.result(rank)["logged_losses"] == run.result(rank)["reference"]["logged_losses"]
    events = run.result(0)["checkpoint_events"]
    # 3 and 6 came with checkpoint 9; 9's own was logged after 9 was written, by the killed run
    assert [e["step"] for e in events] == [3, 6, 12, 15, 16]
    assert all(e["checkpoint/size_bytes"] > 0 and e["checkpoint/verified"] == 1 for e in events)
    directory = tmp_path / "checkpoints-ddpckpt"
    assert run.result(0)["checkpoints"] == ["checkpoint-15", "checkpoint-16"]  # save_total_limit=2
    assert run.result(0)["exported"] == run.result(0)["weights"]  # from_pretrained: the same model
    assert sorted(os.listdir(tmp_path / "release")) == ["config.json", "generation_config.json",
                                                        "model.safetensors"]  # fmt: skip
    for name in os.listdir(directory / "checkpoint-16"):  # nothing pickled
        assert name == "trainer_state.json" or name.endswith((".safetensors", "manifest.json"))
    ddpckpt.verify(str(directory / "checkpoint-16"))
