"""The in-library recorder: nothing at all without the checker's variable, digests with it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks
from torch.utils.data import DataLoader, TensorDataset

import ddpckpt
from ddpckpt import _observe
from ddpckpt._resumecheck import record


def _train(directory: Path) -> tuple[nn.Module, DataLoader, ddpckpt.Checkpointer]:
    """A user's loop: a tracked loader, should_save every step, log_step, a save, a resume."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    ckpt = ddpckpt.Checkpointer(
        directory, model=model, optimizer=optimizer, extra={"loader": loader}, every_steps=2
    )
    ckpt.resume()
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.log_step(loss)
        if ckpt.should_save(step):
            ckpt.save(step)
    ckpt.resume()
    ckpt.close()
    return model, loader, ckpt


def test_production_records_nothing_and_registers_no_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_recorder: None
) -> None:
    monkeypatch.delenv(record.ENV, raising=False)
    hooks_before = len(_global_optimizer_post_hooks)
    model, loader, ckpt = _train(tmp_path / "run")

    assert record.active() is None
    assert ckpt.directory == os.fspath(tmp_path / "run")  # not redirected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not any(p.name == "records" or p.suffix == ".jsonl" for p in tmp_path.rglob("*"))
    assert not model._forward_pre_hooks
    assert len(_global_optimizer_post_hooks) == hooks_before
    assert loader._ddpckpt_stream.handed is None  # the loader keeps no indices


def test_with_the_variable_every_step_save_and_resume_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_recorder: None
) -> None:
    check = tmp_path / "check"
    monkeypatch.setenv(record.ENV, json.dumps({"dir": str(check), "kill": None}))
    _, _, ckpt = _train(tmp_path / "run")

    assert ckpt.directory.startswith(str(check / "checkpoints"))  # the user's run untouched
    assert list((tmp_path / "run").iterdir()) == []  # made as without a check; left empty
    events = _events(check, "start", "attach", "resume", "step", "save")
    assert [e["event"] for e in events] == [
        "start", "attach", "resume", "step", "step", "save", "step", "step", "save", "resume",
    ]  # fmt: skip
    step = events[3]
    assert step["step"] == 1
    assert step["end"]["loader.samples"] == [[0, 1, 2, 3]]
    assert step["end"]["loader"] == {"epoch": None, "position": 1, "finished": False}
    assert step["end"]["optimizer"]["entries"] == 6  # a momentum buffer per parameter
    assert set(step["start"]) >= {"rng.torch", "rng.python", "lr", "model.buffers"}
    assert step["end"]["inputs"]["forwards"] == 1
    assert len(step["end"]["loss"]) == 1
    assert events[-1]["step"] == 4
    assert events[-1]["state"] == events[-2]["state"]  # resume() restores what was saved


@pytest.mark.processes
def test_a_command_that_never_creates_a_checkpointer_is_an_error_naming_what_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpckpt._cli import main

    code = main(["check-resume", "--out", str(tmp_path), "--", sys.executable, "-c", "pass"])
    assert code == 2
    error = capsys.readouterr().err
    assert "recorded nothing" in error and "ddpckpt.Checkpointer" in error
    assert "should_save(step)" in error


def _events(check: Path, *kinds: str) -> list[dict]:
    """Rank 0's events (of those ``kinds``: all without any)."""
    events = [json.loads(line) for line in (check / "records" / "rank0.jsonl").open()]
    return [e for e in events if not kinds or e["event"] in kinds]


def test_a_read_only_checkpointer_reads_pretrained_weights_and_the_writable_one_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_recorder: None
) -> None:
    monkeypatch.delenv(record.ENV, raising=False)
    pretrained = nn.Linear(2, 2)
    with ddpckpt.Checkpointer(tmp_path / "pre", model=pretrained) as pre:
        pre.save(7)
    monkeypatch.setattr(_observe, "_looked", False)
    check = tmp_path / "check"
    monkeypatch.setenv(record.ENV, json.dumps({"dir": str(check), "kill": None}))

    model = nn.Linear(2, 2)
    reader = ddpckpt.Checkpointer(tmp_path / "pre", model=model, read_only=True)
    info = reader.resume()  # a fine-tuning script's pretrained weights
    assert reader.directory == os.fspath(tmp_path / "pre")
    assert info is not None and info.step == 7
    assert torch.equal(model.weight, pretrained.weight)
    ckpt = ddpckpt.Checkpointer(tmp_path / "run", model=model, every_steps=2)
    assert ckpt.resume() is None
    for step in (1, 2):
        model(torch.randn(1, 2)).sum().backward()
        if ckpt.should_save(step):
            ckpt.save(step)
    # a reader of the run being trained reads the check's copy of it, not the user's
    reader = ddpckpt.Checkpointer(tmp_path / "run", model=model, read_only=True)
    assert reader.directory == ckpt.directory
    ckpt.close()

    kinds = ("start", "attach", "resume", "step", "save")
    assert [e["event"] for e in _events(check, *kinds)] == [
        "start", "attach", "resume", "step", "step", "save",
    ]  # fmt: skip


def test_the_start_of_a_step_holds_parameters_and_optimizer_state_and_plain_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_recorder: None
) -> None:
    check = tmp_path / "check"
    monkeypatch.setenv(record.ENV, json.dumps({"dir": str(check), "kill": None}))
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = {"counts": {"seen": 3}, "history": [0.5, 0.25], "n": 5, "table": np.arange(4)}
    ckpt = ddpckpt.Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, extra=extra)
    ckpt.resume()
    with torch.no_grad():
        model.weight.mul_(0.5)  # changed between resume() and the first step
    for step in (1, 2):
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        ckpt.extra["counts"]["seen"] += 1
        ckpt.should_save(step)
    ckpt.close()

    resumed, first, second = (e for e in _events(check) if e["event"] in ("resume", "step"))
    restored, started = resumed["state"]["model.parameters"], first["start"]["model.parameters"]
    assert started["weight"] != restored["weight"] and started["bias"] == restored["bias"]
    assert first["start"]["optimizer"] == resumed["state"]["optimizer"]
    assert second["start"]["optimizer"] == first["end"]["optimizer"]  # momentum after step 1
    assert second["start"]["model.parameters"] == first["end"]["model.parameters"]
    for name in ("counts", "history", "n", "table"):
        assert isinstance(first["end"][f"extra.{name}"], str)
    assert first["end"]["extra.counts"] != second["end"]["extra.counts"]
    assert first["end"]["extra.table"] == second["end"]["extra.table"]


def test_a_plain_loop_counts_optimizer_steps_and_resumes_at_a_load_of_its_own_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, under_check
) -> None:
    """The README's first recipe, in one process: ddpckpt.save every 3 steps, then a
    restarted process's latest() + load() continues the step count of that save."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "check"

    def train(start: int, stop: int) -> None:
        for step in range(start, stop):
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 3 == 2:
                ddpckpt.save(f"ckpt/step-{step}", model=model, optimizer=optimizer, step=step)

    under_check(run)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(0, 7)
    under_check(run)  # the restarted process
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    info = ddpckpt.load(ddpckpt.latest("ckpt"), model=model, optimizer=optimizer)
    train(info.step + 1, 8)

    events = _events(run, "start", "step", "save", "resume")
    assert [e["event"] for e in events].count("start") == 2
    assert [(e["step"], e["label"]) for e in events if e["event"] == "save"] == [(3, 2), (6, 5)]
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert (resumed["step"], resumed["label"]) == (6, 5)
    after = events[events.index(resumed) + 1 :]
    assert [e["step"] for e in after] == [7, 8]  # the steps of the script's 6 and 7
    assert after[0]["start"]["model.parameters"] == resumed["state"]["model.parameters"]
    assert list((tmp_path / "ckpt").iterdir()) == []
