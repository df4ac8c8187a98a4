"""The whole check's own checks of what it is given, before any run starts
(ddpckpt._resumecheck.check); single process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpckpt._resumecheck.check import _user_point, check_resume
from ddpckpt._resumecheck.runner import KillPoint


def test_an_out_that_is_a_file_is_refused_before_any_run(tmp_path: Path) -> None:
    """It used to start the uninterrupted run, then fail with '[Errno 20] Not a directory:
    .../outfile/runs', a path the user never gave."""
    out = tmp_path / "outfile"
    out.write_text("x")
    lines: list[str] = []
    with pytest.raises(ValueError) as caught:
        check_resume([sys.executable, "-c", "pass"], str(out), progress=lines.append)
    assert str(caught.value) == (
        f"--out {out}: is a file, not a directory: give a directory for the check's runs and "
        "report (made if missing), or move the file away"
    )
    assert lines == []  # nothing started


def test_an_out_that_cannot_be_made_says_why(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot make the check's directory there \(Not a dir"):
        check_resume([sys.executable, "-c", "pass"], str(tmp_path / "file" / "out"))


def test_a_kill_point_outside_the_run_is_refused_naming_its_steps() -> None:
    """--kill-at 999 on a run of 32 steps launched a whole killed run before saying the rank
    never reached it."""
    events = [{"event": "step", "step": s} for s in range(1, 33)]
    with pytest.raises(
        ValueError, match=r"^--kill-at 999: the uninterrupted run took steps 1 to 32"
    ):
        _user_point(KillPoint(999), events)
    with pytest.raises(ValueError, match=r"^--kill-at 0:after-save: .* steps 1 to 32"):
        _user_point(KillPoint(0, after_save=True), events)
    assert _user_point(KillPoint(32), events) == KillPoint(32)
