"""The TrainingState: roles by type, the keyword shorthand, names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpckpt
from conftest import make_mlp
from ddpckpt import TrainingState


def test_each_object_gets_the_role_its_type_says() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    scaler = torch.amp.GradScaler("cpu")
    state = TrainingState(net=model, opt=opt, sched=sched, scaler=scaler, epoch=3)
    assert state.models == {"net": model} and state.optimizers == {"opt": opt}
    assert state.schedulers == {"sched": sched} and state.scalers == {"scaler": scaler}
    assert dict(state.extra) == {"epoch": 3}
    assert state["opt"] is opt and len(state) == 5 and set(state) == {"net", "opt", "sched",
                                                                      "scaler", "epoch"}  # fmt: skip


def test_a_mapping_and_keywords_combine_but_never_name_one_object_twice() -> None:
    model = make_mlp()
    assert TrainingState({"a": model}, b=1)["b"] == 1
    with pytest.raises(ValueError, match="named twice"):
        TrainingState({"a": model}, a=model)


@pytest.mark.parametrize("name", ["", "G/D", 3])
def test_names_are_non_empty_strings_without_a_slash(name) -> None:
    with pytest.raises(ValueError, match="without '/'"):
        TrainingState({name: make_mlp()})


def test_the_same_module_twice_is_an_error() -> None:
    model = make_mlp()
    with pytest.raises(ValueError, match="'a' and 'b' are the same module"):
        TrainingState(a=model, b=nn.parallel.DataParallel(model))


def test_the_shorthand_keeps_its_extra_mapping_and_the_single_model_layout() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"other": torch.optim.SGD(model.parameters(), lr=0.2), "model": 1}
    state = TrainingState.of(model=model, optimizer=opt, extra=extra, rng=False)
    assert state.extra is extra and not state.rng and state.single_model_layout
    assert state.optimizers == {"optimizer": opt}  # the extra optimizer stays an extra
    assert not TrainingState(model=model, optimizer=opt, second=extra["other"]).single_model_layout
    assert TrainingState(model=model, optimizer=opt).single_model_layout


def test_a_state_and_the_shorthand_together_are_refused(ckpt_dir) -> None:
    model = make_mlp()
    with pytest.raises(TypeError, match="not both"):
        ddpckpt.save(ckpt_dir, TrainingState(model=model), model=model)
    with pytest.raises(TypeError, match="TrainingState"):
        ddpckpt.save(ckpt_dir, {"model": model})
    with pytest.raises(TypeError, match="model= is required"):
        ddpckpt.save(ckpt_dir)


def test_plain_values_load_back_into_the_state_and_its_source_mapping(ckpt_dir) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, TrainingState(model=model, seen=[1, 2]))
    source = {"model": make_mlp(seed=1), "seen": None}
    state = TrainingState(source)
    ddpckpt.load(ckpt_dir, state)
    assert state["seen"] == [1, 2] and source["seen"] == [1, 2]
    assert torch.equal(source["model"][0].weight, model[0].weight)
