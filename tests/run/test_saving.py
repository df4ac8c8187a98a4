"""RunSaves, the write side of a Checkpointer: set-up, commit, retention, the newest step."""

from __future__ import annotations

import errno

import pytest

from conftest import make_mlp
from ddpckpt import Checkpointer
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.writing import header_fields
from ddpckpt._run.options import resolve
from ddpckpt._run.saving import RunSaves
from ddpckpt._state.capture import TrainingState, capture
from ddpckpt.errors import CheckpointStepError, CheckpointWriteError


def test_saves_commit_retain_and_refuse_going_back(tmp_path) -> None:
    run = tmp_path / "run"
    model = make_mlp()
    saves = RunSaves(str(run), resolve(keep_last=1), AsyncSaver())
    assert saves.newest() == "nothing (this run has no committed checkpoint)"

    def save(step: int) -> str | None:
        return saves.save(
            step,
            header_fields(step, None, None),
            lambda: capture(TrainingState.of(model=model)),
            True,
        )

    assert save(1) == str(run / "step-00000001")
    assert (run / ".lock").exists()  # taken at the first save
    assert save(2) == str(run / "step-00000002")
    assert (saves.latest, saves.committed) == (2, 2)
    assert saves.newest() == f"{run / 'step-00000002'} (step 2)"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000002"]  # keep_last=1
    assert (run / "latest").read_text() == "step-00000002\n"
    with pytest.raises(CheckpointStepError, match="newest checkpoint is step 2"):
        save(1)
    saves.close()
    assert not (run / ".lock").exists()


def test_a_failed_save_falls_back_to_the_newest_committed(tmp_path, caplog) -> None:
    saves = RunSaves(str(tmp_path / "run"), resolve(), AsyncSaver())
    saves.latest, saves.committed = 5, 4  # step 5 was in flight
    saves.failed(5, CheckpointWriteError(errno.ENOSPC, "disk full"))
    assert saves.latest == 4 and saves.failures.failed_saves == 1
    assert "step-00000004 (step 4)" in caplog.text


@pytest.mark.parametrize("async_save", [False, True])
def test_a_lock_that_cannot_be_read_fails_that_save_and_training_goes_on(
    tmp_path, caplog, async_save
) -> None:
    """The lock check before writing is storage I/O too: an error reading the lock (here a
    directory where the lock file was, as EIO on a flaky NFS) is a failed save, logged under
    on_error="warn", not an OSError that ends the run at the next save."""
    run = tmp_path / "run"
    model = make_mlp()
    ckpt = Checkpointer(run, model=model, async_save=async_save)
    try:
        assert ckpt.save(1) is not None
        ckpt.wait()
        (run / ".lock").rename(run / "lock.kept")
        (run / ".lock").mkdir()
        ckpt.save(2)
        ckpt.wait()
        (run / ".lock").rmdir()
        (run / "lock.kept").rename(run / ".lock")
        assert ckpt.save(3) is not None  # handles step 2's failure first when it was async
        ckpt.wait()
    finally:
        ckpt.close()
    assert ".lock: Is a directory" in caplog.text and "training goes on" in caplog.text
    assert ckpt.steps() == [1, 3]


def test_a_run_directory_that_cannot_be_created_fails_that_save_and_training_goes_on(
    tmp_path, caplog, monkeypatch
) -> None:
    """A first save into a run directory that cannot be created (a read-only mount, a path
    without permission) raised the bare OSError of mkdir, ending the run despite
    on_error="warn", while the same failure one directory deeper was logged."""
    from ddpckpt.storage._posix import PosixStorage

    def read_only(self, location: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", location)

    monkeypatch.setattr(PosixStorage, "make_dirs", read_only)
    ckpt = Checkpointer(tmp_path / "run", model=make_mlp())
    try:
        assert ckpt.save(1) is None
        assert isinstance(ckpt.last_error, CheckpointWriteError)
        assert ckpt.last_error.errno == errno.EROFS
    finally:
        ckpt.close()
    assert "saving step 1 failed" in caplog.text and "training goes on" in caplog.text
