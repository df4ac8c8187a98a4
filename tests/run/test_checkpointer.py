"""Checkpointer in one process: schedule, retention, resume with fallback, lock, failures."""

from __future__ import annotations

import copy
import errno
import json
import logging
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._cli.main import main
from ddpckpt.errors import (
    CheckpointLockedError,
    CheckpointStepError,
    InsufficientSpaceError,
    StateMismatchError,
)
from ddpckpt.storage._location import locate
from io_helpers import assert_state_equal


def objects(seed: int = 0):
    model = make_mlp(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def names(run) -> list[str]:
    """What the run directory holds, on disk or in memory."""
    return sorted(p.name for p in run.iterdir())


def steps_on_disk(run) -> list[str]:
    return [n for n in names(run) if n.startswith("step-")]


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_five_line_loop_saves_on_schedule_and_resumes_newest(run_root) -> None:
    run = run_root / "run"
    model, opt = objects()
    with Checkpointer(run, model=model, optimizer=opt, every_steps=3, keep_last=2) as ckpt:
        assert ckpt.resume() is None
        for step in range(1, 11):
            train_steps(model, opt, steps=1)
            if ckpt.should_save(step):
                assert ckpt.save(step, metrics={"step": step}) == os.path.join(
                    run, f"step-{step:08d}"
                )
    assert steps_on_disk(run) == ["step-00000006", "step-00000009"]
    assert (run / "latest").read_text() == "step-00000009\n"
    assert not (run / ".lock").exists()

    fresh, fresh_opt = objects(seed=5)
    with Checkpointer(run, model=fresh, optimizer=fresh_opt, every_steps=3) as ckpt:
        info = ckpt.resume()
        assert info.step == 9 and info.metrics == {"step": 9}
        assert not ckpt.should_save(9) and ckpt.should_save(12)


def test_keep_best_ignores_nan_and_inf_and_never_drops_the_newest(run_root) -> None:
    run = run_root / "run"
    model, opt = objects()
    losses = {1: 0.5, 2: float("nan"), 3: 0.2, 4: float("-inf"), 5: 0.9, 6: 0.8, 7: float("nan")}
    ckpt = Checkpointer(run, model=model, optimizer=opt, keep_last=1, keep_best=2, monitor="loss")
    for step, loss in losses.items():
        ckpt.save(step, metrics={"loss": loss})
    ckpt.close()
    assert steps_on_disk(run) == ["step-00000001", "step-00000003", "step-00000007"]
    ckpt = Checkpointer(run, model=model, keep_last=None, keep_best=1, monitor="acc", mode="max")
    ckpt.resume()
    for step, acc in ((8, 0.7), (9, 0.95), (10, math.inf), (11, 0.1)):
        ckpt.save(step, metrics={"acc": acc})
    assert steps_on_disk(run)[-4:] == [
        "step-00000008",
        "step-00000009",
        "step-00000010",
        "step-00000011",
    ]


def test_retention_and_best_marks_show_in_ls(run_root, capsys) -> None:
    run = run_root / "run"
    model, _ = objects()
    with Checkpointer(run, model=model, keep_last=1, keep_best=1, monitor="loss") as ckpt:
        for step, loss in ((10, 0.3), (20, 0.1), (30, 0.4)):
            ckpt.save(step, metrics={"loss": loss})
    assert main(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "20    " in out and "best #1 by loss" in out
    steps = [line.split()[0] for line in out.splitlines()[2:]]  # not "10" in a time of day
    assert steps == ["20", "30"] and "latest" in out and "verified" in out, out
    flip_last_byte(run / "step-00000030" / "model-00000.safetensors")
    assert main(["ls", str(run)]) == 1
    assert "CORRUPT" in capsys.readouterr().out


@pytest.mark.parametrize("async_save", [False, True])
def test_saving_the_newest_step_again_replaces_it_and_older_steps_are_refused(
    run_root, caplog, async_save
) -> None:
    run = run_root / "run"
    model, opt = objects()
    ckpt = Checkpointer(run, model=model, optimizer=opt, keep_last=None, async_save=async_save)
    ckpt.save(4)
    assert ckpt.save(5, epoch=0) is not None  # the every-N-steps save ...
    train_steps(model, opt, steps=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="ddpckpt"):
        assert ckpt.save(5, epoch=1) == os.path.join(run, "step-00000005")  # ... and epoch end
        ckpt.wait()
    assert "step 5 saved again" in caplog.text
    assert ddpckpt.verify(run / "step-00000005").epoch == 1  # the later state wins
    for key, value in ddpckpt.load_state_dict(run / "step-00000005").items():
        assert torch.equal(value, expected[key]), key
    assert steps_on_disk(run) == ["step-00000004", "step-00000005"]
    assert [n for n in names(run) if ".tmp-" in n] == []
    assert ckpt.last_error is None
    with pytest.raises(CheckpointStepError, match="newest checkpoint is step 5"):
        ckpt.save(4)
    ckpt.close()
    with (
        Checkpointer(run, model=model) as again,
        pytest.raises(CheckpointStepError),  # also after a restart, before resume()
    ):
        again.save(3)


def test_resume_falls_back_past_corrupt_and_incomplete_checkpoints(run_root, caplog) -> None:
    run = run_root / "run"
    model, opt = objects()
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as ckpt:
        for step in (1, 2, 3):
            train_steps(model, opt, steps=1)
            ckpt.save(step)
    flip_last_byte(run / "step-00000003" / "state-00000.safetensors")
    (run / "step-00000002" / "manifest.json").unlink()
    fresh, fresh_opt = objects(seed=9)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ckpt = Checkpointer(run, model=fresh, optimizer=fresh_opt, keep_last=None)
        assert ckpt.resume().step == 1
    assert "step-00000003/state-00000.safetensors: checksum mismatch" in caplog.text
    assert "moved" in caplog.text
    on_disk = names(run)
    assert "step-00000001" in on_disk and any(
        n.startswith("step-00000003.corrupt-") for n in on_disk
    )
    ckpt.save(2)  # the run goes on from step 1
    ckpt.save(3)
    assert (run / "latest").read_text() == "step-00000003\n"


def test_resume_past_damaged_optimizer_state_is_exactly_the_previous_checkpoint(
    ckpt_root,
) -> None:
    """The live optimizer has state (a process that trained on), so the damaged checkpoint's
    moments were read into its tensors until the damage was found: the fallback overwrites
    every one of them."""
    run = ckpt_root / "run"
    model, opt = objects()
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as ckpt:
        for step in (1, 2):
            train_steps(model, opt, steps=1)
            ckpt.save(step)
            if step == 1:
                expected = copy.deepcopy((model.state_dict(), opt.state_dict()))
        flip_last_byte(run / "step-00000002" / "state-00000.safetensors")  # the last tensor read
        train_steps(model, opt, steps=2)
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as ckpt:
        assert ckpt.resume().step == 1
    assert_state_equal(model.state_dict(), expected[0])
    assert_state_equal(opt.state_dict(), expected[1])


def test_nothing_loadable_is_an_error_not_a_fresh_start(run_root) -> None:
    run = run_root / "run"
    model, _ = objects()
    with Checkpointer(run, model=model) as ckpt:
        ckpt.save(1)
    flip_last_byte(run / "step-00000001" / "model-00000.safetensors")
    # found while its tensors were read into the model: partly restored, not a fresh start;
    # closed, or its lock's refresh would go on opening files under later tests
    with (
        Checkpointer(run, model=model) as ckpt,
        pytest.raises(ddpckpt.PartiallyRestoredError, match="none can be loaded"),
    ):
        ckpt.resume()


def test_resume_a_given_step_and_model_only_for_evaluation(run_root) -> None:
    run = run_root / "run"
    model, opt = objects()
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as ckpt:
        for step in (1, 2):
            train_steps(model, opt, steps=1)
            ckpt.save(step)
    evaluation = make_mlp(seed=3)
    with Checkpointer(run, model=evaluation) as ckpt:
        assert ckpt.resume(step=2).step == 2
    assert torch.equal(evaluation[0].weight, model[0].weight)
    with (
        Checkpointer(run, model=evaluation, extra={"sampler": {}}) as ckpt,
        pytest.raises(StateMismatchError, match="sampler"),
    ):
        ckpt.resume()


def test_stale_temporaries_are_cleaned_and_never_loaded(run_root) -> None:
    run = run_root / "run"
    model, _ = objects()
    with Checkpointer(run, model=model) as ckpt:
        ckpt.save(1)
    leftover = run / ".step-00000002.tmp-deadbeef"
    leftover.mkdir()
    (leftover / "model-00000.safetensors").write_bytes(b"partial")
    with Checkpointer(run, model=model) as ckpt:
        assert ckpt.resume().step == 1
    assert not leftover.exists()


def write_lock(run, pid: int, host: str | None = None, job: str | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(
        json.dumps({"host": host or platform.node(), "pid": pid, "job": job, "since": 0})
    )


@pytest.mark.processes
def test_a_live_lock_holder_is_named_and_a_dead_one_is_taken_over(run_root, caplog) -> None:
    run = run_root / "run"
    model, _ = objects()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(run, holder.pid)
        with pytest.raises(CheckpointLockedError, match=f"pid {holder.pid} on {platform.node()}"):
            Checkpointer(run, model=model).resume()
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ckpt = Checkpointer(run, model=model)
        assert ckpt.resume() is None
    assert "taking over a stale lock" in caplog.text and "is gone" in caplog.text
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    ckpt.close()
    write_lock(run, 1, host="another-node", job="job-42")
    with pytest.raises(CheckpointLockedError, match="another-node"):
        Checkpointer(run, model=model).resume()


def test_an_elastic_restart_of_the_same_job_takes_the_lock_over(run_root, monkeypatch) -> None:
    run = run_root / "run"
    write_lock(run, 1, host="node-that-died", job="job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    with Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.resume()


def failing_writes(monkeypatch, errors: list[int]) -> list[int]:
    """Make the next writes fail with the given errnos, then work again."""
    import ddpckpt._io.writing as checkpoint

    real = checkpoint.write_file
    seen: list[int] = []

    def write_file(location, *args, **kwargs):
        if errors:
            seen.append(errors[0])
            raise OSError(errors.pop(0), os.strerror(seen[-1]), location.path)
        return real(location, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_file", write_file)
    return seen


def test_disk_full_warns_and_training_goes_on(run_root, monkeypatch, caplog) -> None:
    run = run_root / "run"
    model, opt = objects()
    ckpt = Checkpointer(run, model=model, optimizer=opt, retries=2, retry_backoff=0.01)
    ckpt.save(1)
    seen = failing_writes(monkeypatch, [errno.ENOSPC])
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ckpt.save(2) is None
    assert seen == [errno.ENOSPC]  # not retried: a full disk stays full
    assert "training goes on" in caplog.text and "No space left" in caplog.text
    assert steps_on_disk(run) == ["step-00000001"] and [n for n in names(run) if ".tmp-" in n] == []
    assert ckpt.last_error.errno == errno.ENOSPC and ckpt.failed_saves == 1
    assert ckpt.save(3) is not None
    assert ckpt.last_error is None and ckpt.failed_saves == 0


def test_every_failed_save_is_an_error_counting_the_failures(run_root, monkeypatch, caplog) -> None:
    run = run_root / "run"
    model, _ = objects()
    ckpt = Checkpointer(run, model=model, retries=0)
    ckpt.save(10)
    failing_writes(monkeypatch, [errno.ENOSPC] * 3)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert [ckpt.save(step) for step in (20, 30, 40)] == [None, None, None]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3  # loud and repeated, not once
    assert "(3 consecutive failed saves)" in errors[-1] and "saving step 40" in errors[-1]
    assert all(os.path.join(run, "step-00000010") in e for e in errors)  # the newest good one
    assert ckpt.failed_saves == 3 and isinstance(ckpt.last_error, ddpckpt.CheckpointWriteError)
    ckpt.close()


def test_a_run_that_never_saved_says_it_has_no_checkpoint(run_root, monkeypatch, caplog) -> None:
    ckpt = Checkpointer(run_root / "run", model=make_mlp(), retries=0)
    failing_writes(monkeypatch, [errno.EIO])
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ckpt.save(1) is None
    assert "no checkpoint to resume from" in caplog.text
    ckpt.close()


def test_transient_errors_are_retried_and_raise_mode_raises(run_root, monkeypatch) -> None:
    model, opt = objects()
    ckpt = Checkpointer(
        run_root / "run",
        model=model,
        optimizer=opt,
        retries=2,
        retry_backoff=0.01,
        on_error="raise",
    )
    seen = failing_writes(monkeypatch, [errno.EIO, errno.ESTALE])
    assert ckpt.save(1) is not None and seen == [errno.EIO, errno.ESTALE]
    failing_writes(monkeypatch, [errno.EIO] * 3)
    with pytest.raises(ddpckpt.CheckpointWriteError) as caught:
        ckpt.save(2)
    assert caught.value.errno == errno.EIO


def test_a_save_that_cannot_fit_fails_before_writing(run_root, monkeypatch) -> None:
    from ddpckpt.storage import storage_for

    monkeypatch.setattr(type(storage_for(run_root)), "free_bytes", lambda self, path: 1000)
    model, _ = objects()
    ckpt = Checkpointer(run_root / "run", model=model, on_error="raise")
    with pytest.raises(InsufficientSpaceError, match=r"only 1,000 bytes \(1\.0 KiB\) are free in "):
        ckpt.save(1)
    assert steps_on_disk(run_root / "run") == []


def test_every_seconds_policy(run_root) -> None:
    from ddpckpt.policies import AnyOf, EverySeconds, EverySteps

    policy = AnyOf(EverySteps(100), EverySeconds(10))
    assert policy.needs_agreement
    assert not policy.should_save(1, now=0.0)
    assert policy.should_save(2, now=10.5)
    policy.saved(2, now=10.5)
    assert not policy.should_save(3, now=15.0) and policy.should_save(100, now=15.0)
    model, _ = objects()
    ckpt = Checkpointer(run_root / "run", model=model, every_seconds=3600)
    assert not ckpt.should_save(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_best": 2}, "monitor"),
        ({"monitor": "loss"}, "keep_best"),
        ({"keep_last": 0}, "keep_last"),
        ({"every_steps": 0}, "every_steps"),
        ({"on_error": "ignore"}, "on_error"),
        ({"keep_best": 1, "monitor": "loss", "mode": "up"}, "mode"),
    ],
)
def test_configuration_is_validated_up_front(run_root, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpointer(run_root / "run", model=make_mlp(), **kwargs)


@pytest.mark.processes
def test_torchruns_default_run_id_does_not_identify_a_job(run_root, monkeypatch) -> None:
    run = run_root / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(run, holder.pid, host="another-node", job="none")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what torchrun sets without --rdzv-id
        with pytest.raises(CheckpointLockedError):
            Checkpointer(run, model=make_mlp()).resume()
    finally:
        holder.kill()
        holder.wait()


def test_a_job_whose_lock_was_taken_over_stops_writing(run_root) -> None:
    run = run_root / "run"
    ckpt = Checkpointer(run, model=make_mlp())
    ckpt.save(1)
    write_lock(run, 1, host="another-node", job="job-9")  # another job took the directory
    with pytest.raises(CheckpointLockedError, match="took this directory's lock over"):
        ckpt.save(2)
    assert json.loads((run / ".lock").read_text())["host"] == "another-node"  # left alone


@pytest.mark.disk_only("sets the lock file's mtime")
def test_the_lock_stays_fresh_while_held(run_root) -> None:
    import time as clock

    run = run_root / "run"
    ckpt = Checkpointer(run, model=make_mlp(), lock_stale_after=1.2)
    ckpt.resume()
    os.utime(run / ".lock", (0, 0))  # as if not refreshed for ages
    clock.sleep(0.6)  # the holder's thread refreshes every 0.3 s
    assert clock.time() - os.stat(run / ".lock").st_mtime < 1.0
    ckpt.close()


def test_after_resuming_an_older_step_saves_must_still_be_newer(run_root) -> None:
    run = run_root / "run"
    with Checkpointer(run, model=make_mlp(), keep_last=None) as ckpt:
        for step in (100, 200, 300):
            ckpt.save(step)
    ckpt = Checkpointer(run, model=make_mlp(), keep_last=None)
    assert ckpt.resume(step=100).step == 100
    with pytest.raises(CheckpointStepError, match="newest checkpoint is step 300"):
        ckpt.save(150)
    ckpt.close()


def test_a_retry_after_a_failure_following_the_commit_finds_it_committed(
    run_root, monkeypatch
) -> None:
    from ddpckpt.storage import storage_for

    strategy = type(storage_for(run_root).commit)
    real = strategy.publish
    failures = [errno.EIO]

    def commit_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        if failures:
            raise OSError(failures.pop(), "Input/output error")

    monkeypatch.setattr(strategy, "publish", commit_then_fail)
    ckpt = Checkpointer(
        run_root / "run", model=make_mlp(), retries=1, retry_backoff=0.01, on_error="raise"
    )
    assert ckpt.save(1) is not None
    assert ddpckpt.verify(run_root / "run" / "step-00000001").step == 1
    assert ckpt.save(2) is not None  # and the run knows step 1 is its newest
    ckpt.close()


def test_a_retention_failure_in_one_process_only_warns(run_root, monkeypatch, caplog) -> None:
    import ddpckpt._run.rundir as rundir

    def refuse(path):
        raise IsADirectoryError(21, "Is a directory", path)

    monkeypatch.setattr(rundir, "remove_checkpoint", refuse)
    ckpt = Checkpointer(run_root / "run", model=make_mlp(), keep_last=1)
    ckpt.save(1)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ckpt.save(2) is not None
    assert "deleting old checkpoints failed" in caplog.text
    ckpt.save(3)  # the run knows step 2 was committed
    ckpt.close()


def directory_state(run) -> dict[str, tuple[int, float] | str]:
    """Every entry of a run directory with its size and mtime, and the small files' text."""
    state: dict[str, tuple[int, float] | str] = {}
    for root, _, files in os.walk(run):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            state[os.path.relpath(path, run)] = (stat.st_size, stat.st_mtime)
    for name in ("latest", "run.json", ".lock"):
        if (run / name).exists():
            state[name] = (run / name).read_text()
    return state


@pytest.mark.disk_only("compares file mtimes")
def test_a_read_only_reader_loads_while_changing_nothing(run_root, caplog) -> None:
    run = run_root / "run"
    model, opt = objects()
    writer = Checkpointer(run, model=model, optimizer=opt, keep_last=2, keep_best=1, monitor="loss")
    for step, loss in ((1, 0.1), (2, 0.4), (3, 0.5)):
        train_steps(model, opt, steps=1)
        writer.save(step, epoch=0, metrics={"loss": loss})
    in_flight = run / ".step-00000004.tmp-0a1b2c"  # the writer's next save, being written
    in_flight.mkdir()
    (in_flight / "model-00000.safetensors").write_bytes(b"half")
    flip_last_byte(run / "step-00000003" / "model-00000.safetensors")
    before = directory_state(run)

    fresh, fresh_opt = objects(seed=4)
    reader = Checkpointer(run, model=fresh, optimizer=fresh_opt, read_only=True)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert reader.resume().step == 2  # step 3 is damaged: the next one, nothing moved
    assert "cannot resume from" in caplog.text and "step-00000003" in caplog.text
    assert reader.resume(step=1).step == 1
    assert reader.resume(best="loss").step == 1
    assert reader.resume(best="loss", mode="max").step == 2  # 3 is the max, but damaged
    assert reader.steps() == [1, 2, 3] and reader.latest_step() == 3
    assert reader.best("loss") == 1 and reader.best("loss", mode="max") == 3
    assert reader.best("accuracy") is None
    assert reader.info(2).metrics == {"loss": 0.4} and reader.info(2).epoch == 0
    with pytest.raises(ddpckpt.CheckpointNotFoundError):
        reader.info(7)
    with pytest.raises(RuntimeError, match=r"read_only=True\) cannot save"):
        reader.save(4)
    reader.close()
    assert directory_state(run) == before  # no lock taken, nothing cleaned, moved or written
    writer.save(4, metrics={"loss": 0.3})  # and the writer goes on undisturbed
    writer.close()


def test_a_reader_that_loses_a_race_with_retention_loads_the_next(run_root, monkeypatch, caplog):
    import ddpckpt._run.checkpointer as checkpointer
    from ddpckpt._run.rundir import remove_checkpoint

    run = run_root / "run"
    model, opt = objects()
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as writer:
        for step in (1, 2):
            writer.save(step)
    real_load = checkpointer.load_from

    def deleted_first(location, *args, **kwargs):  # the writer's retention wins the race
        if location.path.endswith("step-00000002"):
            remove_checkpoint(location)
        return real_load(location, *args, **kwargs)

    monkeypatch.setattr(checkpointer, "load_from", deleted_first)
    reader = Checkpointer(run, model=make_mlp(seed=6), read_only=True)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert reader.resume().step == 1
    assert "may have deleted or replaced it" in caplog.text

    def all_deleted_first(location, *args, **kwargs):  # the writer saved twice meanwhile
        if not (run / "step-00000004").exists():
            ddpckpt.save(run / "step-00000003", model=model, step=3)
            remove_checkpoint(locate(str(run / "step-00000001")))
            ddpckpt.save(run / "step-00000004", model=model, step=4)
            remove_checkpoint(locate(str(run / "step-00000003")))
        return real_load(location, *args, **kwargs)

    monkeypatch.setattr(checkpointer, "load_from", all_deleted_first)
    assert reader.resume().step == 4  # listed again


def test_opening_a_run_to_resume_leaves_run_json_alone(run_root) -> None:
    run = run_root / "run"
    model, _ = objects()
    with Checkpointer(run, model=model, keep_last=1, keep_best=1, monitor="loss") as writer:
        writer.save(1, metrics={"loss": 0.5})
    written = (run / "run.json").read_text()
    assert "KeepBest" in written
    with Checkpointer(run, model=make_mlp(seed=2)) as evaluation:  # default retention
        assert evaluation.resume().step == 1
    assert (run / "run.json").read_text() == written


@pytest.mark.processes
def test_a_live_process_of_the_same_job_on_this_host_keeps_its_lock(run_root, monkeypatch) -> None:
    run = run_root / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(run, holder.pid, job="4242")  # a trainer of this SLURM allocation
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        with pytest.raises(CheckpointLockedError, match="read_only=True"):
            Checkpointer(run, model=make_mlp()).resume()
        assert json.loads((run / ".lock").read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.processes
@pytest.mark.disk_only("the trainer is another process")
def test_an_evaluator_resuming_read_only_never_disturbs_a_live_trainer(run_root) -> None:
    import threading

    from launch import forked_ranks

    run, shared = run_root / "run", run_root / "shared"
    shared.mkdir()
    env = {"SLURM_JOB_ID": "4242"}  # both in the same allocation
    common = ["--ckpt", str(run), "--shared", str(shared)]
    trainer: dict = {}

    def train() -> None:
        args = [*common, "--steps", "8"]
        trainer["launch"] = forked_ranks("trainer", run_root / "t", args=args, env=env, timeout=400)

    thread = threading.Thread(target=train)
    thread.start()
    evaluator = forked_ranks(
        "evaluator", run_root / "e", nproc=1, args=common, env=env, timeout=400
    )
    thread.join()
    trained = trainer["launch"].ok().results
    result = evaluator.ok().result(0)
    assert {r["failed_saves"] for r in trained.values()} == {0}  # every save succeeded
    assert {r["last_error"] for r in trained.values()} == {"None"}
    steps = trained[0]["steps"]
    assert len(result["loaded"]) >= 3 and set(result["loaded"]) <= set(range(1, steps + 1))
    assert result["mismatched"] == []  # each load is exactly the state the trainer saved
    assert result["changes"] == []  # no lock, nothing deleted, moved or written
    assert steps_on_disk(run) == [f"step-{steps - 1:08d}", f"step-{steps:08d}"]


@pytest.mark.disk_only("fails os.write")
def test_a_lock_that_cannot_be_written_is_not_left_behind(run_root, monkeypatch) -> None:
    """A full disk while taking the lock must not leave an empty .lock that blocks the
    next start of the job."""
    import ddpckpt._run.runlock as runlock

    run = run_root / "run"
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    model = make_mlp()
    monkeypatch.setattr(runlock.os, "write", full)
    assert Checkpointer(run, model=model).save(1) is None  # on_error="warn": reported
    monkeypatch.setattr(runlock.os, "write", real_write)
    assert not (run / ".lock").exists()
    with Checkpointer(run, model=model) as ckpt:
        assert ckpt.save(1) is not None


def test_a_fresh_empty_lock_is_explained(run_root) -> None:
    run = run_root / "run"
    run.mkdir()
    (run / ".lock").write_bytes(b"")
    with pytest.raises(
        ddpckpt.errors.CheckpointLockedError, match="is empty: a job is creating it"
    ):
        Checkpointer(run, model=make_mlp()).save(1)
