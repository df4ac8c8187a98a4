"""SaveFailures: which storage errors are retried, and how a failed save is reported."""

from __future__ import annotations

import errno

import pytest

from ddpckpt._run.options import FailureHandling
from ddpckpt._run.save_failures import SaveFailures
from ddpckpt.errors import CheckpointWriteError, InsufficientSpaceError


def failing(errors: list[CheckpointWriteError]):
    """An attempt that raises the queued errors in turn, then succeeds; records attempts."""
    attempts: list[int] = []

    def attempt(n: int) -> None:
        attempts.append(n)
        if errors:
            raise errors.pop(0)

    return attempt, attempts


def test_a_transient_error_is_retried_and_success_clears_the_record() -> None:
    failures = SaveFailures(FailureHandling("warn", retries=2, retry_backoff=0.0))
    failures.failed(7, CheckpointWriteError(errno.EIO, "earlier"), newest=None)
    attempt, attempts = failing([CheckpointWriteError(errno.EIO, "flaky NFS")])
    failures.retrying("run/step-00000008", attempt)
    assert attempts == [0, 1]
    assert failures.last_error is None and failures.failed_saves == 0


@pytest.mark.parametrize(
    "error",
    [CheckpointWriteError(errno.EROFS, "read-only"), InsufficientSpaceError(errno.EIO, "full")],
)
def test_a_lasting_error_is_not_retried(error: CheckpointWriteError) -> None:
    failures = SaveFailures(FailureHandling("warn", retries=3, retry_backoff=0.0))
    attempt, attempts = failing([error])
    with pytest.raises(CheckpointWriteError):
        failures.retrying("run/step-00000001", attempt)
    assert attempts == [0]


def test_retries_run_out() -> None:
    failures = SaveFailures(FailureHandling("warn", retries=1, retry_backoff=0.0))
    attempt, attempts = failing([CheckpointWriteError(errno.EIO, "down")] * 3)
    with pytest.raises(CheckpointWriteError):
        failures.retrying("run/step-00000001", attempt)
    assert attempts == [0, 1]


def test_warn_counts_and_names_the_newest_good_checkpoint(caplog) -> None:
    failures = SaveFailures(FailureHandling("warn", retries=0, retry_backoff=0.0))
    first = CheckpointWriteError(errno.ENOSPC, "disk full")
    failures.failed(3, first, newest="run/step-00000002 (step 2)")
    failures.failed(4, CheckpointWriteError(errno.ENOSPC, "disk full"), newest=None)
    err = caplog.text
    assert "saving step 3 failed (1 consecutive failed save)" in err
    assert "still run/step-00000002 (step 2)" in err
    assert "saving step 4 failed (2 consecutive failed saves)" in err
    assert "NONE: this run has no checkpoint to resume from" in err
    assert failures.failed_saves == 2


def test_raise_raises_and_still_records() -> None:
    failures = SaveFailures(FailureHandling("raise", retries=0, retry_backoff=0.0))
    exc = CheckpointWriteError(errno.EIO, "gone")
    with pytest.raises(CheckpointWriteError):
        failures.failed(1, exc, newest=None)
    assert failures.last_error is exc and failures.failed_saves == 1


def test_a_background_failure_is_logged_once_and_a_bug_always_raises(caplog) -> None:
    failures = SaveFailures(FailureHandling("warn", retries=0, retry_backoff=0.0))
    exc = CheckpointWriteError(errno.ENOSPC, "background write failed")
    failures.report_background(exc, "run/step-00000001 (step 1)")
    failures.report_background(exc, "run/step-00000001 (step 1)")  # wait() twice
    failures.failed(2, exc, newest=None)  # the next collective call settles it: not again
    assert caplog.text.count("background write failed") == 1
    # as the README promises for every failed save: the count and the newest good one
    assert "(1 consecutive failed save)" in caplog.text
    assert "the newest good checkpoint is still run/step-00000001 (step 1)" in caplog.text
    with pytest.raises(TypeError):
        failures.report_background(TypeError("a bug in a save hook"), None)
    failures.report_background(None, None)
