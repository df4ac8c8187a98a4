"""The steps of resume(): load with fallback, set broken checkpoints aside, point latest."""

from __future__ import annotations

import pytest

from conftest import make_mlp
from ddpckpt import Checkpointer
from ddpckpt._format.runfiles import read_latest
from ddpckpt._run.resume import _merged, load_first, nothing_loads, point_latest, set_aside
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError


def loader(broken: dict[int, Exception]):
    """A load that fails for the steps in ``broken``; records the steps it was asked."""
    asked: list[int] = []

    def load(step: int) -> str:
        asked.append(step)
        if step in broken:
            raise broken[step]
        return f"info of {step}"

    return load, asked


def test_the_first_candidate_that_loads_wins_and_the_others_are_reported(caplog) -> None:
    load, asked = loader({9: CorruptCheckpointError("checksum mismatch")})
    failed: list[int] = []
    failures: list[str] = []
    assert load_first([9, 6, 3], load, "run", False, failed, failures) == (6, "info of 6")
    assert asked == [9, 6] and failed == [9]
    assert "checksum mismatch" in failures[0] and "step-00000009" in failures[0]
    assert "trying an older checkpoint" in caplog.text


def test_a_checkpoint_gone_is_a_race_for_a_reader_only() -> None:
    gone = {9: CheckpointNotFoundError("no manifest")}
    load, _ = loader(gone)
    assert load_first([9, 6], load, "run", True, [], []) == (6, "info of 6")
    load, _ = loader(gone)
    with pytest.raises(CheckpointNotFoundError):  # the writer listed it under its own lock
        load_first([9, 6], load, "run", False, [], [])


def test_nothing_loads_names_every_failure() -> None:
    error = nothing_loads("run", ["run/step-00000002: bad", "run/step-00000001: bad"], {})
    assert isinstance(error, CorruptCheckpointError) and "step-00000001: bad" in str(error)
    error = nothing_loads("run", [], {3: "run/step-00000003: no manifest.json"})
    assert "only incomplete checkpoints" in str(error) and "step-00000003: no manifest" in str(
        error
    )


def test_a_step_committed_on_any_rank_counts_as_committed() -> None:
    views = [
        {"4": ("incomplete", {}, "no manifest")},
        {"4": ("committed", {"loss": 1.0}, "")},
        {"4": ("corrupt", {}, "bad JSON")},
    ]
    assert _merged(views) == {"4": ("committed", {"loss": 1.0}, "")}


def test_set_aside_and_point_latest(tmp_path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
    set_aside(str(run), {2: "why 2", 5: "why 5"})  # 5 does not exist: skipped
    assert sorted(p.name.split(".corrupt-")[0] for p in run.glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]
    assert not (run / "step-00000002").exists()
    point_latest(str(run), 1)
    assert read_latest(str(run)) == "step-00000001"
    mtime = (run / "latest").stat().st_mtime_ns
    point_latest(str(run), 1)  # already so: not rewritten
    assert (run / "latest").stat().st_mtime_ns == mtime


def test_a_checkpoint_moved_aside_at_resume_says_what_is_wrong_with_it(tmp_path, caplog) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
    (run / "step-00000002" / "manifest.json").write_text("{ not json")
    with Checkpointer(run, model=make_mlp()) as ckpt:
        assert ckpt.resume().step == 1
    moved = [r.getMessage() for r in caplog.records if "aside" in r.getMessage()]
    assert len(moved) == 1 and "step-00000002" in moved[0]
    assert "manifest is not valid JSON" in moved[0]
