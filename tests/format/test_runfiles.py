"""The files of a run directory as typed records: damaged ones are reported, never a hang or
a raw exception, and never the reason a run cannot resume."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

import ddpckpt
from conftest import make_mlp
from ddpckpt._cli.main import main
from ddpckpt._format.runfiles import is_stray_step, parse_lock, parse_step, step_dirname
from ddpckpt.errors import CorruptCheckpointError


@pytest.fixture
def run(tmp_path):
    """A run directory with checkpoints at steps 1 and 2 (latest, run.json, no lock)."""
    directory = tmp_path / "run"
    with ddpckpt.Checkpointer(directory, model=make_mlp(), keep_last=3) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
    return directory


def resume(directory) -> int | None:
    with ddpckpt.Checkpointer(directory, model=make_mlp(seed=1)) as ckpt:
        info = ckpt.resume()
    return info.step if info else None


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"step-2; rm -rf /", b"../../x"])
def test_a_damaged_latest_is_reported_and_the_run_still_resumes(run, content, caplog, capsys):
    """Garbage bytes in latest raised UnicodeDecodeError from resume() and from ls."""
    (run / "latest").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert resume(run) == 2
    assert f"{run / 'latest'}: " in caplog.text and "ignored" in caplog.text
    assert (run / "latest").read_text() == "step-00000002\n"  # pointed again at the newest
    (run / "latest").write_bytes(content)
    assert main(["ls", str(run)]) == 0
    assert "step" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["latest", "run.json"])
def test_a_fifo_for_latest_or_run_json_blocks_nothing(run, name, caplog) -> None:
    """A FIFO as latest hung resume() and ls forever."""
    (run / name).unlink()
    os.mkfifo(run / name)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert main(["ls", str(run)]) == 0
    assert f"{run / name}: the" in caplog.text and "is a FIFO; refused" in caplog.text
    assert resume(run) == 2


@pytest.mark.timeout(60)
def test_a_fifo_as_the_lock_is_an_error_naming_it_not_a_hang(run, capsys) -> None:
    """A FIFO as .lock hung resume() and clean forever."""
    os.mkfifo(run / ".lock")
    with pytest.raises(OSError, match=r"\.lock: a FIFO, not a regular file"):
        resume(run)
    assert main(["clean", str(run)]) == 2
    assert ".lock: a FIFO, not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [b"[1, 2]", b'{"host": "h", "pid": "twelve", "job": null, "since": 0}',
     b'{"host": "h", "pid": 1e999, "job": null, "since": 0}', b'{"host": 3, "pid": 1}',
     b'{"host": "h", "pid": -1}'],
)  # fmt: skip
def test_a_malformed_lock_is_a_torn_one_taken_over_once_old(run, content) -> None:
    """A .lock holding a JSON list, a non-numeric or infinite pid raised AttributeError,
    ValueError or OverflowError from resume()."""
    with pytest.raises(CorruptCheckpointError, match=r"\.lock"):
        parse_lock(content, str(run / ".lock"))
    (run / ".lock").write_bytes(content)
    with pytest.raises(ddpckpt.errors.CheckpointLockedError, match=r"creating it right now"):
        resume(run)  # young: maybe a job writing it this very moment
    old = time.time() - 3600
    os.utime(run / ".lock", (old, old))
    assert resume(run) == 2


def test_a_damaged_run_json_is_reported_and_ls_goes_on(run, caplog, capsys) -> None:
    (run / "run.json").write_text(json.dumps({"retention": {"type": "KeepLast", "n": "3"}}))
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert main(["ls", str(run)]) == 0
    assert "field 'n' is the string '3'" in caplog.text


def test_stray_step_names_are_skipped_with_a_warning(run, caplog) -> None:
    """step-2 and step-00000002 both read as step 2: resume() tried to load a directory it
    then could not find, and retention could delete a copy the user kept."""
    for stray in ("step-2", "step-000000002", "step-00000002.bak", "step-\u0663"):
        os.mkdir(run / stray)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert resume(run) == 2
    for stray in ("step-2", "step-000000002", "step-00000002.bak"):
        assert str(run / stray) in caplog.text
        assert (run / stray).is_dir()  # never deleted, moved or loaded
    assert "ddpckpt writes step-00000002" in caplog.text


def test_step_names_have_one_spelling() -> None:
    assert parse_step(step_dirname(7)) == 7 and parse_step(step_dirname(10**9)) == 10**9
    for name in ("step-7", "step-000000007", "step-00000007 ", "step-0000000\u0667", "stepx"):
        assert parse_step(name) is None
    assert is_stray_step("step-7") and not is_stray_step("step-00000007.corrupt-0a1b")
