"""ddpckpt.convert: the Python API of `ddpckpt import`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import ddpckpt
from ddpckpt.convert import Imported, import_checkpoint
from ddpckpt.errors import CheckpointExistsError, UnsafeCheckpointError


class Opaque:
    """A class no allowlist names."""


@dataclass
class Hyper:
    """Plain data a user may trust (read, then left out: not storable without pickle)."""

    lr: float


def test_a_torch_save_file_imports_and_loads_and_what_it_left_out_is_listed(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    source = tmp_path / "legacy.pt"
    torch.save(
        {"model": {f"module.{k}": v for k, v in model.state_dict().items()},
         "optimizer": optimizer.state_dict(), "epoch": 4, "hyper": Hyper(0.1)},
        source,
    )  # fmt: skip
    trusted = [f"{__name__}.Hyper"]
    imported = import_checkpoint(source, tmp_path / "ckpt", trusted_globals=trusted)
    assert isinstance(imported, Imported) and imported.path == str(tmp_path / "ckpt")
    assert [entry.split(" ")[0] for entry in imported.left_out] == ["hyper"]
    fresh = torch.nn.Linear(3, 2)
    info = ddpckpt.load(imported.path, model=fresh, optimizer=torch.optim.SGD(
        fresh.parameters(), lr=0.1, momentum=0.9), rng=False)  # fmt: skip
    assert info.epoch == 4
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    with pytest.raises(CheckpointExistsError):
        import_checkpoint(source, tmp_path / "ckpt", trusted_globals=trusted)
    again = import_checkpoint(source, tmp_path / "ckpt", trusted_globals=trusted, overwrite=True)
    assert again.path == imported.path


def test_a_pickle_naming_another_global_is_refused_before_it_runs(tmp_path) -> None:
    source = tmp_path / "hostile.pt"
    torch.save({"model": {"w": torch.ones(1)}, "extra": Opaque()}, source)
    with pytest.raises(UnsafeCheckpointError, match="Opaque"):
        import_checkpoint(source, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
