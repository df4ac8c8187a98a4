"""The run directory's repairs: a checkpoint an interrupted overwrite left as
``.step-N.previous`` (a file system without RENAME_EXCHANGE) is put back by every start of
the run, read where it is by readers, and never touched while a live job holds the lock."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess

import pytest
import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt._cli.main import main
from ddpckpt.storage._location import locate


def killed_between_the_renames(tmp_path) -> tuple[str, torch.nn.Module]:
    """A run whose step 1 was being saved again when the process died between the two
    renames: step-1 is ``.step-00000001.previous``, the new copy a temporary."""
    run = os.fspath(tmp_path / "run")
    model = make_mlp()
    with ddpckpt.Checkpointer(run, model=model, keep_last=1) as ckpt:
        ckpt.save(1)
    step = os.path.join(run, "step-00000001")
    os.rename(step, os.path.join(run, ".step-00000001.previous"))
    os.mkdir(os.path.join(run, ".step-00000001.tmp-0a1b2c3d4e5f-0"))
    return run, model


def put_back(run: str) -> bool:
    names = sorted(os.listdir(run))
    return "step-00000001" in names and not any(n.endswith(".previous") for n in names)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("start", ["resume", "latest", "ls", "clean"])
def test_every_start_puts_the_checkpoint_back(tmp_path, caplog, capsys, start) -> None:
    run, saved = killed_between_the_renames(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        if start == "resume":
            fresh = make_mlp(seed=1)
            with ddpckpt.Checkpointer(run, model=fresh) as ckpt:
                assert ckpt.resume().step == 1
            assert same_weights(fresh, saved)
        elif start == "latest":
            assert ddpckpt.latest(run) == os.path.join(run, "step-00000001")
        else:
            assert main([start, run]) == 0
            if start == "ls":
                row = capsys.readouterr().out.splitlines()[2].split()
                assert (row[0], row[5]) == ("1", "verified")
    assert "restored from" in caplog.text
    assert put_back(run)
    assert ddpckpt.verify(os.path.join(run, "step-00000001")).step == 1


def test_a_reader_loads_it_where_it_is_and_moves_nothing(tmp_path) -> None:
    run, saved = killed_between_the_renames(tmp_path)
    before = sorted(os.listdir(run))
    fresh = make_mlp(seed=1)
    reader = ddpckpt.Checkpointer(run, model=fresh, read_only=True)
    assert reader.resume().step == 1 and reader.steps() == [1]
    assert same_weights(fresh, saved)
    assert sorted(os.listdir(run)) == before


@pytest.mark.processes
def test_while_a_live_job_holds_the_lock_latest_names_it_where_it_is(tmp_path) -> None:
    """That job may be replacing step-1 this very moment: nobody else moves anything."""
    run, _ = killed_between_the_renames(tmp_path)
    holder = subprocess.Popen(["sleep", "60"])  # a live process of this host holds it
    lock = {"host": platform.node(), "pid": holder.pid, "job": None, "since": 0}
    with open(os.path.join(run, ".lock"), "w") as f:
        json.dump(lock, f)
    try:
        before = sorted(os.listdir(run))
        assert ddpckpt.latest(run) == os.path.join(run, ".step-00000001.previous")
        assert main(["ls", run]) == 0
        assert sorted(os.listdir(run)) == before
    finally:
        holder.kill()
        holder.wait()
    assert ddpckpt.latest(run) == os.path.join(run, "step-00000001")


def test_latest_a_directory_is_left_with_one_warning_and_a_file_is_replaced(
    tmp_path, caplog
) -> None:
    """Writing ``latest`` over a directory failed ("Is a directory") and broke resume()."""
    from ddpckpt._format.runfiles import read_latest
    from ddpckpt._run.rundir import write_latest

    (tmp_path / "latest").mkdir()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert write_latest(locate(str(tmp_path)), "step-00000001") is False
        assert write_latest(locate(str(tmp_path)), "step-00000002") is False
    (warning,) = [m for m in caplog.messages if "left as it is" in m]
    assert f"{tmp_path / 'latest'} is a directory" in warning and "step-00000001" in warning
    assert (tmp_path / "latest").is_dir() and not list(tmp_path.glob(".latest.tmp-*"))
    (tmp_path / "latest").rmdir()
    (tmp_path / "latest").symlink_to(tmp_path / "elsewhere")  # a stale link: replaced
    assert write_latest(locate(str(tmp_path)), "step-00000003") is True
    assert read_latest(locate(str(tmp_path))) == "step-00000003"
