"""``ddpckpt export --format dcp``: what dcp.load reads into get_state_dict's model and
optimizer, equal to what was saved (ddpckpt._cli.export_dcp)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ddpckpt
from ddpckpt._cli.export_dcp import export_dcp
from ddpckpt._cli.main import main as cli
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt.errors import UnsupportedValueError


def _objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _objects(0)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _dcp_load(directory) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _objects(1)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _same(
    a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]
) -> bool:
    (ma, oa), (mb, ob) = a, b
    sa, sb = oa.state_dict(), ob.state_dict()
    return (
        all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))
        and sa["param_groups"] == sb["param_groups"]
        and all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    )  # fmt: skip


def test_dcp_load_reads_the_export_into_get_state_dicts_model_and_optimizer(tmp_path) -> None:
    trained = _trained()
    path = ddpckpt.save(tmp_path / "ckpt", model=trained[0], optimizer=trained[1])
    assert export_dcp(path, tmp_path / "dcp") == str(tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]
    assert _same(_dcp_load(tmp_path / "dcp"), trained)


def test_the_command_writes_it_and_import_reads_it_back(tmp_path, capsys) -> None:
    trained = _trained()
    ddpckpt.save(tmp_path / "ckpt", model=trained[0], optimizer=trained[1])
    assert cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--format", "dcp"]) == 0
    assert f"wrote {tmp_path / 'dcp'}" in capsys.readouterr().out
    assert cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--format", "dcp"]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    path, dropped = import_checkpoint(tmp_path / "dcp", tmp_path / "back")
    assert dropped == []
    model, opt = _objects(2)
    ddpckpt.load(path, model=model, optimizer=opt, rng=False)
    assert _same((model, opt), trained)


def test_an_optimizer_keyed_by_position_is_refused_by_name(tmp_path) -> None:
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "old.pt")
    path, _ = import_checkpoint(tmp_path / "old.pt", tmp_path / "imported")
    with pytest.raises(UnsupportedValueError, match="keyed by position"):
        export_dcp(path, tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists()


def test_numpy_arrays_in_the_optimizers_state_and_groups_are_exported(tmp_path) -> None:
    """An optimizer may keep numpy arrays (saved as ``$ndarray``): the export wrote a
    reference where the codec needed the array, and failed with an AttributeError."""
    np = pytest.importorskip("numpy")
    trained = _trained()
    trained[1].param_groups[0]["window"] = np.arange(3.0)
    trained[1].state[trained[1].param_groups[0]["params"][0]]["history"] = np.ones(2)
    path = ddpckpt.save(tmp_path / "ckpt", model=trained[0], optimizer=trained[1])
    export_dcp(path, tmp_path / "dcp")
    model, opt = _trained()  # a live optimizer with the same keys, other values
    opt.param_groups[0]["window"] = np.zeros(3)
    opt.state[opt.param_groups[0]["params"][0]]["history"] = np.zeros(2)
    _, optim_state = get_state_dict(model, opt)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"optim": optim_state}, checkpoint_id=str(tmp_path / "dcp"))
    assert np.array_equal(optim_state["param_groups"][0]["window"], np.arange(3.0))
    first = optim_state["state"][next(iter(optim_state["state"]))]
    assert np.array_equal(first["history"], np.ones(2))
