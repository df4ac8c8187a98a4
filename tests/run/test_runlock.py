"""The run lock at interpreter exit: a Checkpointer never closed drops its lock, and a store
that is gone by then costs one attempt and one WARNING line (real processes, real server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import s3server

_TESTS = os.fspath(Path(__file__).resolve().parents[1] / "support")

_LEFT_OPEN = """
import sys, torch, ddpckpt
ckpt = ddpckpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
ckpt.save(1)
print("HELD", flush=True)
# no ckpt.close(): the script just ends
"""


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
from ddpckpt.storage import mount
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
