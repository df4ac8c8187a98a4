"""A run directory whose path is taken by a file is refused plainly, naming the file and
what to do, by the set-up of a Checkpointer that saves and by a read-only one."""

from __future__ import annotations

import os

import pytest

from conftest import make_mlp
from ddpckpt import Checkpointer


def test_a_file_as_the_run_directory_is_refused_at_resume_and_at_save(tmp_path) -> None:
    run = tmp_path / "exp1"
    run.write_text("hello\n")
    expected = (
        f"{run}: is a file, not a directory, and a Checkpointer keeps a run's checkpoints "
        "inside a directory: pass the directory your saves should go to (a missing one is "
        "created), or move this file away"
    )
    ckpt = Checkpointer(run, model=make_mlp())
    with pytest.raises(ValueError) as raised:
        ckpt.resume()
    assert str(raised.value) == expected
    with pytest.raises(ValueError) as raised:  # a mistake, not a failed save: on_error="warn"
        ckpt.save(1)
    assert str(raised.value) == expected
    ckpt.close()
    assert run.read_text() == "hello\n"


def test_a_file_above_the_run_directory_is_named(tmp_path) -> None:
    (tmp_path / "runs").write_text("hello\n")
    ckpt = Checkpointer(tmp_path / "runs" / "exp1", model=make_mlp())
    with ckpt, pytest.raises(ValueError) as raised:
        ckpt.resume()
    assert str(raised.value) == (
        f"{tmp_path}/runs/exp1: cannot be a run directory: {tmp_path}/runs is a file, not a "
        f"directory: pass a path that is not under a file, or move {tmp_path}/runs away"
    )


def test_a_symbolic_link_to_no_directory_is_named_as_such(tmp_path) -> None:
    run = tmp_path / "exp1"
    os.symlink(tmp_path / "nowhere", run)
    ckpt = Checkpointer(run, model=make_mlp())
    with ckpt, pytest.raises(ValueError, match=r"is a symbolic link to .*nowhere, not a directory"):
        ckpt.resume()


def test_a_reader_refuses_a_file_too_rather_than_starting_afresh(tmp_path) -> None:
    run = tmp_path / "exp1"
    run.write_text("hello\n")
    reader = Checkpointer(run, model=make_mlp(), read_only=True)
    with reader, pytest.raises(ValueError) as raised:
        reader.resume()
    assert str(raised.value) == (
        f"{run}: is a file, not a directory, and a Checkpointer keeps a run's checkpoints "
        "inside a directory: pass the run directory the saving job writes to, or move this "
        "file away"
    )
