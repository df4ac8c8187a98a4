"""Shared by the scheduler and optimizer tests: a run saved and resumed vs one never stopped."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

import ddpckpt

T = TypeVar("T")


def table_entry(table: Mapping[str, T], cls: type, table_name: str, test_file: str) -> T:
    """How a test builds ``cls``; a class torch added since the table was written fails."""
    if cls.__name__ not in table:
        pytest.fail(
            f"torch.optim has a class the test does not know: {cls.__module__}."
            f"{cls.__qualname__}. Add it to {table_name} in {os.path.basename(test_file)} "
            "and make sure its state resumes exactly."
        )
    return table[cls.__name__]


@dataclass
class Training:
    """One training set-up built from scratch; ``step(i)`` runs training step ``i``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: Callable[[int], None]


def observed(run: Training) -> tuple[list[Any], list[torch.Tensor], Any]:
    """What must match bit for bit: learning rates, parameters, the optimizer's state."""
    lrs = [group["lr"] for group in run.optimizer.param_groups]
    if run.scheduler is not None:
        lrs.append(run.scheduler.get_last_lr())
    params = [p.detach().clone() for p in run.model.parameters()]
    return lrs, params, copy.deepcopy(run.optimizer.state_dict())


def assert_same_observation(expected, got, where: str) -> None:
    (lrs, params, state), (lrs_got, params_got, state_got) = expected, got
    assert lrs_got == lrs, f"{where}: learning rates {lrs_got} != uninterrupted run's {lrs}"
    for i, (a, b) in enumerate(zip(params, params_got, strict=True)):
        assert torch.equal(a, b), f"{where}: parameter {i} differs from the uninterrupted run"
    _assert_same(state, state_got, f"{where}: optimizer.state_dict()")


def _assert_same(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(b).__name__} instead of {type(a).__name__}"
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
        assert same and torch.equal(a, b), f"{where}: {b!r} != uninterrupted run's {a!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(b)} != {list(a)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(b)} != {len(a)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {b!r} != uninterrupted run's {a!r}"


def assert_resume_is_exact(
    build: Callable[[int], Training], path: str | os.PathLike[str], before: int, after: int
) -> None:
    """Train ``before`` steps, save, build afresh (other seed), load, train ``after`` more;
    then load again into those objects (an optimizer with state: read in place) and train
    the ``after`` steps again.

    Learning rates, parameters and optimizer state after each load and after every later
    step must equal those of one uninterrupted run of ``before + after`` steps.
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
    ddpckpt.load(path, model=resumed.model, **objects, rng=False)
    assert_same_observation(expected[before - 1], observed(resumed), "loaded into its own state")
    for i in range(before, before + after):
        resumed.step(i)
        assert_same_observation(expected[i], observed(resumed), f"after step {i}, loaded again")
