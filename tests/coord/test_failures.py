"""One error for every rank's failures: its type, errno and per-rank report (ddpckpt._coord.failures)."""

from __future__ import annotations

import errno

from ddpckpt._coord.failures import combine
from ddpckpt.errors import CheckpointWriteError, CorruptCheckpointError, RankFailureError


def failure(kind: str, message: str, err: int | None = None) -> dict:
    return {"type": kind, "message": message, "errno": err, "host": "node-a"}


def test_same_failure_everywhere_keeps_its_type() -> None:
    error = combine(
        "ddpckpt.load",
        {0: failure("CorruptCheckpointError", "bad"), 2: failure("CorruptCheckpointError", "bad")},
    )
    assert type(error) is CorruptCheckpointError
    assert str(error) == "bad (on ranks 0, 2)"
    assert error.failures == {0: "CorruptCheckpointError: bad", 2: "CorruptCheckpointError: bad"}


def test_os_errors_become_write_errors_with_errno() -> None:
    error = combine("ddpckpt.save", {1: failure("OSError", "disk full", errno.ENOSPC)})
    assert isinstance(error, CheckpointWriteError) and error.errno == errno.ENOSPC


def test_different_failures_list_every_rank() -> None:
    error = combine(
        "ddpckpt.save", {0: failure("KeyError", "'x'"), 3: failure("OSError", "gone", errno.EIO)}
    )
    assert type(error) is RankFailureError
    assert "rank 0 (node-a): KeyError: 'x'" in str(error)
    assert "rank 3 (node-a): OSError: gone" in str(error)
