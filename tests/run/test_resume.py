"""The steps of resume(): the walk over the tiers, load with fallback, set broken
checkpoints aside, point latest."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._format.runfiles import read_latest
from ddpckpt._run.durable import _merged, load_first
from ddpckpt._run.resume import nothing_loads, resume_run, walk
from ddpckpt._run.rundir import point_latest, set_aside
from ddpckpt._run.tier import Loaded, Resuming
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, PartiallyRestoredError
from ddpckpt.storage._location import locate
from hostile import edit_manifest
from io_helpers import assert_state_equal, flip_byte


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


class FakeTier:
    """A tier offering ``steps``; the steps in ``bad`` cannot be restored."""

    def __init__(self, name: str, steps: list[int], bad: set[int] = frozenset()) -> None:
        self.name, self.steps, self.bad = name, steps, bad
        self.handed: list[list[int]] = []  # the runs of steps restore() was given
        self.told: list[tuple[Loaded | None, str | None]] = []

    def offer(self, resuming: Resuming) -> list[int]:
        return list(self.steps)

    def restore(self, steps: list[int], resuming: Resuming, more: bool) -> Loaded | None:
        self.handed.append(list(steps))
        for step in steps:
            if step not in self.bad:
                return step, f"{self.name} {step}"
            resuming.failures.append(f"{self.name}/{step}: bad")
        return None

    def resumed(self, loaded, server, resuming: Resuming) -> None:
        self.told.append((loaded, None if server is None else server.name))


def resuming() -> Resuming:
    return Resuming(load=lambda step: None, choose=sorted, newest=True)


def test_the_walk_restores_the_newest_step_any_tier_offers_the_earlier_tier_on_a_tie() -> None:
    durable, fast = FakeTier("durable", [8, 4]), FakeTier("fast", [9, 8, 7])
    assert walk([durable, fast], [durable.steps, fast.steps], resuming()) == (fast, (9, "fast 9"))
    durable, fast = FakeTier("durable", [8, 4]), FakeTier("fast", [8, 7])
    assert walk([durable, fast], [durable.steps, fast.steps], resuming())[1] == (8, "durable 8")
    assert fast.handed == []


def test_a_step_that_cannot_be_restored_falls_back_across_tiers_newest_first() -> None:
    durable = FakeTier("durable", [8, 6, 4], bad={8})
    fast = FakeTier("fast", [9, 7, 5], bad={9, 7})
    tiers, how = [durable, fast], resuming()
    server, loaded = walk(tiers, [t.steps for t in tiers], how)
    assert (server, loaded) == (durable, (6, "durable 6"))
    # each tier is handed the run of its steps newer than the other's next one, in order
    assert fast.handed == [[9], [7]] and durable.handed == [[8], [6]]
    assert how.failures == ["fast/9: bad", "durable/8: bad", "fast/7: bad"]


def test_resume_tells_every_tier_what_was_restored_and_by_which() -> None:
    durable, fast = FakeTier("durable", [4]), FakeTier("fast", [6])
    info = resume_run([durable, fast], resuming(), "run", read_only=False)
    assert info == "fast 6"
    assert durable.told == fast.told == [((6, "fast 6"), "fast")]


def test_a_fresh_start_is_told_to_every_tier_and_nothing_to_restore_raises(caplog) -> None:
    durable, fast = FakeTier("durable", []), FakeTier("fast", [])
    with caplog.at_level(logging.INFO, logger="ddpckpt"):
        assert resume_run([durable, fast], resuming(), "run", read_only=False) is None
    assert durable.told == fast.told == [(None, None)] and "starting fresh" in caplog.text
    durable, fast = FakeTier("durable", [4], bad={4}), FakeTier("fast", [6], bad={6})
    with pytest.raises(CorruptCheckpointError, match="fast/6: bad"):
        resume_run([durable, fast], resuming(), "run", read_only=False)
    assert durable.told == fast.told == []


def test_a_reader_lists_again_when_every_candidate_failed() -> None:
    reader = FakeTier("durable", [5], bad={5})
    with pytest.raises(CorruptCheckpointError):
        resume_run([reader], resuming(), "run", read_only=True)
    assert reader.handed == [[5], [5], [5]]  # READER_LISTINGS listings
    writer = FakeTier("durable", [5], bad={5})
    with pytest.raises(CorruptCheckpointError):
        resume_run([writer], resuming(), "run", read_only=False)
    assert writer.handed == [[5]]


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
    set_aside(locate(str(run)), {2: "why 2", 5: "why 5"})  # 5 does not exist: skipped
    assert sorted(p.name.split(".corrupt-")[0] for p in run.glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]
    assert not (run / "step-00000002").exists()
    point_latest(locate(str(run)), 1)
    assert read_latest(locate(str(run))) == "step-00000001"
    mtime = (run / "latest").stat().st_mtime_ns
    point_latest(locate(str(run)), 1)  # already so: not rewritten
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


def _run_of_two_steps(run):
    """A run with steps 1 and 2 (model and AdamW); the state saved at step 1, and the
    objects, trained on since."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(run, model=model, optimizer=opt) as ckpt:
        train_steps(model, opt, steps=1)
        ckpt.save(1)
        at_1 = copy.deepcopy((model.state_dict(), opt.state_dict()))
        train_steps(model, opt, steps=1)
        ckpt.save(2)
    train_steps(model, opt, steps=2)  # a process that trained on, then resumes
    return model, opt, at_1


def test_resume_past_a_damaged_optimizer_file_restores_the_previous_step_exactly(
    tmp_path, caplog
) -> None:
    """The model's file of step 2 loads, then its optimizer's file fails its checksum: the
    objects are partly restored from step 2, and the fallback restores every one from
    step 1, bit for bit; saving works again."""
    run = tmp_path / "run"
    model, opt, at_1 = _run_of_two_steps(run)
    flip_byte(str(run / "step-00000002" / "state-00000.safetensors"), -3)
    quiet = caplog.at_level(logging.WARNING, logger="ddpckpt")
    with quiet, Checkpointer(run, model=model, optimizer=opt) as ckpt:
        assert ckpt.resume().step == 1
        assert_state_equal(model.state_dict(), at_1[0])
        assert_state_equal(opt.state_dict(), at_1[1])
        ckpt.save(2)  # the objects are no longer marked
    skipped = [m for m in caplog.messages if m.startswith("cannot resume from")]
    assert len(skipped) == 1 and "step-00000002" in skipped[0]
    assert "checksum mismatch" in skipped[0] and "partly restored" in skipped[0]
    (instead,) = [m for m in caplog.messages if "instead of" in m]
    assert "step-00000001 (step 1)" in instead and "step 2 (" in instead


def test_resume_that_loads_nothing_after_a_partial_load_says_the_objects_are_partly_restored(
    tmp_path,
) -> None:
    run = tmp_path / "run"
    model, opt, _ = _run_of_two_steps(run)
    for step in ("step-00000001", "step-00000002"):
        flip_byte(str(run / step / "state-00000.safetensors"), -3)
    with Checkpointer(run, model=model, optimizer=opt) as ckpt:
        with pytest.raises(PartiallyRestoredError, match="none can be loaded") as raised:
            ckpt.resume()
        assert not isinstance(raised.value, CorruptCheckpointError)  # no "nothing to resume"
        with pytest.raises(PartiallyRestoredError, match="refusing to save"):
            ckpt.save(3)


def test_resume_past_a_checkpoint_whose_metrics_refer_to_a_tensor(tmp_path) -> None:
    """resume() raised (listing the run decoded every checkpoint's metrics) instead of
    falling back; a plain load found it only after writing into the objects."""
    run = tmp_path / "run"
    model, opt, at_1 = _run_of_two_steps(run)
    edit_manifest(
        run / "step-00000002",
        lambda doc: doc["metrics"].update(loss={"$tensor": "model/0.weight"}),
    )
    with Checkpointer(run, model=model, optimizer=opt) as ckpt:
        assert ckpt.resume().step == 1
        assert_state_equal(model.state_dict(), at_1[0])
        assert_state_equal(opt.state_dict(), at_1[1])
        ckpt.save(2)
    assert [p.name.split(".corrupt-")[0] for p in run.glob("step-00000002.corrupt-*")] == [
        "step-00000002"
    ]


def test_resume_with_latest_a_directory_ignores_it_as_ls_does(tmp_path, caplog) -> None:
    """``latest`` a directory: resume() failed ("moving broken checkpoints aside failed at
    .../.latest.tmp-...: Is a directory"); it is reported and left, and the run goes on."""
    run = tmp_path / "run"
    model, opt, _ = _run_of_two_steps(run)
    (run / "latest").unlink()
    (run / "latest").mkdir()
    (run / "latest" / "notes.txt").write_text("someone's")
    (run / "step-00000002" / "manifest.json").write_text("{ not json")  # latest is moved
    quiet = caplog.at_level(logging.WARNING, logger="ddpckpt")
    with quiet, Checkpointer(run, model=model, optimizer=opt) as ckpt:
        assert ckpt.resume().step == 1
        ckpt.save(2)
        ckpt.save(3)
    assert (run / "latest" / "notes.txt").read_text() == "someone's"
    left = [m for m in caplog.messages if "left as it is" in m]  # said once, not at each save
    assert len(left) == 1 and f"{run / 'latest'} is a directory" in left[0]
    assert main_ls(run) == 0  # ddpckpt ls still lists the run


def main_ls(run) -> int:
    from ddpckpt._cli.main import main

    return main(["ls", str(run)])
