"""Every learning-rate scheduler torch ships resumes exactly (its state is stored pickle-free)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.optim import swa_utils

import ddpckpt
from resume_check import Training, assert_resume_is_exact, table_entry

BEFORE, AFTER = 4, 5  # steps before the save, steps after the load


class Warmup:
    """A stateful callable: LambdaLR stores its ``__dict__`` (plain functions store nothing)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls = 0

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        return min(1.0, (epoch + 1) / self.steps) * 0.9 ** max(0, epoch - self.steps)


# How to build each scheduler over an SGD optimizer with momentum (CyclicLR and OneCycleLR
# cycle it); chosen so that something changes across the save at step BEFORE.
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=3, gamma=0.5),
    "MultiStepLR": lambda opt: sched.MultiStepLR(opt, milestones=[2, 5, 5, 7], gamma=0.5),
    "ConstantLR": lambda opt: sched.ConstantLR(opt, factor=0.5, total_iters=5),
    "LinearLR": lambda opt: sched.LinearLR(opt, start_factor=0.2, total_iters=6),
    "ExponentialLR": lambda opt: sched.ExponentialLR(opt, gamma=0.9),
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=6, eta_min=0.001),
    "CosineAnnealingWarmRestarts": lambda opt: sched.CosineAnnealingWarmRestarts(
        opt, T_0=2, T_mult=2, eta_min=0.001
    ),
    "PolynomialLR": lambda opt: sched.PolynomialLR(opt, total_iters=7, power=2.0),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lr_lambda=[lambda e: 0.9**e, Warmup(3)]),
    "MultiplicativeLR": lambda opt: sched.MultiplicativeLR(opt, lr_lambda=lambda e: 0.95),
    "OneCycleLR": lambda opt: sched.OneCycleLR(opt, max_lr=[0.5, 0.2], total_steps=12),
    "CyclicLR": lambda opt: sched.CyclicLR(
        opt, base_lr=0.01, max_lr=0.1, step_size_up=3, mode="exp_range", gamma=0.95
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, patience=1, cooldown=1),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=0.5, total_iters=3), sched.MultiStepLR(opt, [2, 4])],
        milestones=[3],
    ),
    "ChainedScheduler": lambda opt: sched.ChainedScheduler(
        [sched.ExponentialLR(opt, gamma=0.9), sched.MultiStepLR(opt, milestones=[3, 6])]
    ),
    "SWALR": lambda opt: swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=5),
}


def discovered_schedulers() -> list[type]:
    """Every public scheduler class torch.optim defines, found by introspection."""
    found = []
    for module in (sched, swa_utils):
        for name, obj in vars(module).items():
            is_scheduler = inspect.isclass(obj) and (
                issubclass(obj, sched.LRScheduler) or obj is sched.ReduceLROnPlateau
            )
            if is_scheduler and obj.__module__ == module.__name__ and not name.startswith("_"):
                found.append(obj)
    return [cls for cls in found if cls is not sched.LRScheduler]


def build(make_scheduler: Callable[[torch.optim.Optimizer], Any]) -> Callable[[int], Training]:
    def training(seed: int) -> Training:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.SGD(
            [
                {"params": model[0].parameters()},
                {"params": model[2].parameters(), "lr": 0.05},
            ],
            lr=0.1,
            momentum=0.9,
        )
        scheduler = make_scheduler(opt)

        def step(i: int) -> None:
            data = torch.Generator().manual_seed(i)
            opt.zero_grad()
            loss = model(torch.randn(5, 3, generator=data)).pow(2).mean()
            loss.backward()
            opt.step()
            if isinstance(scheduler, sched.ReduceLROnPlateau):
                scheduler.step(1.0 if i < 6 else 0.5)  # a plateau, then an improvement
            else:
                scheduler.step()

        return Training(model, opt, scheduler, step)

    return training


@pytest.mark.filterwarnings("ignore::UserWarning")  # SWALR/SequentialLR's step-order notes
@pytest.mark.parametrize("cls", discovered_schedulers(), ids=lambda cls: cls.__name__)
def test_every_scheduler_resumes_exactly(cls, tmp_path) -> None:
    training = build(table_entry(SCHEDULERS, cls, "SCHEDULERS", __file__))
    assert type(training(0).scheduler) is cls
    assert_resume_is_exact(training, tmp_path / "ckpt", BEFORE, AFTER)


def test_the_table_covers_the_schedulers_users_name() -> None:
    """Discovery itself works: the classic schedules are found (guards the test above)."""
    names = {cls.__name__ for cls in discovered_schedulers()}
    assert {"MultiStepLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"} <= names


def test_multistep_lr_drops_at_its_milestone_after_a_resume(tmp_path) -> None:
    """The classic ImageNet schedule, saved just before its milestone: the drop still comes."""

    def training(seed: int) -> Training:
        torch.manual_seed(seed)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        scheduler = sched.MultiStepLR(opt, milestones=[3, 5], gamma=0.1)

        def step(i: int) -> None:
            opt.zero_grad()
            model(torch.ones(2, 3) * i).sum().backward()
            opt.step()
            scheduler.step()

        return Training(model, opt, scheduler, step)

    path = os.fspath(tmp_path / "ckpt")
    assert_resume_is_exact(training, path, before=2, after=4)
    resumed = training(1)
    ddpckpt.load(path, model=resumed.model, optimizer=resumed.optimizer,
                 scheduler=resumed.scheduler, rng=False)  # fmt: skip
    lrs = []
    for i in range(2, 6):
        resumed.step(i)
        lrs.append(resumed.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.01, 0.01, 0.001, 0.001])
