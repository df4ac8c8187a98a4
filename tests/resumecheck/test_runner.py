"""A check run's launch, on real launches of a tiny script that runs to its end and then
exits: an exit code is a failure however the script exits; only a death by a signal after
every rank's script ended (torch 2.13's teardown abort) lets the check go on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpckpt._resumecheck.runner import KillPoint, run
from tiny_check import SUPPORT, TORCHRUN, check

pytestmark = [pytest.mark.processes, pytest.mark.long]

SCRIPT = str(SUPPORT / "exiting_script.py")


def _torchrun(tmp_path: Path) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node=1", "--max-restarts=0", SCRIPT,
            str(tmp_path / "user")]  # fmt: skip


@pytest.mark.parametrize(
    ("how", "launcher"),
    [("raise", "torchrun"), ("builtin", "python"), ("bound", "python"), ("os-exit", "python")],
)
def test_an_exit_with_an_error_code_after_the_script_ended_fails_the_check(
    tmp_path: Path, how: str, launcher: str
) -> None:
    """raise SystemExit(3), exit(3), a sys.exit bound before ddpckpt's import (none of them
    through ddpckpt's hook of sys.exit), and os._exit(3) after the atexit handlers ran."""
    command = _torchrun(tmp_path) if launcher == "torchrun" else [sys.executable, SCRIPT,
                                                                  str(tmp_path / "user")]  # fmt: skip
    code, output, _ = check(tmp_path, command, env={"EXIT_HOW": how})
    assert code == 2, output[-5000:]
    launcher_exit = 1 if launcher == "torchrun" else 3
    assert f"error: reference: the script failed (exit {launcher_exit}): " in output, output[-5000:]
    assert "rank 0 exited with code 3" in output
    assert "died in the interpreter's teardown" not in output


def test_a_death_by_a_signal_after_the_script_ended_is_noted_and_the_check_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXIT_HOW", "abort")
    result = run("reference", _torchrun(tmp_path), str(tmp_path / "check"), timeout=150)
    (note,) = result.notes
    assert "every rank's script ran to its end, then the launcher exited with 1" in note
    assert "(rank 0 by SIGABRT)" in note and "pytorch/pytorch#190489" in note


def test_a_killed_run_on_another_number_of_ranks_is_named_not_blamed_on_the_kill_point(
    tmp_path: Path,
) -> None:
    """A 1-rank run checked against a 2-rank uninterrupted run used to end with 'rank 1
    never reached the kill point ...; choose a --kill-at inside the run'."""
    command = [sys.executable, SCRIPT, str(tmp_path / "user")]  # one process: world 1
    with pytest.raises(RuntimeError) as caught:
        run("kill-3", command, str(tmp_path / "check"), kill=KillPoint(3), rank=1, world=2,
            timeout=150)  # fmt: skip
    said = str(caught.value)
    assert said.startswith("kill-3: the script ran on 1 rank, the uninterrupted run on 2: ")
    assert "never reached" not in said
