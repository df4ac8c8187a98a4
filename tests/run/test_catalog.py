"""ddpckpt.latest: the newest committed checkpoint of a directory, without parsing names."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt.storage import storage_for


def test_the_newest_committed_checkpoint_of_a_save_loop(ckpt_root, caplog) -> None:
    ckpt = ckpt_root / "ckpt"
    assert ddpckpt.latest(ckpt) is None  # nothing yet (not even the directory)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (8, 9, 10, 11):  # "step-9" sorts after "step-11" by name
        train_steps(model, opt, steps=1)
        ddpckpt.save(f"{ckpt}/step-{step}", model=model, optimizer=opt, step=step)
    assert ddpckpt.latest(ckpt) == os.path.join(ckpt, "step-11")
    for moved in (".step-12.tmp-0a1b2c", "step-12.corrupt-0a1b2c"):  # in progress, set aside
        (ckpt / moved).mkdir()
        for file in (ckpt / "step-11").iterdir():  # complete, and newer: skipped by name
            (ckpt / moved / file.name).write_bytes(file.read_bytes())
    (ckpt / "step-11" / "manifest.json").unlink()  # a save killed before its commit
    (ckpt / "notes.txt").write_text("not a checkpoint")
    damaged = ckpt / "step-10" / "model-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])  # a damaged copy
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        found = ddpckpt.latest(ckpt)
    assert found == os.path.join(ckpt, "step-9")
    (warning,) = caplog.messages  # the damaged copy is said; no manifest, no checkpoint
    assert os.path.join(ckpt, "step-10") in warning and "model-00000.safetensors has 100" in warning
    fresh = make_mlp(seed=1)
    assert ddpckpt.load(found, model=fresh).step == 9


def test_a_checkpoint_deleted_while_it_is_checked_is_skipped_without_calling_it_damaged(
    ckpt_root, caplog, monkeypatch
) -> None:
    """An evaluator polling a live run: the writer's retention removes a checkpoint (by
    renaming it first) between latest()'s listing and its size checks. latest() used to warn
    that the checkpoint was damaged."""
    ckpt = ckpt_root / "ckpt"
    model = make_mlp()
    for step in (1, 2):
        ddpckpt.save(f"{ckpt}/step-{step}", model=model, step=step)
    store = storage_for(str(ckpt))
    real_size = type(store).size

    def size_after_retention(self, location: str) -> int:
        checkpoint = os.path.dirname(location)
        if os.path.basename(checkpoint) == "step-2":
            self.rename(checkpoint, os.path.join(ckpt, ".deleting-step-2"))
        return real_size(self, location)

    monkeypatch.setattr(type(store), "size", size_after_retention)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ddpckpt.latest(ckpt) == os.path.join(ckpt, "step-1")
    assert caplog.messages == []


def test_checkpoints_saved_without_a_step_go_by_time(ckpt_root) -> None:
    model = make_mlp()
    for name in ("b", "a"):
        ddpckpt.save(ckpt_root / name, model=model)
    assert ddpckpt.latest(ckpt_root) == os.path.join(ckpt_root, "a")
    ddpckpt.save(ckpt_root / "c", model=model, step=0)
    assert ddpckpt.latest(ckpt_root) == os.path.join(ckpt_root, "c")


def test_a_checkpointer_run_directory_works_too(ckpt_root) -> None:
    run = ckpt_root / "run"
    with ddpckpt.Checkpointer(run, model=make_mlp(), keep_last=2) as ckpt:
        for step in (5, 50, 500):
            ckpt.save(step)
    assert ddpckpt.latest(run) == os.path.join(run, "step-00000500")


def test_a_checkpoint_given_as_the_directory_is_an_error_not_a_fresh_start(ckpt_root) -> None:
    """latest("ckpt/last") used to answer None, so a script resuming from it started over."""
    ddpckpt.save(ckpt_root / "last", model=make_mlp(), step=3)
    assert ddpckpt.latest(ckpt_root) == os.path.join(ckpt_root, "last")
    with pytest.raises(ValueError, match=f"pass the directory that holds it \\({ckpt_root}\\)"):
        ddpckpt.latest(ckpt_root / "last")
