"""A location resolved once: each public call resolves each path it was given once, whatever
the number of checkpoints, files or steps it then touches; below it, the storage travels
with the path (:class:`ddpckpt.storage._location.Location`)."""

from __future__ import annotations

import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt.storage import _registry
from ddpckpt.storage._location import Location, locate

CHECKPOINTS = 12  # the counts below must not grow with it


@pytest.fixture
def resolved(monkeypatch) -> list[str]:
    """Every path or URL resolved to a storage from now on, in order."""
    seen: list[str] = []
    real = _registry._resolve

    def counting(location: str):
        seen.append(location)
        return real(location)

    monkeypatch.setattr(_registry, "_resolve", counting)
    return seen


def objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_location_formats_as_its_path_but_is_no_string() -> None:
    place = locate("run/step-00000001")
    assert f"{place}: damaged" == "run/step-00000001: damaged"
    assert place.join("manifest.json") == Location(place.storage, "run/step-00000001/manifest.json")
    assert place.name == "step-00000001"
    assert place.parent.path == os.path.abspath("run") and place.parent.storage is place.storage
    assert not isinstance(place, str)
    with pytest.raises(TypeError):
        os.fspath(place)  # type: ignore[call-overload]


def test_save_load_and_verify_resolve_their_path_once(tmp_path, resolved) -> None:
    model, optimizer = objects()
    path = str(tmp_path / "ckpt")
    ddpckpt.save(path, model=model, optimizer=optimizer, step=1)
    assert resolved == [path]
    del resolved[:]
    ddpckpt.load(path, model=model, optimizer=optimizer)
    assert resolved == [path]
    del resolved[:]
    ddpckpt.verify(path)
    assert resolved == [path]


def test_load_latest_resolves_its_directory_once_past_damaged_checkpoints(
    tmp_path, resolved
) -> None:
    model, optimizer = objects()
    saves = tmp_path / "saves"
    for step in range(CHECKPOINTS):
        ddpckpt.save(saves / f"ckpt-{step}", model=model, optimizer=optimizer, step=step)
    newest = saves / f"ckpt-{CHECKPOINTS - 1}"
    data = next(p for p in newest.iterdir() if p.suffix == ".safetensors")
    data.write_bytes(data.read_bytes()[:-1] + b"\0")  # the fallback loads a second one
    del resolved[:]
    info = ddpckpt.load_latest(saves, model=model, optimizer=optimizer)
    assert info is not None and info.step == CHECKPOINTS - 2
    assert resolved == [str(saves)]
    del resolved[:]
    assert ddpckpt.latest(saves) == str(newest)
    assert resolved == [str(saves)]


def test_a_checkpointer_resolves_its_directory_once_for_every_save_and_resume(
    tmp_path, resolved
) -> None:
    model, optimizer = objects()
    run = str(tmp_path / "run")
    with ddpckpt.Checkpointer(run, model=model, optimizer=optimizer, keep_last=3) as ckpt:
        ckpt.resume()
        for step in range(CHECKPOINTS):  # with retention deleting the older ones
            ckpt.save(step)
        assert ckpt.steps() == [CHECKPOINTS - 3, CHECKPOINTS - 2, CHECKPOINTS - 1]
    assert resolved == [run]
    del resolved[:]
    with ddpckpt.Checkpointer(run, model=model, optimizer=optimizer, read_only=True) as reader:
        assert reader.resume().step == CHECKPOINTS - 1
        assert reader.info(CHECKPOINTS - 2).step == CHECKPOINTS - 2
    assert resolved == [run]


def test_a_fast_tier_resolves_its_directory_once(tmp_path, resolved) -> None:
    model, optimizer = objects()
    run, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    tier = ddpckpt.FastTier(fast, every_steps=1, keep=2)
    with ddpckpt.Checkpointer(run, model=model, optimizer=optimizer, fast_tier=tier) as ckpt:
        ckpt.resume()
        for step in range(CHECKPOINTS):
            if ckpt.should_save(step):
                ckpt.save(step)
    with ddpckpt.Checkpointer(run, model=model, optimizer=optimizer, fast_tier=tier) as ckpt:
        assert ckpt.resume().step == CHECKPOINTS - 1
    assert sorted(set(resolved)) == sorted({run, fast})
    assert len(resolved) == 4  # each directory once per Checkpointer


@pytest.mark.processes
def test_a_rank_that_cannot_resolve_the_path_fails_the_call_on_every_rank() -> None:
    """Resolving is inside the collective call: a node that cannot (a storage's library
    missing there) makes every rank raise at once, naming it, never a rank that waits."""
    from forked import run_ranks
    from launch import WORKER, _env

    worker = WORKER.parent / "location_worker.py"
    code, out = run_ranks(worker, [], nproc=2, env=_env(None), timeout=180)
    assert code == 0, out
    for call in ("save", "load", "load_latest"):
        for rank in (0, 1):
            line = next(ln for ln in out.splitlines() if ln.startswith(f"rank {rank} {call}: "))
            assert "no client library for memory:// URLs" in line, out
            assert "rank 1" in line or rank == 1, out
