"""The TrainingState: roles by type, the keyword shorthand, names."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ddpckpt
from conftest import make_mlp
from ddpckpt import TrainingState
from ddpckpt._format.manifest import read_manifest
from ddpckpt._state.capture import capture
from ddpckpt.errors import StateMismatchError
from ddpckpt.storage._location import locate
from dist_worker import gan_steps
from launch import forked_ranks
from toy_data import Numbers


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


@pytest.mark.parametrize("keyword", ["optimizer", "scheduler"])
def test_a_list_for_a_keyword_says_to_name_each_object_in_a_training_state(
    ckpt_dir, keyword
) -> None:
    """Two optimizers passed as optimizer=[body, head] (as Lightning returns them) failed with
    "'list' object has no attribute 'param_groups'", which does not say what to do."""
    model = make_mlp()
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[3].parameters(), lr=0.1)
    several = {
        "optimizer": [body, head],
        "scheduler": (
            torch.optim.lr_scheduler.StepLR(body, 2),
            torch.optim.lr_scheduler.StepLR(head, 2),
        ),
    }
    given = {"optimizer": body, keyword: several[keyword]}
    with pytest.raises(TypeError, match=f"{keyword}= takes one object.*TrainingState"):
        ddpckpt.save(ckpt_dir, model=model, **given)
    assert not os.path.exists(ckpt_dir)


def test_a_scheduler_in_extra_without_its_optimizer_is_refused_as_scheduler_is(ckpt_dir) -> None:
    """A second optimizer's scheduler put in extra while that optimizer was not passed was
    saved and restored, but the learning rate it had set was not: the resumed run trained
    the head at the initial rate, silently."""
    model = make_mlp()
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[3].parameters(), lr=0.1)
    head_schedule = torch.optim.lr_scheduler.StepLR(head, step_size=1, gamma=0.5)
    with pytest.raises(ddpckpt.InexactResumeError, match="'head_sched' adjusts a SGD"):
        ddpckpt.save(ckpt_dir, model=model, optimizer=body, extra={"head_sched": head_schedule})
    ddpckpt.save(
        ckpt_dir, model=model, optimizer=body, extra={"head": head, "head_sched": head_schedule}
    )


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


def _gan(seed: int = 0) -> TrainingState:
    """A GAN as people write one: two models, two optimizers, two schedulers."""
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)
    return TrainingState(
        G=gen, D=disc, opt_G=opt_g, opt_D=opt_d,
        sched_G=torch.optim.lr_scheduler.StepLR(opt_g, 2, gamma=0.5),
        sched_D=torch.optim.lr_scheduler.MultiStepLR(opt_d, [1, 3], gamma=0.1),
    )  # fmt: skip


def _same_state(a: TrainingState, b: TrainingState) -> None:
    for name in a:
        x, y = a[name].state_dict(), b[name].state_dict()
        assert repr(x) == repr(y), name  # tensors print every value at this size


def test_a_gan_round_trips_bit_for_bit_and_resumes_exactly(ckpt_dir) -> None:
    trained = _gan()
    gan_steps(trained, 3)
    ddpckpt.save(ckpt_dir, trained, step=3)
    uninterrupted = gan_steps(trained, 2)

    resumed = _gan(seed=1)
    ddpckpt.load(ckpt_dir, resumed)
    assert gan_steps(resumed, 2) == uninterrupted  # RNG restored too
    _same_state(trained, resumed)


def test_each_optimizer_is_keyed_by_model_and_parameter_name(ckpt_dir) -> None:
    state = _gan()
    gan_steps(state, 1)
    snapshot = capture(state)
    groups = snapshot.state["optimizers"]["opt_D"]["groups"]
    assert groups[0]["params"] == ["D/0.weight", "D/0.bias", "D/2.weight", "D/2.bias"]
    assert "optimizer/opt_G/state/G/0.weight/exp_avg" in snapshot.tensors
    assert "model/G/0.weight" in snapshot.tensors


def test_a_mismatch_names_the_model_or_optimizer_by_its_key(ckpt_dir) -> None:
    ddpckpt.save(ckpt_dir, _gan())
    other = _gan(seed=1)
    wider = nn.Sequential(nn.Linear(4, 9), nn.LeakyReLU(0.2), nn.Linear(9, 1))
    with pytest.raises(StateMismatchError, match=r"(?s)does not match model 'D'.*0\.weight"):
        ddpckpt.load(ckpt_dir, TrainingState(G=other["G"], D=wider, opt_G=other["opt_G"]))
    two_groups = torch.optim.SGD(
        [{"params": other["D"][0].parameters()}, {"params": other["D"][2].parameters()}], lr=0.1
    )
    with pytest.raises(StateMismatchError, match="optimizer 'opt_D' has 1 param group"):
        ddpckpt.load(ckpt_dir, TrainingState(G=other["G"], D=other["D"], opt_D=two_groups))
    with pytest.raises(StateMismatchError, match=r"no model of that name.*'G', 'D'"):
        ddpckpt.load(ckpt_dir, TrainingState(G=other["G"], critic=other["D"]))


def test_an_optimizer_over_a_model_left_out_of_the_state_fails_at_save(ckpt_dir) -> None:
    gan = _gan()
    joint = torch.optim.Adam([*gan["G"].parameters(), *gan["D"].parameters()])
    with pytest.raises(StateMismatchError, match=r"optimizer 'opt'.*no model of the Training"):
        ddpckpt.save(ckpt_dir, TrainingState(G=gan["G"], opt=joint))
    assert not os.path.exists(ckpt_dir)


def test_a_scheduler_whose_optimizer_is_left_out_is_refused(ckpt_dir) -> None:
    # Its learning rates live in the optimizer: the resume would keep the initial lr.
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with pytest.raises(ddpckpt.InexactResumeError, match="scheduler 'sched' adjusts a SGD"):
        TrainingState(model=model, sched=sched)
    with pytest.raises(ddpckpt.InexactResumeError, match="scheduler 'scheduler'"):
        ddpckpt.save(os.path.join(ckpt_dir, "a"), model=model, scheduler=sched)
    TrainingState.of(model=model, scheduler=sched, extra={"opt": opt})  # an extra optimizer
    TrainingState(model=model, opt=opt, sched=sched)


@pytest.mark.processes
def test_a_loader_in_a_state_built_before_the_loop_resumes_mid_epoch(ckpt_dir) -> None:
    loader = DataLoader(Numbers(20), batch_size=2, shuffle=True, num_workers=2)
    state = TrainingState(model=make_mlp(), loader=loader)
    iterator = iter(loader)
    consumed = [next(iterator).tolist() for _ in range(3)]
    ddpckpt.save(ckpt_dir, state, step=3)  # a mid-epoch save, the state built before the loop
    rest = [batch.tolist() for batch in iterator]
    resumed = DataLoader(Numbers(20), batch_size=2, shuffle=True, num_workers=2)
    ddpckpt.load(ckpt_dir, TrainingState(model=make_mlp(), loader=resumed))
    assert [batch.tolist() for batch in resumed] == rest and len(consumed + rest) == 10


def test_weights_of_one_model_read_by_name(ckpt_dir) -> None:
    gan = _gan()
    ddpckpt.save(ckpt_dir, gan)
    weights = ddpckpt.load_state_dict(ckpt_dir, model="D")
    assert torch.equal(weights["2.weight"], gan["D"][2].weight)
    with pytest.raises(StateMismatchError, match=r"pass model=NAME.*'G', 'D'"):
        ddpckpt.load_state_dict(ckpt_dir)


@pytest.mark.processes
def test_a_ddp_gan_on_two_ranks_resumes_exactly(tmp_path) -> None:
    """Two DDP models (one with per-rank BatchNorm buffers), two optimizers, two schedulers."""
    launch = forked_ranks("gan", tmp_path / "out", args=["--ckpt", str(tmp_path / "ckpt")]).ok()
    results = [launch.result(rank) for rank in (0, 1)]
    assert all(r["same"] for r in results)
    assert results[0]["losses"] != results[1]["losses"]  # each rank drew its own batches
    manifest = read_manifest(locate(str(tmp_path / "ckpt")))
    assert manifest.format_version == 4
    assert all(list(rank["models_buffers"]) == ["D"] for rank in manifest.ranks)


def test_a_checkpointer_saves_and_resumes_a_training_state(tmp_path) -> None:
    trained = _gan()
    with ddpckpt.Checkpointer(tmp_path / "run", trained, keep_last=1) as ckpt:
        for step in range(4):
            gan_steps(trained, 1)
            ckpt.save(step)
    resumed = _gan(seed=1)
    with ddpckpt.Checkpointer(tmp_path / "run", state=resumed) as ckpt:
        assert ckpt.resume().step == 3 and ckpt.steps() == [3]
    _same_state(trained, resumed)
    with pytest.raises(TypeError, match="not both"):
        ddpckpt.Checkpointer(tmp_path / "run", resumed, model=make_mlp())
