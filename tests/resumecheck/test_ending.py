"""How a launch that exited non-zero is judged: only a death by a signal after every rank's
script ran to its end is a teardown death; every exit code is a failure."""

from __future__ import annotations

from typing import Any

import pytest

from ddpckpt._resumecheck.ending import WorkerEnd, judge, reached_end_everywhere, reported_ends

TORCHRUN_REPORT = """\
E1127 13:20:26.011000 5837 torch/distributed/elastic/multiprocessing/api.py:1002] failed \
(exitcode: {status}) local_rank: 1 (pid: 202) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : {status} (pid: 202)  (SIGABRT)
  error_file: <N/A>
"""


def _process(rank: int, pid: int, *, end: dict[str, Any] | None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"event": "start", "pid": pid, "world": 2, "restart": 0, "initial": {}, "time": 0.0},
        {"event": "step", "step": 1, "start": None, "end": {}},
    ]
    return events + ([end] if end is not None else [])


def _last(rank1_end: dict[str, Any] | None = None) -> dict[int, list[dict[str, Any]]]:
    clean = {"event": "exit", "failed": False}
    return {0: _process(0, 201, end=clean), 1: _process(1, 202, end=rank1_end or clean)}


def test_a_worker_killed_by_a_signal_after_every_script_ended_is_a_teardown_death() -> None:
    ending = judge(_last(), 100, 1, TORCHRUN_REPORT.format(status=-6))
    assert not ending.failed and ending.teardown == {1: "SIGABRT"}


@pytest.mark.parametrize("status", [3, 1, 255])
def test_an_exit_code_after_every_script_ended_is_a_failure(status: int) -> None:
    """raise SystemExit(3), exit(3), a sys.exit bound before ddpckpt's import, os._exit(3):
    the records say the code ended cleanly; the launcher says how the process ended."""
    ending = judge(_last(), 100, 1, TORCHRUN_REPORT.format(status=status))
    assert ending.failed and f"rank 1 exited with code {status}" in ending.why


def test_the_launcher_that_is_the_process_tells_its_own_end() -> None:
    """`python train.py`: its return code is the process's (negative: a signal)."""
    one = {0: _process(0, 100, end={"event": "exit", "failed": False})}
    one[0][0]["world"] = 1
    assert judge(one, 100, -6, "").teardown == {0: "SIGABRT"}
    assert "rank 0 exited with code 3" in judge(one, 100, 3, "").why


def test_a_launcher_that_names_no_process_of_the_run_proves_nothing() -> None:
    for output in ("", TORCHRUN_REPORT.format(status=-6).replace("202", "999")):
        ending = judge(_last(), 100, 1, output)
        assert ending.failed and "names no process of this run" in ending.why


@pytest.mark.parametrize(
    "end", [{"event": "exit", "failed": True}, None, {"event": "warning", "logger": "x"}]
)
def test_a_script_that_failed_or_never_ended_is_a_failure_whatever_the_signal(end) -> None:
    last = _last()
    last[1] = last[1][:-1] + ([end] if end is not None else [])
    assert not reached_end_everywhere(last)
    assert judge(last, 100, 1, TORCHRUN_REPORT.format(status=-6)).failed


def test_a_rank_missing_from_the_world_is_not_an_end_everywhere() -> None:
    last = _last()
    del last[1]
    assert not reached_end_everywhere(last)


def test_spawn_and_torchrun_reports_are_read() -> None:
    output = (
        "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with "
        "signal SIGABRT\nprocess 0 terminated with exit code 3\n"
        + TORCHRUN_REPORT.format(status=-11)
    )
    assert reported_ends(output) == [
        WorkerEnd(-11, pid=202),
        WorkerEnd(-6, index=1),
        WorkerEnd(3, index=0),
    ]
    spawned = judge(_last(), 100, 1, "process 1 terminated with signal SIGSEGV")
    assert spawned.teardown == {1: "SIGSEGV"}
    assert judge(_last(), 100, 1, "process 1 terminated with exit code 3").failed
