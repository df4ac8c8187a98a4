"""Objects that do not fit the checkpoint are refused before anything changes, naming the
object and what to do (ddpckpt._io.load_checks)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt import TrainingState
from ddpckpt.errors import StateMismatchError
from io_helpers import Counter, assert_state_equal


@pytest.fixture
def ckpt_dir(ckpt_root) -> str:
    """Where each test saves: on disk, then in memory (``ckpt_root``)."""
    return os.fspath(ckpt_root / "ckpt")


def test_a_scaler_saved_disabled_into_an_enabled_one_fails_before_any_change(ckpt_dir) -> None:
    model, scaler = make_mlp(), torch.amp.GradScaler("cpu", enabled=False)
    ddpckpt.save(ckpt_dir, TrainingState(net=model, amp=scaler))
    live = make_mlp(seed=1)
    before = copy.deepcopy(live.state_dict())
    live_scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(StateMismatchError, match="scaler 'amp' was saved disabled"):
        ddpckpt.load(ckpt_dir, TrainingState(net=live, amp=live_scaler))
    assert_state_equal(live.state_dict(), before)
    ddpckpt.load(ckpt_dir, TrainingState(net=live, amp=torch.amp.GradScaler("cpu", enabled=False)))


def test_objects_passed_but_not_stored_are_errors_naming_them(ckpt_dir) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, model=model, extra={"data": Counter(), "n": 1})
    with pytest.raises(
        StateMismatchError, match="passed optimizer= but the checkpoint has no optimizer"
    ):
        ddpckpt.load(ckpt_dir, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(StateMismatchError, match=r"extra\['ema'\] is not in the checkpoint"):
        ddpckpt.load(ckpt_dir, model=model, extra={"ema": Counter()})
    with pytest.raises(StateMismatchError, match=r"extra\['n'\] was saved as a plain value"):
        ddpckpt.load(ckpt_dir, model=model, extra={"n": Counter()})


def test_an_object_saved_in_extra_and_loaded_by_its_role_says_how_to_load_it(ckpt_dir) -> None:
    # Moving from the keyword shorthand to a TrainingState: an EMA module saved in extra=.
    model = make_mlp()
    ema = torch.optim.swa_utils.AveragedModel(model)
    ddpckpt.save(ckpt_dir, model=model, extra={"ema": ema})
    with pytest.raises(StateMismatchError, match=r"'ema' for its model.*extra=\{'ema': \.\.\.\}"):
        ddpckpt.load(ckpt_dir, TrainingState(model=model, ema=ema))
    ddpckpt.load(ckpt_dir, TrainingState.of(model=model, extra={"ema": ema}))
    named = os.path.join(ckpt_dir, "named")
    ddpckpt.save(named, TrainingState(model=model, ema=ema))
    with pytest.raises(StateMismatchError, match=r"holds 'ema' as a model .*TrainingState"):
        ddpckpt.load(named, model=model, extra={"ema": ema})


def test_an_optimizer_or_scheduler_of_another_type_is_a_mismatch(ckpt_dir) -> None:
    # Adam's moments and betas loaded into an SGD, StepLR's gamma into a cosine schedule.
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    train_steps(model, opt, scheduler=sched)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt, scheduler=sched)
    live = make_mlp()
    sgd = torch.optim.SGD(live.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        StateMismatchError, match="optimizer is of type Adam, the live one of type SGD"
    ):
        ddpckpt.load(ckpt_dir, model=live, optimizer=sgd)
    adam = torch.optim.Adam(live.parameters())
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(adam, 10)
    with pytest.raises(StateMismatchError, match="type StepLR, the live one of type Cosine"):
        ddpckpt.load(ckpt_dir, model=live, optimizer=adam, scheduler=cosine)
    assert "step_size" not in vars(cosine) and not adam.state  # nothing changed
