"""RunSaves, the write side of a Checkpointer: set-up, commit, retention, the newest step."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import make_mlp
from ddpckpt import Checkpointer
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.writing import header_fields
from ddpckpt._run.options import Arguments, resolve
from ddpckpt._run.saving import RunSaves
from ddpckpt._state.capture import TrainingState, capture
from ddpckpt.errors import CheckpointStepError, CheckpointWriteError
from ddpckpt.storage._location import locate


def test_saves_commit_retain_and_refuse_going_back(tmp_path) -> None:
    run = tmp_path / "run"
    model = make_mlp()
    saves = RunSaves(locate(str(run)), resolve(Arguments(keep_last=1)), AsyncSaver())
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


def test_saves_that_come_faster_than_they_are_written_say_so_once(
    tmp_path, caplog, monkeypatch
) -> None:
    """A save that must wait for the previous one's write stalls training (on an H200, a
    fast tier saved every 4 steps waited 1.4-3.1 s per save); it used to say nothing. Now
    the first such wait is a WARNING with the figures and the cadence that would not wait."""
    model = make_mlp()
    saves = RunSaves(
        locate(str(tmp_path / "run")), resolve(Arguments(async_save=True)), AsyncSaver()
    )
    persist = saves._persist
    monkeypatch.setattr(saves, "_persist", lambda plan: time.sleep(0.8) or persist(plan))

    def save(step: int) -> None:
        state = TrainingState.of(model=model)
        saves.save(step, header_fields(step, None, None), lambda: capture(state), False)

    with caplog.at_level(logging.DEBUG, logger="ddpckpt"):
        save(2)
        save(4)  # at once: waits about 0.8 s for step 2's write
        save(6)
        saves.saver.join()
        save(8)  # nothing in flight: no wait
    waits = [r for r in caplog.records if "stalled training" in r.getMessage()]
    assert [r.levelno for r in waits] == [logging.WARNING, logging.DEBUG], waits
    text = waits[0].getMessage()
    assert "save() of step 4 stalled training for 0." in text
    assert "the write of step 2 to finish" in text
    assert "the 2 step(s) between the two saves" in text
    assert "(every_steps= or every_seconds=) would not wait (said once;" in text
    enough = int(text.split("Saves every ")[1].split()[0])
    assert enough > 2  # the write took far longer than the two steps between the saves
    saves.close()


def test_a_failed_save_falls_back_to_the_newest_committed(tmp_path, caplog) -> None:
    saves = RunSaves(locate(str(tmp_path / "run")), resolve(), AsyncSaver())
    (tmp_path / "run" / "step-00000004").mkdir(parents=True)
    saves.latest, saves.committed = 5, 4  # step 5 was in flight
    saves.failed(5, CheckpointWriteError(errno.ENOSPC, "disk full"))
    assert saves.latest == 4 and saves.failures.failed_saves == 1
    assert "the newest good checkpoint is still" in caplog.text
    assert "step-00000004 (step 4)" in caplog.text


def test_a_failure_never_names_a_checkpoint_that_is_gone(tmp_path, caplog) -> None:
    """The run directory deleted from outside took step 4 with it: the message says the run
    has none, not that step 4 is still the newest good one."""
    saves = RunSaves(locate(str(tmp_path / "run")), resolve(), AsyncSaver())
    saves.latest, saves.committed = 5, 4
    saves.failed(5, CheckpointWriteError(errno.ENOENT, "no such directory"))
    assert saves.latest is None and saves.committed is None
    assert "NONE: this run has no checkpoint to resume from" in caplog.text
    assert "step-00000004" not in caplog.text


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


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("removed", ["files", "directory"])
def test_a_save_whose_directory_is_removed_under_it_never_reports_success(
    tmp_path, caplog, monkeypatch, async_save, removed
) -> None:
    """``rm -rf`` of the run directory while a save writes: it got as far as removing the
    data files (the manifest, written after, is alone), or all of it. The save fails, and
    ``latest`` never names a checkpoint holding a manifest only; the next save goes on."""
    from ddpckpt.storage._posix import PosixStorage

    run = tmp_path / "run"
    ckpt = Checkpointer(run, model=make_mlp(), async_save=async_save, keep_last=3)
    ckpt.save(1)
    ckpt.wait()
    create = PosixStorage.create

    def removed_meanwhile(self, location: str):
        if location.endswith("manifest.json"):
            monkeypatch.setattr(PosixStorage, "create", create)  # once
            staging = os.path.dirname(location)
            if removed == "files":
                for name in os.listdir(staging):
                    os.unlink(os.path.join(staging, name))
            else:
                shutil.rmtree(run)
        return create(self, location)

    monkeypatch.setattr(PosixStorage, "create", removed_meanwhile)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        outcome = ckpt.save(2)
        ckpt.wait()  # a background failure is reported here
        assert ckpt.save(3) == os.fspath(run / "step-00000003")  # settles step 2 first
        ckpt.wait()
    assert outcome is None or async_save  # async: only the path, before writing
    assert ckpt.failed_saves == 0 and not (run / "step-00000002").exists()
    assert "saving step 2 failed" in caplog.text or "a background save failed" in caplog.text
    assert "(1 consecutive failed save)" in caplog.text  # async: reported by wait() as well
    if removed == "files":
        assert "vanished from" in caplog.text and ckpt.steps() == [1, 3]
        assert "the newest good checkpoint is still" in caplog.text
    else:
        assert "the newest good checkpoint is NONE" in caplog.text  # gone with the directory
        assert "was deleted while this job was saving into it" in caplog.text
        assert ckpt.steps() == [3]
    assert (run / "latest").read_text() == "step-00000003\n"
    ckpt.close()


_WRITER_THEN_READER = """
import sys, torch, ddpckpt
for run in sys.argv[1:]:
    try:
        ddpckpt.Checkpointer(run, model=torch.nn.Linear(4, 2)).resume()
        print("writer resumed")
    except ddpckpt.CheckpointError as exc:
        print("writer:", type(exc).__name__, exc)
    try:
        info = ddpckpt.Checkpointer(run, model=torch.nn.Linear(4, 2), read_only=True).resume()
        print("reader resumed", info.step)
    except OSError as exc:
        print("reader:", type(exc).__name__, exc)
"""


def _without_root_privileges() -> None:
    """In the child, before exec: drop the capabilities that let root ignore permission
    bits (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER) from the bounding set."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    for capability in (1, 2, 3):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(77)


@pytest.mark.processes
def test_a_writer_on_a_directory_it_may_not_write_is_pointed_at_read_only(tmp_path) -> None:
    """A writer's resume() on a run directory it may only read is told to open it with
    read_only=True (it wrote no checkpoint, so no "writing the checkpoint failed"); on one
    it may not even read, to check the permissions. Root ignores permission bits, so as
    root the job runs without the capabilities that let it."""
    root = os.geteuid() == 0
    runs = [os.fspath(tmp_path / name) for name in ("read-only", "no-access")]
    for run in runs:
        with Checkpointer(run, model=torch.nn.Linear(4, 2)) as ckpt:
            ckpt.save(1)
    os.chmod(runs[0], 0o555)
    os.chmod(runs[1], 0o000)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WRITER_THEN_READER, *runs], capture_output=True, text=True,
            timeout=120, preexec_fn=_without_root_privileges if root else None,
        )  # fmt: skip
    finally:
        for run in runs:
            os.chmod(run, 0o755)
    if done.returncode == 77:
        pytest.skip("running as root, and dropping CAP_DAC_OVERRIDE is not permitted here")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("writer: CheckpointWriteError")
    assert f"{runs[0]}: setting up the run failed at" in lines[0]
    assert "Checkpointer(..., read_only=True)" in lines[0]
    assert "writing the checkpoint" not in lines[0]
    assert lines[1] == "reader resumed 1"
    assert lines[2].startswith("writer: CheckpointWriteError")
    assert "can neither write nor read there" in lines[2] and "read_only" not in lines[2]
