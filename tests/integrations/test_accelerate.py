"""ddpckpt.integrations.accelerate against the real Accelerate: a DDP run SIGKILLed inside an
epoch resumes bit for bit; every prepared object round-trips; a loader first seen while it
is iterated is refused."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpckpt
from killed_run import assert_resumed_exactly, launch_killed_run
from launch import WORKER

# Accelerate is imported by the tests that run, not at collection (every xdist worker collects).
pytestmark = pytest.mark.skipif(find_spec("accelerate") is None, reason="no accelerate extra")
SCRIPT = WORKER.with_name("accelerate_worker.py")


@pytest.mark.long
def test_a_run_killed_inside_an_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    run = launch_killed_run(SCRIPT, tmp_path)
    assert_resumed_exactly(run, resumed_from=9, steps=7)  # inside the second epoch of 8 steps
    steps = [step for step, metrics in run.result(0)["logged"]]
    assert steps == [12, 15]  # the checkpoints of the resumed run, through accelerator.log
    assert all(m["checkpoint/size_bytes"] > 0 for _, m in run.result(0)["logged"])
    ddpckpt.verify(str(tmp_path / "checkpoints-ddpckpt" / "step-15"))


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_every_prepared_object_round_trips_and_the_loader_continues(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from ddpckpt.integrations.accelerate import load_state, save_state, training_state

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = TensorDataset(torch.arange(40.0).reshape(10, 4))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # as on a GPU with fp16
    accelerator.scaler.scale(torch.ones(()))  # the scaler's state exists from its first use
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    training_state(accelerator)  # before the first batch
    batches = iter(loader)
    for _ in range(2):
        model(next(batches)[0]).sum().backward()
        optimizer.step()
        scheduler.step()
        accelerator.step += 1
    counter.n = 7
    save_state(accelerator, tmp_path / "a", step=2)
    rest = [b[0].tolist() for b in batches]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.tensor(rest[0])).sum().backward()
    optimizer.step()
    scheduler.step()
    accelerator.scaler.update(new_scale=2.0)
    counter.n, accelerator.step = 0, 0

    assert load_state(accelerator, tmp_path / "a").step == 2
    # Saved again before the loop iterates: the loaded position, not one batch less (it
    # was: the held-ahead batch was subtracted from a position already corrected).
    save_state(accelerator, tmp_path / "again", step=2)
    assert load_state(accelerator, tmp_path / "again").step == 2
    assert [b[0].tolist() for b in loader] == rest  # the rest of the epoch, in order
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert scheduler.get_last_lr() == [0.025]
    assert accelerator.scaler.get_scale() == 1024.0
    assert (counter.n, accelerator.step) == (7, 2)
    assert len(loader) == 5  # the whole epoch, as Accelerate says


def test_a_loader_first_seen_while_it_is_iterated_is_refused(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from ddpckpt.integrations.accelerate import save_state

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    batches = iter(loader)
    next(batches)
    with pytest.raises(ddpckpt.InexactResumeError, match="before the training loop"):
        save_state(accelerator, tmp_path / "a")
