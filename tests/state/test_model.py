"""A model's part of a checkpoint: canonical keys through any wrapper, tied weights, replication."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import TiedLM, make_mlp, train_steps
from ddpckpt._state.capture import TrainingState, capture
from ddpckpt._state.model import canonical_state_dict, unwrap_model

PLAIN_KEYS = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
              "1.num_batches_tracked", "3.weight", "3.bias"]  # fmt: skip


def wrappings():
    return {
        "plain": lambda m: m,
        "DataParallel": nn.DataParallel,
        "DDP": DDP,
        "compile": lambda m: torch.compile(m, backend="eager"),
        "DDP(compile)": lambda m: DDP(torch.compile(m, backend="eager")),
        "compile(DDP)": lambda m: torch.compile(DDP(m), backend="eager"),
        "DataParallel(DDP(compile))": lambda m: nn.DataParallel(
            DDP(torch.compile(m, backend="eager"))
        ),
    }


@pytest.mark.parametrize("wrap", list(wrappings()))
def test_keys_are_canonical_whatever_the_wrapping(process_group, wrap) -> None:
    model = make_mlp()
    wrapped = wrappings()[wrap](model)
    assert unwrap_model(wrapped) is model
    assert list(canonical_state_dict(wrapped)) == PLAIN_KEYS


def test_compiled_submodule_keys_are_canonical() -> None:
    model = nn.Sequential(make_mlp())
    model[0][3] = torch.compile(model[0][3], backend="eager")
    assert "0.3._orig_mod.weight" in model.state_dict()
    assert "0.3.weight" in canonical_state_dict(model)


def test_user_modules_named_module_keep_their_name() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    assert list(canonical_state_dict(Holder())) == ["module.weight", "module.bias"]


def test_tied_weights_are_stored_once_and_recorded_as_alias() -> None:
    snapshot = capture(TrainingState.of(model=TiedLM()))
    section = snapshot.state["model"]
    assert section["aliases"] == {"head.weight": "embed.weight"}
    assert "model/head.weight" not in snapshot.tensors


def test_parameters_ddp_ignores_and_their_moments_are_kept_per_rank(process_group) -> None:
    model = make_mlp()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["3.weight", "1.running_mean"])
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters())
    train_steps(ddp, opt, steps=1)
    snapshot = capture(TrainingState.of(model=ddp, optimizer=opt, rng=False))
    ignored_state = opt.state[model[3].weight].values()
    moments = {n for n, t in snapshot.tensors.items() if any(t is v for v in ignored_state)}
    assert len(moments) == 3  # exp_avg, exp_avg_sq, step
    assert snapshot.per_rank == {"model/3.weight", "model/1.running_mean", *moments}
    assert "model/0.weight" in snapshot.balanced and "model/3.weight" not in snapshot.balanced
    assert not snapshot.unverified


def test_a_model_without_ddp_is_verified_not_assumed_replicated() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, steps=1)
    snapshot = capture(TrainingState.of(model=model, optimizer=opt, rng=False))
    assert not snapshot.balanced and not snapshot.per_rank
    assert snapshot.unverified == set(snapshot.tensors)  # buffers too: nothing broadcasts them
