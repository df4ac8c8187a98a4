"""A directory of checkpoints saved with ddpckpt.save, read as load_latest reads it."""

from __future__ import annotations

import logging
import os

import ddpckpt
from conftest import make_mlp
from ddpckpt._run.catalog import newest_first
from ddpckpt._run.savesdir import is_run_layout, list_saves
from ddpckpt.storage._location import locate


def test_a_run_layout_is_told_by_the_runs_files_and_spelling_only() -> None:
    assert is_run_layout(["latest"]) and is_run_layout(["step-00000004", "step-5"])
    assert is_run_layout([".step-00000004.previous"])
    assert is_run_layout(["step-00000004.corrupt-0a1b2c"])
    assert not is_run_layout(["step-5", "step-19", "last.ckpt", "checkpoint-64", "runs"])


def test_saves_are_ranked_as_load_latest_ranks_them_and_damage_is_named(tmp_path, caplog) -> None:
    model = make_mlp()
    for name, step in (("step-19", 19), ("step-9", 9), ("step-100", 100), ("no-step", None)):
        ddpckpt.save(tmp_path / name, model=model, step=step)
    (tmp_path / "step-100" / "manifest.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("mine\n")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        listing = list_saves(locate(os.fspath(tmp_path)))
    assert [c.name for c in listing.checkpoints] == ["step-100", "no-step", "step-9", "step-19"]
    assert [c.status for c in listing.checkpoints] == ["corrupt", *["committed"] * 3]
    assert listing.newest_first == [c[-1] for c in newest_first(locate(os.fspath(tmp_path)))]
    assert listing.newest_first == ["step-19", "step-9", "no-step"]
    assert listing.others == ["notes.txt"]
    assert "load_latest(): skipping the damaged checkpoint" in caplog.text
    assert os.path.join(tmp_path, "step-100") in caplog.text
