"""A model's part of a checkpoint: canonical keys through any wrapper, tied weights, replication."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from conftest import TiedLM, make_mlp, train_steps
from ddpckpt._format import pinned_ring
from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.sections import StateSections
from ddpckpt._io.reader import FileSource
from ddpckpt._state.capture import TrainingState, capture
from ddpckpt._state.model import canonical_state_dict, restore_model
from ddpckpt._training.wrappers import unwrap_model
from ddpckpt.storage._location import locate

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


class _Recording:
    """A tensor source that notes where each tensor was asked to be read into."""

    def __init__(self, source) -> None:
        self.source, self.likes = source, {}

    def meta(self, name):
        return self.source.meta(name)

    def get(self, name, like=None):
        self.likes[name] = like
        return self.source.get(name, like=like)


def _restore_through_the_ring(tmp_path, monkeypatch, model: nn.Module) -> dict:
    """Save ``make_mlp()``, then restore it into ``model`` the way a GPU model is restored
    (the ring forced on for CPU tensors); what each tensor was read into."""
    monkeypatch.setattr(pinned_ring, "_RING_FOR_CPU", True)
    monkeypatch.setattr(pinned_ring, "_PIECE", 4096)  # pieces smaller than the tensors
    monkeypatch.setattr(pinned_ring, "_rings", [])
    saved = make_mlp()
    path = ddpckpt.save(tmp_path / "ck", model=saved)
    manifest = read_manifest(locate(str(path)))
    section = StateSections.from_json(manifest.state, str(path)).models["model"]
    source = _Recording(FileSource(locate(str(path)), manifest))
    restore_model(model, section, source, str(path), strict=True)
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    return source.likes


def test_a_gpu_model_is_loaded_straight_into_its_tensors(tmp_path, monkeypatch) -> None:
    """No tensor the size of the weights is allocated on the device: each one is read
    into the live tensor, piece by piece through the pinned ring."""
    model = make_mlp(seed=1)
    live = {f"model/{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    likes = _restore_through_the_ring(tmp_path, monkeypatch, model)
    assert set(likes) == set(live)
    for name, like in likes.items():
        assert like is not None and like.data_ptr() == live[name].data_ptr(), name


def test_load_hooks_still_see_the_incoming_value_apart_from_the_current_one(
    tmp_path, monkeypatch
) -> None:
    model = make_mlp(seed=1)
    seen = []

    def compare(module, state, prefix, *args) -> None:
        seen.append(torch.equal(state[prefix + "weight"], module.weight))

    model[0]._register_load_state_dict_pre_hook(compare, with_module=True)
    likes = _restore_through_the_ring(tmp_path, monkeypatch, model)
    assert seen == [False]  # the new weights, beside the old ones
    assert likes["model/0.weight"].data_ptr() != model[0].weight.data_ptr()
