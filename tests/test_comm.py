"""The collective wrapper without torch.distributed, and how per-rank failures combine."""

from __future__ import annotations

import errno

import pytest

from ddpckpt.comm import Comm, _combine, resolve_timeout
from ddpckpt.errors import (
    CheckpointWriteError,
    CorruptCheckpointError,
    RankFailureError,
)


def test_single_process_is_local_and_errors_pass_unchanged() -> None:
    with Comm.open("ddpckpt.test", path="p") as comm:
        assert (comm.rank, comm.world_size, comm.path) == (0, 1, "p")
        assert comm.all_gather("x", b"a") == [b"a"]
        assert comm.run_all("y", lambda: {"v": 1}) == [{"v": 1}]
        with pytest.raises(KeyError):
            comm.run("z", lambda: {}["missing"])


def test_timeout_comes_from_argument_environment_or_default(monkeypatch) -> None:
    monkeypatch.delenv("DDPCKPT_TIMEOUT", raising=False)
    assert resolve_timeout(None) == 600.0
    monkeypatch.setenv("DDPCKPT_TIMEOUT", "12.5")
    assert resolve_timeout(None) == 12.5
    assert resolve_timeout(3) == 3.0
    monkeypatch.setenv("DDPCKPT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DDPCKPT_TIMEOUT='soon'"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="positive"):
        resolve_timeout(0)


def failure(kind: str, message: str, err: int | None = None) -> dict:
    return {"type": kind, "message": message, "errno": err, "host": "node-a"}


def test_same_failure_everywhere_keeps_its_type() -> None:
    error = _combine(
        "ddpckpt.load",
        {0: failure("CorruptCheckpointError", "bad"), 2: failure("CorruptCheckpointError", "bad")},
    )
    assert type(error) is CorruptCheckpointError
    assert str(error) == "bad (on ranks 0, 2)"
    assert error.failures == {0: "CorruptCheckpointError: bad", 2: "CorruptCheckpointError: bad"}


def test_os_errors_become_write_errors_with_errno() -> None:
    error = _combine("ddpckpt.save", {1: failure("OSError", "disk full", errno.ENOSPC)})
    assert isinstance(error, CheckpointWriteError) and error.errno == errno.ENOSPC


def test_different_failures_list_every_rank() -> None:
    error = _combine(
        "ddpckpt.save", {0: failure("KeyError", "'x'"), 3: failure("OSError", "gone", errno.EIO)}
    )
    assert type(error) is RankFailureError
    assert "rank 0 (node-a): KeyError: 'x'" in str(error)
    assert "rank 3 (node-a): OSError: gone" in str(error)
