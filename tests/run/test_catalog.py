"""ddpckpt.latest: the newest committed checkpoint of a directory, without parsing names."""

from __future__ import annotations

import copy
import logging
import os
import re
from pathlib import Path

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt.storage import storage_for
from io_helpers import assert_state_equal, flip_byte
from launch import free_port


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


def test_a_file_given_as_the_directory_is_an_error_not_a_fresh_start(tmp_path) -> None:
    """load_latest("ckpt") where ckpt is a file raised a bare NotADirectoryError."""
    (tmp_path / "ckpt").write_text("not a directory")
    model = make_mlp()
    for call in (lambda: ddpckpt.latest(tmp_path / "ckpt"),
                 lambda: ddpckpt.load_latest(tmp_path / "ckpt", model=model)):  # fmt: skip
        with pytest.raises(ValueError, match=f"{tmp_path / 'ckpt'}: is a file, and .* looks for"):
            call()


def _damage_data(checkpoint) -> None:
    """Flip one bit in a tensor's bytes: the manifest and the sizes stay intact."""
    path = checkpoint / "model-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def test_load_latest_falls_back_past_a_damaged_newest_checkpoint(ckpt_root, caplog) -> None:
    """latest() returned the damaged newest and load() raised, at every restart."""
    ckpt = ckpt_root / "ckpt"
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved = {}
    for step in (1, 2):
        train_steps(model, opt, steps=1)
        ddpckpt.save(f"{ckpt}/step-{step}", model=model, optimizer=opt, step=step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    _damage_data(ckpt / "step-2")
    assert ddpckpt.latest(ckpt) == os.path.join(ckpt, "step-2")  # it reads no data
    fresh = make_mlp(seed=1)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        info = ddpckpt.load_latest(
            ckpt, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=1)
        )
    assert info is not None and info.step == 1
    assert all(torch.equal(v, saved[1][k]) for k, v in fresh.state_dict().items())
    skipped, instead = caplog.messages  # why step-2 was skipped; what was loaded instead
    assert os.path.join(ckpt, "step-2") in skipped and "checksum mismatch" in skipped
    assert f"loaded {os.path.join(ckpt, 'step-1')} (step 1) instead" in instead
    assert os.path.join(ckpt, "step-2") in instead
    _damage_data(ckpt / "step-1")
    # Both damaged where the model's tensors are read into the live ones: partly restored.
    live = make_mlp()
    with pytest.raises(ddpckpt.PartiallyRestoredError, match="none can be loaded") as raised:
        ddpckpt.load_latest(ckpt, model=live)
    assert "step-1" in str(raised.value) and "step-2" in str(raised.value)
    assert isinstance(raised.value.__cause__, ddpckpt.PartiallyRestoredError)
    with pytest.raises(ddpckpt.PartiallyRestoredError, match="refusing to save"):
        ddpckpt.save(ckpt / "step-3", model=live, step=3)


def test_load_latest_past_damaged_optimizer_state_resumes_the_previous_checkpoint_exactly(
    ckpt_root, caplog
) -> None:
    """The live optimizer has state, so the damaged checkpoint's moments were read into its
    tensors until the damage was found: the fallback overwrites all of them, nothing of the
    damaged checkpoint is left."""
    ckpt = ckpt_root / "ckpt"
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (1, 2):
        train_steps(model, opt, steps=1)
        ddpckpt.save(f"{ckpt}/step-{step}", model=model, optimizer=opt, step=step)
        if step == 1:
            expected = copy.deepcopy((model.state_dict(), opt.state_dict()))
    state_file = f"{ckpt}/step-2/state-00000.safetensors"
    flip_byte(state_file, storage_for(state_file).size(state_file) - 3)  # the last tensor read
    train_steps(model, opt, steps=2)  # a process that trained on, then reloads
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        info = ddpckpt.load_latest(ckpt, model=model, optimizer=opt)
    assert info is not None and info.step == 1
    assert "partly restored" in caplog.text and "step-2" in caplog.text
    assert_state_equal(model.state_dict(), expected[0])
    assert_state_equal(opt.state_dict(), expected[1])


def test_load_latest_of_nothing_is_none_and_a_mismatch_is_no_damage(ckpt_root) -> None:
    assert ddpckpt.load_latest(ckpt_root / "nothing", model=make_mlp()) is None
    ddpckpt.save(ckpt_root / "ckpt" / "a", model=make_mlp(), step=1)
    with pytest.raises(ddpckpt.errors.StateMismatchError):  # the live model is another: no fallback
        ddpckpt.load_latest(ckpt_root / "ckpt", model=torch.nn.Linear(2, 2))


def _quickstart_recipe() -> str:
    """The quickstart's DDP script, copied literally (the one users start from)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    return re.search(r"```python\n(# train\.py -- .*?)```", page, re.S).group(1)


def test_the_quickstart_recipe_survives_a_damaged_newest_checkpoint_restarted_twice(
    tmp_path, monkeypatch, caplog
) -> None:
    """The quickstart's recipe with one flipped bit in its newest checkpoint crashed the same
    way at every restart. Each run executes the recipe as copied from the page, as rank 0
    of a one-rank job (the fallback is the same on every rank: load raises the same error
    everywhere); test_docs.py runs it under torchrun."""
    recipe = compile(_quickstart_recipe(), "train.py", "exec")
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)

    def run() -> str:
        for attempt in range(3):  # the recipe's env:// rendezvous binds MASTER_PORT itself
            monkeypatch.setenv("MASTER_PORT", str(free_port()))
            caplog.clear()
            try:
                with caplog.at_level(logging.WARNING, logger="ddpckpt"):
                    exec(recipe, {"__name__": "__main__"})
            except torch.distributed.DistNetworkError as exc:
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise  # another process took the port between picking and binding
                continue
            return caplog.text
        raise AssertionError("unreachable")

    run()
    newest = ddpckpt.latest("ckpt")
    _damage_data(Path(newest))
    assert f"cannot load {newest} (" in run()
    assert "cannot load" not in run()
    assert ddpckpt.latest("ckpt") == os.path.join("ckpt", "step-49")
    assert ddpckpt.verify(newest)  # saved again by the first restart, and sound
