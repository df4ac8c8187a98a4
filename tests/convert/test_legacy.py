"""Importing torch.save checkpoints as the seeds' recipes write them, without running pickles."""

from __future__ import annotations

import argparse
import os
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ddpckpt
from conftest import TiedLM, make_mlp, train_steps
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt.errors import CorruptCheckpointError, StateMismatchError, UnsafeCheckpointError


def prefixed(state: dict, prefix: str) -> OrderedDict:
    return OrderedDict((prefix + k, v) for k, v in state.items())


@pytest.mark.parametrize(
    "prefix", ["", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."]
)
def test_bare_state_dict_with_any_wrapper_prefix(tmp_path, prefix) -> None:
    model = make_mlp(seed=2)
    torch.save(prefixed(model.state_dict(), prefix), tmp_path / "model.pth")
    path, dropped = import_checkpoint(tmp_path / "model.pth", tmp_path / "out")
    assert dropped == []
    target = make_mlp(seed=3)
    ddpckpt.load(path, model=target, rng=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(target.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_seed_recipe_dict_with_optimizer_is_resumable(tmp_path) -> None:
    """The seeds' rank-0 recipe: {'model': ddp.module.state_dict(), 'optimizer': ..., 'epoch': ...}."""
    model = make_mlp(seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    train_steps(model, opt, scheduler=sched)
    torch.save(
        {"model": prefixed(model.state_dict(), "module."), "optimizer": opt.state_dict(),
         "scheduler": sched.state_dict(), "epoch": 7, "best_acc": 0.91, "args": {"lr": 3e-3}},
        tmp_path / "checkpoint.pth.tar",
    )  # fmt: skip
    path, _ = import_checkpoint(tmp_path / "checkpoint.pth.tar", tmp_path / "out")
    target = make_mlp(seed=5)
    target_opt = torch.optim.Adam(target.parameters(), lr=1.0)
    target_sched = torch.optim.lr_scheduler.StepLR(target_opt, 2)
    info = ddpckpt.load(path, model=target, optimizer=target_opt, scheduler=target_sched)
    assert info.epoch == 7 and info.extra == {"best_acc": 0.91, "args": {"lr": 3e-3}}
    assert target_sched.state_dict() == sched.state_dict()
    for p_src, p_dst in zip(model.parameters(), target.parameters(), strict=True):
        assert torch.equal(opt.state[p_src]["exp_avg"], target_opt.state[p_dst]["exp_avg"])


def test_positional_optimizer_state_is_shape_checked(tmp_path) -> None:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    path, _ = import_checkpoint(tmp_path / "c.pt", tmp_path / "out")
    reversed_params = list(model.parameters())[::-1]
    with pytest.raises(StateMismatchError, match=r"@group0\.0: checkpoint"):
        ddpckpt.load(path, model=model, optimizer=torch.optim.Adam(reversed_params))


def test_lightning_checkpoint(tmp_path) -> None:
    model = make_mlp(seed=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    lightning = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": prefixed(model.state_dict(), "net."),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss'}": {"best_model_score": torch.tensor(0.3)}
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "MixedPrecision": scaler.state_dict(),
        "hyper_parameters": {"hidden": 8},
    }
    torch.save(lightning, tmp_path / "epoch=3.ckpt")
    path, _ = import_checkpoint(tmp_path / "epoch=3.ckpt", tmp_path / "out")
    info = ddpckpt.verify(path)
    assert (info.step, info.epoch) == (120, 3)
    weights = ddpckpt.load_state_dict(path)
    assert list(weights) == [f"net.{k}" for k in model.state_dict()]
    target_scaler = torch.amp.GradScaler("cpu")

    class Wrapper(nn.Module):  # a LightningModule holds the network as an attribute
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp(seed=8)

    wrapper = Wrapper()
    extra = {"loops": None}
    got = ddpckpt.load(path, model=wrapper, optimizer=torch.optim.SGD(wrapper.parameters(), lr=1, momentum=0.9),
                       scaler=target_scaler, extra=extra)  # fmt: skip
    assert target_scaler.get_scale() == 512.0
    assert extra["loops"]["fit_loop"]["epoch_progress"]["total"]["ready"] == 4
    assert "callbacks" in got.extra


@pytest.mark.processes
def test_malicious_pickle_is_refused_without_running(tmp_path) -> None:
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": make_mlp().state_dict(), "x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="system"):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_trusted_plain_class_can_be_allowed(tmp_path) -> None:
    torch.save(
        {"state_dict": make_mlp().state_dict(), "hparams": argparse.Namespace(lr=1)},
        tmp_path / "n.pt",
    )
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace"):
        import_checkpoint(tmp_path / "n.pt", tmp_path / "out")
    path, dropped = import_checkpoint(
        tmp_path / "n.pt", tmp_path / "out", trusted_globals=["argparse.Namespace"]
    )
    assert len(dropped) == 1 and dropped[0].startswith("hparams")  # loaded, but not storable
    assert ddpckpt.verify(path)


def test_tied_weights_and_unknown_layouts(tmp_path) -> None:
    torch.save(TiedLM().state_dict(), tmp_path / "tied.pt")
    path, _ = import_checkpoint(tmp_path / "tied.pt", tmp_path / "out")
    weights = ddpckpt.load_state_dict(path)
    assert weights["head.weight"] is weights["embed.weight"]
    torch.save({"a": 1, "b": [2]}, tmp_path / "odd.pt")
    with pytest.raises(CorruptCheckpointError, match="--model-key"):
        import_checkpoint(tmp_path / "odd.pt", tmp_path / "odd")
    (tmp_path / "garbage.pt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(CorruptCheckpointError, match=r"not a readable torch\.save file"):
        import_checkpoint(tmp_path / "garbage.pt", tmp_path / "g")
    (tmp_path / "run.json").write_text('{"keep_last": 3}')  # a JSON file given by mistake
    with pytest.raises(CorruptCheckpointError, match="Unsupported operand") as raised:
        import_checkpoint(tmp_path / "run.json", tmp_path / "j")
    assert "weights_only" not in str(raised.value)  # torch's advice to unpickle anyway is dropped


def _tied_stored_once(tmp_path) -> tuple[TiedLM, str]:
    """A TiedLM and its import from a state dict without its output layer's weight, as
    save_pretrained stores a language model."""
    torch.manual_seed(0)
    source = TiedLM()
    state = {k: v for k, v in source.state_dict().items() if k != "head.weight"}
    torch.save(state, tmp_path / "model.pt")
    path, _ = import_checkpoint(tmp_path / "model.pt", tmp_path / "out")
    return source, path


def test_a_tied_weight_stored_once_loads_with_the_weight_it_is_tied_to(tmp_path) -> None:
    """As save_pretrained stores a language model: the output layer's weight left out,
    because the model ties it to the embedding."""
    source, path = _tied_stored_once(tmp_path)
    torch.manual_seed(1)
    target = TiedLM()
    ddpckpt.load(path, model=target, rng=False)
    assert target.head.weight is target.embed.weight
    assert torch.equal(target.head.weight, source.embed.weight)

    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())  # same values, apart
    with pytest.raises(
        StateMismatchError, match=r"missing from the checkpoint \(1\): head\.weight"
    ):
        ddpckpt.load(path, model=untied, rng=False)


def test_a_tied_weight_stored_once_loads_into_an_fsdp2_model(tmp_path, process_group) -> None:
    """The tie of a sharded model: its DTensor is filled in place, and the tied key with it."""
    from torch.distributed.fsdp import fully_shard

    source, path = _tied_stored_once(tmp_path)
    torch.manual_seed(1)
    target = fully_shard(TiedLM())
    ddpckpt.load(path, model=target, rng=False)
    assert target.head.weight is target.embed.weight
    assert torch.equal(target.embed.weight.full_tensor(), source.embed.weight)
