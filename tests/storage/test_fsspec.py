"""What only the fsspec seam does: a user's file system behind a URL scheme, configured by
``storage_options``; the storage protocol itself runs in test_base (``store``, "fsspec")."""

from __future__ import annotations

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import ddpckpt
import ddpckpt.storage.fsspec
from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt.storage import ManifestLastCommit, storage_for
from ddpckpt.storage.fsspec import FsspecStorage


def test_a_training_state_round_trips_and_resumes_through_fsspec(fsspec_root) -> None:
    storage = storage_for(fsspec_root)
    assert isinstance(storage, FsspecStorage) and isinstance(storage.commit, ManifestLastCommit)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = fsspec_root / "run"
    with Checkpointer(run, model=model, optimizer=opt, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            train_steps(model, opt, steps=1)
            ckpt.save(step)
        ckpt.save(3)  # the same step again: replaced, never absent
    fs = MemoryFileSystem()
    assert fs.exists(f"/{fsspec_root.name}/run/step-00000003/manifest.json")  # in fsspec's store
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-00000002",
        "step-00000003",
    ]
    fresh = make_mlp(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with Checkpointer(run, model=fresh, optimizer=fresh_opt) as ckpt:
        assert ckpt.resume().step == 3
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert ddpckpt.verify(f"{run}/step-00000003").step == 3


def test_storage_options_make_the_file_system_and_a_missing_object_is_named(fsspec_root) -> None:
    ddpckpt.storage.fsspec.use("fsmem-configured", protocol="memory")
    path = f"fsmem-configured://{fsspec_root.name}-configured/step-1"
    ddpckpt.save(path, model=make_mlp(), storage_options={"skip_instance_cache": True})
    assert isinstance(storage_for(path), FsspecStorage)
    storage_for(path).delete(f"{path}/model-00000.safetensors")
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=r"model-00000\.safetensors"):
        ddpckpt.load(path, model=make_mlp())
    storage_for(path).delete_tree(path)


def test_keys_with_empty_dot_or_dotdot_segments_are_skipped_with_a_warning(
    fsspec_root, caplog
) -> None:
    """An object store's keys are names: ``run//x`` or ``step-6/./manifest.json`` is never
    listed as ``run`` or ``.`` (another name), but skipped and reported; resume() works
    (the prefix holding nothing else is moved aside, as a save that did not finish)."""
    import logging

    model = make_mlp()
    run = fsspec_root / "run"
    with Checkpointer(run, model=model, keep_last=None) as ckpt:
        ckpt.save(2)
    fs = MemoryFileSystem()
    root = f"/{fsspec_root.name}/run"
    manifest = fs.cat_file(f"{root}/step-00000002/manifest.json")
    fs.pipe_file(f"{root}/step-00000006/./manifest.json", manifest)
    fs.pipe_file(f"{root}//step-00000007", b"x")
    storage = storage_for(run)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        names = storage.list(run)
        assert "run" not in names and "" not in names and "step-00000002" in names
        assert storage.list(f"{run}/step-00000006") == []
        assert storage.walk(f"{run}/step-00000006") == []
        fresh = make_mlp(seed=1)
        assert Checkpointer(run, model=fresh).resume().step == 2
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert f"every object whose key starts with '{root}/step-00000006/./'" in caplog.text
    assert caplog.text.count(f"{root}/step-00000006/./") == 1  # the walk's key not again
    assert f"{root}//step-00000007" in caplog.text or f"{root}/" in caplog.text
