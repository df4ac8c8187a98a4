"""The run lock: at interpreter exit a Checkpointer never closed drops its lock, and a store
that is gone by then costs one attempt and one WARNING line (real processes, real server);
a lock another job took over is lost for good; a lock (or run directory) deleted under a
running job is taken again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpckpt
import s3server
from ddpckpt.errors import CheckpointLockedError

_TESTS = os.fspath(Path(__file__).resolve().parents[1] / "support")

_LEFT_OPEN = """
import sys, torch, ddpckpt
ckpt = ddpckpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
ckpt.save(1)
print("HELD", flush=True)
# no ckpt.close(): the script just ends
"""


@pytest.mark.processes
@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_lock_left_held_is_released_when_the_interpreter_exits(where, tmp_path, request) -> None:
    root = tmp_path if where == "disk" else request.getfixturevalue("s3_root")
    run = f"{root}/run"
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN, run], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "HELD"
    assert "WARNING" not in done.stderr
    from ddpckpt.storage import storage_for

    storage = storage_for(run)
    assert storage.exists(f"{run}/step-00000001/manifest.json")
    assert not storage.exists(f"{run}/.lock")  # the next job finds no lock to take over


_SERVER_GONE = """
import atexit, sys
sends = []
atexit.register(lambda: print("SENDS", len(sends), flush=True))  # runs after ddpckpt's
sys.path.insert(0, sys.argv[1])
import s3server, torch, ddpckpt
from ddpckpt.storage._registry import mount
from ddpckpt.storage.s3 import S3Storage
from ddpckpt.storage._s3client import S3Requests

process, endpoint = s3server.start()
s3server.make_bucket(endpoint, "gone")
make_client = S3Requests._make_client

def counted(self, *args):  # every request any client of this process sends
    client = make_client(self, *args)
    client.meta.events.register("before-send", lambda **kw: sends.append(1))
    return client

S3Requests._make_client = counted
mount("s3://gone", S3Storage(endpoint_url=endpoint, aws_access_key_id="testing",
                             aws_secret_access_key="testing"))
ckpt = ddpckpt.Checkpointer("s3://gone/run", model=torch.nn.Linear(2, 2))
ckpt.save(1)
s3server.stop(process)
sends.clear()
print("STOPPED", flush=True)
"""


@pytest.mark.processes
@pytest.mark.skipif(bool(s3server.missing()), reason=str(s3server.missing()))
def test_at_exit_a_lock_on_a_stopped_server_costs_one_request_and_one_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVER_GONE, _TESTS], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["STOPPED", "SENDS", "1"]  # one attempt, no retries
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, done.stderr
    assert "s3://gone/run/.lock: could not remove the lock" in warnings[0]
    assert "testing" not in done.stderr  # no credentials in the message


def write_lock(run: Path, pid: int, host: str, job: str) -> None:
    (run / ".lock").write_text(json.dumps({"host": host, "pid": pid, "job": job, "since": 0}))


@pytest.mark.parametrize("on_error", ["warn", "raise"])
def test_a_lock_taken_over_is_lost_for_good_and_the_other_jobs_run_is_untouched(
    tmp_path, caplog, on_error
) -> None:
    """The job catches the first CheckpointLockedError and keeps saving: every later save is
    refused (a failed save under "warn"), so nothing of the job that took the directory
    over is deleted or re-pointed by this one's retention."""
    run = tmp_path / "run"
    ckpt = ddpckpt.Checkpointer(run, model=torch.nn.Linear(4, 2), keep_last=1, on_error=on_error)
    ckpt.save(1)
    write_lock(run, 1, "another-node", "job-9")  # another job took the directory over ...
    theirs = torch.nn.Linear(4, 2)
    ddpckpt.save(run / "step-00000009", model=theirs, step=9)  # ... and saved its step 9
    (run / "latest").write_text("step-00000009\n")
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointLockedError, match="took this directory's lock over"):
        ckpt.save(2)
    for step in (3, 10):  # 10: newer than theirs, so keep_last=1 would delete their step 9
        if on_error == "raise":
            with pytest.raises(CheckpointLockedError, match=r"every later one .* refused"):
                ckpt.save(step)
        else:
            with caplog.at_level(logging.ERROR, logger="ddpckpt"):
                assert ckpt.save(step) is None
            assert isinstance(ckpt.last_error, CheckpointLockedError)
    assert ckpt.failed_saves == 2
    if on_error == "warn":
        assert "saving step 10 failed (2 consecutive failed saves)" in caplog.text
    ckpt.close()  # leaves their lock alone
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    loaded = torch.nn.Linear(4, 2)
    ddpckpt.load(run / "step-00000009", model=loaded)
    assert torch.equal(loaded.weight, theirs.weight)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("deleted", ["directory", "lock"])
def test_a_run_directory_or_lock_deleted_mid_run_is_taken_again_and_saving_goes_on(
    tmp_path, caplog, async_save, deleted
) -> None:
    """A clean-up script, a user or a scheduler's purge removed it: nobody took it over, so
    training goes on under on_error="warn", with a WARNING saying what happened."""
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 2)
    ckpt = ddpckpt.Checkpointer(run, model=model, async_save=async_save)
    ckpt.save(1)
    ckpt.wait()
    if deleted == "directory":
        shutil.rmtree(run)
    else:
        (run / ".lock").unlink()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ckpt.save(2) == os.fspath(run / "step-00000002")
        ckpt.wait()
    expected = "was deleted while this job was saving into it" if deleted == "directory" else (
        "was deleted while this job held the lock"
    )  # fmt: skip
    assert expected in caplog.text and "pid None" not in caplog.text
    assert ckpt.failed_saves == 0 and ckpt.last_error is None
    assert (run / "latest").read_text() == "step-00000002\n"
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    assert ddpckpt.verify(run / "step-00000002").step == 2
    ckpt.close()
    assert not (run / ".lock").exists()
