"""The two layouts of a manifest's state: single-model (formats 1-3) and named (format 4)."""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
from test_codec import assert_same
from torch import nn

import ddpckpt
from conftest import make_mlp
from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.sections import ModelSection, OptimizerSection, StateSections
from ddpckpt._format.statelayout import layout_of
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate
from stored import assert_loaded_as_stored, assert_near_optimizer

V2_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "format-v2")


def _trained_v2_objects() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """The objects the format-v2 fixture was saved from (same seed, same steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [1, 2], gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_checkpoint_of_format_version_2_still_loads() -> None:
    """Saved by ddpckpt before named layouts existed: model, optimizer, MultiStepLR,
    GradScaler, a Counter and a module in extra."""
    model, opt, sched = _trained_v2_objects()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ema = nn.Linear(2, 2)  # drawn after training, as when the fixture was made
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1, betas=(0.8, 0.9))
    fresh_sched = torch.optim.lr_scheduler.MultiStepLR(fresh_opt, [1, 2], gamma=0.5)
    fresh_scaler = torch.amp.GradScaler("cpu")
    extra = {"counts": None, "ema": nn.Linear(2, 2)}
    info = ddpckpt.load(
        V2_CHECKPOINT, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched,
        scaler=fresh_scaler, extra=extra, rng=False,
    )  # fmt: skip
    assert read_manifest(locate(V2_CHECKPOINT)).format_version == 2 and (info.step, info.epoch) == (
        3,
        1,
    )
    assert_loaded_as_stored(fresh, fresh_opt, V2_CHECKPOINT)
    torch.testing.assert_close(dict(fresh.state_dict()), dict(model.state_dict()))
    assert_near_optimizer(fresh_opt, opt)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_scaler.state_dict() == scaler.state_dict()
    assert extra["counts"] == collections.Counter("abca")
    assert_same(dict(extra["ema"].state_dict()), dict(ema.state_dict()))


def test_the_shorthand_still_writes_the_single_model_layout_format_3(ckpt_dir) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt, extra={"opt2": copy.copy(opt)})
    manifest = read_manifest(locate(ckpt_dir))
    assert manifest.format_version == 3 and not layout_of(manifest.state).named
    assert {"model", "optimizer", "extra"} <= set(manifest.state)


def test_several_models_write_format_version_4(ckpt_dir) -> None:
    ddpckpt.save(ckpt_dir, ddpckpt.TrainingState(a=make_mlp(), b=make_mlp(seed=1)))
    manifest = read_manifest(locate(ckpt_dir))
    assert manifest.format_version == 4 and sorted(manifest.state["models"]) == ["a", "b"]
    assert "model/b/0.weight" in manifest.tensors


V1_CHECKPOINT = os.path.join(os.path.dirname(V2_CHECKPOINT), "format-v1")


def test_typed_sections_read_and_write_every_stored_manifest_unchanged(tmp_path) -> None:
    ddpckpt.save(str(tmp_path / "named"), ddpckpt.TrainingState(a=make_mlp(), v=[1]))
    for path in (V1_CHECKPOINT, V2_CHECKPOINT, str(tmp_path / "named")):
        state = read_manifest(locate(path)).state
        assert StateSections.from_json(state, path).to_json() == state, path


def test_sections_are_typed_in_both_layouts() -> None:
    single = StateSections.from_json(read_manifest(locate(V2_CHECKPOINT)).state, "v2")
    assert not single.layout.named and list(single.models) == ["model"]
    assert isinstance(single.models["model"], ModelSection)
    assert single.models["model"].keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    optimizer = single.optimizers["optimizer"]
    assert isinstance(optimizer, OptimizerSection) and optimizer.type == "AdamW"
    assert optimizer.groups[0].params == single.models["model"].keys
    assert single.schedulers["scheduler"].type == "MultiStepLR"
    assert {n: e.kind for n, e in single.extra.items()} == {"counts": "value", "ema": "stateful"}


def test_a_malformed_section_is_a_corrupt_checkpoint_naming_it() -> None:
    state = copy.deepcopy(read_manifest(locate(V2_CHECKPOINT)).state)
    del state["model"]["keys"]
    with pytest.raises(CorruptCheckpointError, match=r"ckpt: model 'model'.*no 'keys'"):
        StateSections.from_json(state, "ckpt")
    state = {"models": {}, "extra": {"e": {"kind": "pickle"}}}
    with pytest.raises(CorruptCheckpointError, match=r"extra\['e'\].*unknown kind 'pickle'"):
        StateSections.from_json(state, "ckpt")


def test_what_made_a_models_parameters_dtensors_round_trips_and_is_checked() -> None:
    section = ModelSection("Sequential", ["0.weight"], wrapped_by="FSDP2")
    assert ModelSection.from_json(section.to_json(), "ckpt").wrapped_by == "FSDP2"
    plain = ModelSection("Sequential", ["0.weight"]).to_json()
    assert "wrapped_by" not in plain  # manifests of models without it stay as they were
    assert ModelSection.from_json(plain, "ckpt").wrapped_by is None
    with pytest.raises(CorruptCheckpointError, match=r"'wrapped_by' is a int"):
        ModelSection.from_json({**plain, "wrapped_by": 2}, "ckpt")
