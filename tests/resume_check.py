"""Shared by the scheduler and optimizer tests: a run saved and resumed vs one never stopped."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ddpckpt


@dataclass
class Training:
    """One training set-up built from scratch; ``step(i)`` runs training step ``i``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: Callable[[int], None]


def observed(run: Training) -> tuple[list[Any], list[torch.Tensor]]:
    """What must match bit for bit: every group's learning rate and every parameter."""
    lrs = [group["lr"] for group in run.optimizer.param_groups]
    if run.scheduler is not None:
        lrs.append(run.scheduler.get_last_lr())
    return lrs, [p.detach().clone() for p in run.model.parameters()]


def assert_same_observation(expected, got, where: str) -> None:
    (lrs, params), (lrs_got, params_got) = expected, got
    assert lrs_got == lrs, f"{where}: learning rates {lrs_got} != uninterrupted run's {lrs}"
    for i, (a, b) in enumerate(zip(params, params_got, strict=True)):
        assert torch.equal(a, b), f"{where}: parameter {i} differs from the uninterrupted run"


def assert_resume_is_exact(
    build: Callable[[int], Training], path: str | os.PathLike[str], before: int, after: int
) -> None:
    """Train ``before`` steps, save, build afresh (other seed), load, train ``after`` more.

    Learning rates and parameters after loading and after every later step must equal
    those of one uninterrupted run of ``before + after`` steps.
    """
    reference = build(0)
    expected = []
    for i in range(before + after):
        reference.step(i)
        expected.append(observed(reference))

    first = build(0)
    for i in range(before):
        first.step(i)
    objects = {"optimizer": first.optimizer, "scheduler": first.scheduler}
    ddpckpt.save(path, model=first.model, **objects, step=before, rng=False)

    resumed = build(1)  # other initial weights: the checkpoint must overwrite them
    objects = {"optimizer": resumed.optimizer, "scheduler": resumed.scheduler}
    ddpckpt.load(path, model=resumed.model, **objects, rng=False)
    assert_same_observation(expected[before - 1], observed(resumed), "right after loading")
    for i in range(before, before + after):
        resumed.step(i)
        assert_same_observation(expected[i], observed(resumed), f"after step {i}")
