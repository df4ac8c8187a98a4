"""Gradient accumulation: a checkpoint in the middle of a window resumes the same step."""

from __future__ import annotations

import logging

import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt import GradientAccumulation


def micro_step(model, opt, accumulation, seed: int) -> None:
    torch.manual_seed(seed)
    with accumulation.context():
        (model(torch.randn(4, 4)).pow(2).mean() / accumulation.steps).backward()
    if accumulation.step():
        opt.step()
        opt.zero_grad()


def test_save_mid_window_then_resume_takes_the_same_step(tmp_path) -> None:
    model = make_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulation = GradientAccumulation(model, steps=3)
    for seed in range(4):  # one full window, then one micro-step into the next
        micro_step(model, opt, accumulation, seed)
    assert accumulation.micro == 1
    ddpckpt.save(tmp_path / "c", model=model, optimizer=opt, extra={"acc": accumulation}, rng=False)
    for seed in (4, 5):
        micro_step(model, opt, accumulation, seed)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = make_mlp(seed=9)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh_acc = GradientAccumulation(fresh, steps=3)
    ddpckpt.load(
        tmp_path / "c", model=fresh, optimizer=fresh_opt, extra={"acc": fresh_acc}, rng=False
    )
    assert fresh_acc.micro == 1 and fresh[0].weight.grad is not None
    for seed in (4, 5):
        micro_step(fresh, fresh_opt, fresh_acc, seed)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_changed_window_is_flagged_and_starts_clean(tmp_path, caplog) -> None:
    model = make_mlp()
    accumulation = GradientAccumulation(model, steps=2)
    accumulation.step()
    ddpckpt.save(tmp_path / "c", model=model, extra={"acc": accumulation})
    other = GradientAccumulation(model, steps=4)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ddpckpt.load(tmp_path / "c", model=model, extra={"acc": other})
    assert "changed from 2 to 4" in caplog.text and other.micro == 0
