"""Failures and fallbacks reach stderr with no logging set up, and exactly once with it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import ddpckpt
from ddpckpt import _log

FAILING_RUN = """
import errno, os, torch, ddpckpt
import ddpckpt._io.writing as writing
{setup}
def full(path, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

ckpt = ddpckpt.Checkpointer({run!r}, model=torch.nn.Linear(2, 2), every_steps=10)
ckpt.save(0)
writing.write_file = full  # the disk is full from now on
for step in (10, 20, 30):
    print("saved" if ckpt.save(step) else "not saved")
ckpt.close()
"""


def run_script(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("DDPCKPT_LOG_ALL_RANKS", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.processes
def test_a_failing_save_is_on_stderr_without_any_logging_set_up(tmp_path) -> None:
    done = run_script(FAILING_RUN.format(setup="", run=str(tmp_path / "run")))
    assert done.stdout.split("\n")[:3] == ["not saved"] * 3
    errors = [line for line in done.stderr.splitlines() if "consecutive failed save" in line]
    assert len(errors) == 3, done.stderr  # every failed save, not only the first
    assert errors[0].startswith("ddpckpt ERROR [rank 0]: saving step 10 failed")
    assert "(3 consecutive failed saves)" in errors[2] and "No space left" in errors[2]
    assert all("step-00000000 (step 0)" in line for line in errors)  # the newest good one


@pytest.mark.processes
def test_with_logging_configured_each_message_appears_once(tmp_path) -> None:
    setup = "import logging, sys\nlogging.basicConfig(stream=sys.stderr, format='APP %(message)s')"
    done = run_script(FAILING_RUN.format(setup=setup, run=str(tmp_path / "run")))
    lines = [line for line in done.stderr.splitlines() if "consecutive failed save" in line]
    assert len(lines) == 3 and all(line.startswith("APP saving step") for line in lines)
    assert "ddpckpt ERROR" not in done.stderr  # the library's own handler stood aside


@pytest.mark.processes
def test_a_handler_on_the_ddpckpt_logger_also_counts_as_configured(tmp_path) -> None:
    setup = (
        "import logging, sys\nh = logging.StreamHandler(sys.stdout)\n"
        "logging.getLogger('ddpckpt').addHandler(h)"
    )
    done = run_script(FAILING_RUN.format(setup=setup, run=str(tmp_path / "run")))
    assert done.stdout.count("consecutive failed save") == 3
    assert "consecutive failed save" not in done.stderr


@pytest.mark.processes
def test_fallbacks_are_on_stderr_without_any_logging_set_up(tmp_path) -> None:
    run = tmp_path / "run"
    code = f"""
    import json, os, platform, torch, ddpckpt
    model = torch.nn.Linear(2, 2)
    with ddpckpt.Checkpointer({str(run)!r}, model=model, keep_last=None) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
    os.unlink({str(run / "step-00000002" / "manifest.json")!r})  # damaged newest
    gone = {{"host": platform.node(), "pid": 2**22 + 12345, "job": None, "since": 0}}
    with open({str(run / ".lock")!r}, "w") as f:
        json.dump(gone, f)  # left by a job that died
    with ddpckpt.Checkpointer({str(run)!r}, model=model) as ckpt:
        print(ckpt.resume().step)
    """
    done = run_script(code)
    assert done.stdout.strip() == "1"
    assert "ddpckpt WARNING [rank 0]: " in done.stderr
    assert "taking over a stale lock" in done.stderr
    assert "moved" in done.stderr and "step-00000002" in done.stderr


@pytest.mark.parametrize(
    ("rank", "failures", "shown"),
    [
        (0, {0: "OSError: full", 1: "OSError: full"}, True),
        (1, {0: "OSError: full", 1: "OSError: full"}, False),  # rank 0 reports it
        (1, {0: "OSError: full: file-0", 1: "OSError: full: file-1"}, False),  # and lists both
        (1, {1: "OSError: full"}, True),  # only this rank failed: its own log says so
        (1, {}, False),
    ],
)
def test_a_failure_every_rank_raises_is_printed_by_rank_zero(
    monkeypatch, rank, failures, shown
) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.delenv("DDPCKPT_LOG_ALL_RANKS", raising=False)
    error = ddpckpt.CheckpointWriteError(28, "disk full")
    error.failures = failures
    logger = _log.get_logger("test")
    record = logger.makeRecord(
        logger.name,
        logging.ERROR,
        __file__,
        1,
        "failed",
        (),
        None,
        extra=_log.same_on_every_rank(error),
    )
    assert bool(logger.filter(record)) is shown  # Python 3.12 returns the record itself
    plain = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "its own", (), None)
    assert logger.filter(plain)  # other warnings pass on every rank


@pytest.mark.processes
def test_a_failure_on_every_rank_is_printed_once_and_one_ranks_own_failure_there(tmp_path):
    from launch import forked_ranks

    args = ["--ckpt", str(tmp_path / "run")]
    launch = forked_ranks("failing_saves", tmp_path / "out", nproc=2, args=args).ok()
    assert {r["failed_saves"] for r in launch.results.values()} == {2}
    every = [line for line in launch.output.splitlines() if "saving step 2 failed" in line]
    assert len(every) == 1 and every[0].startswith("ddpckpt ERROR [rank 0]"), launch.output
    only_rank_1 = [line for line in launch.output.splitlines() if "saving step 3 failed" in line]
    assert sorted(line[:22] for line in only_rank_1) == [
        "ddpckpt ERROR [rank 0]",
        "ddpckpt ERROR [rank 1]",
    ], launch.output
