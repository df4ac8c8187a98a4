"""ddpckpt.events: one SaveEvent per committed save, with what it cost."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ddpckpt
from ddpckpt.events import SaveEvent, add_listener


@pytest.fixture
def events() -> Iterator[list[SaveEvent]]:
    seen: list[SaveEvent] = []
    remove = add_listener(seen.append)
    yield seen
    remove()


def test_a_synchronous_save_reports_its_step_bytes_and_stall(tmp_path, events) -> None:
    model = nn.Linear(64, 32)
    started = time.monotonic()
    path = ddpckpt.save(tmp_path / "a", model=model, step=7)
    took = time.monotonic() - started
    (event,) = events
    assert event.path == path
    assert event.step == 7
    data = [f for f in (tmp_path / "a").iterdir() if f.name != "manifest.json"]
    assert event.nbytes == sum(f.stat().st_size for f in data)
    assert 0 < event.stall_seconds <= took
    assert event.durable_seconds == event.stall_seconds  # nothing left once it returned
    assert event.verified


def test_an_asynchronous_save_reports_once_durable_with_the_shorter_stall(tmp_path, events) -> None:
    model = nn.Linear(64, 32)
    pending = ddpckpt.save(tmp_path / "a", model=model, step=3, async_save=True)
    pending.wait()
    ddpckpt.release_async_buffers()  # joins the writer thread, which reports
    (event,) = events
    assert event.step == 3
    assert event.stall_seconds <= event.durable_seconds


def test_save_dict_and_a_checkpointer_report_too(tmp_path, events) -> None:
    ddpckpt.save_dict(tmp_path / "d", {"w": torch.ones(4)}, step=1)
    with ddpckpt.Checkpointer(tmp_path / "run", model=nn.Linear(2, 2)) as ckpt:
        ckpt.save(5)
    assert [e.step for e in events] == [1, 5]
    assert events[0].nbytes < events[1].nbytes  # save_dict stores the dict alone, no RNG


def test_a_failed_save_reports_nothing(tmp_path, events) -> None:
    ddpckpt.save(tmp_path / "a", model=nn.Linear(2, 2))
    with pytest.raises(ddpckpt.errors.CheckpointExistsError):
        ddpckpt.save(tmp_path / "a", model=nn.Linear(2, 2))
    assert len(events) == 1


def test_a_failing_listener_is_logged_and_the_save_stands(tmp_path, caplog) -> None:
    def broken(event: SaveEvent) -> None:
        raise RuntimeError("tracker is down")

    remove = add_listener(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="ddpckpt"):
            path = ddpckpt.save(tmp_path / "a", model=nn.Linear(2, 2))
    finally:
        remove()
    remove()  # twice is harmless
    assert "listener failed" in caplog.text and "tracker is down" in caplog.text
    ddpckpt.verify(path)


def test_a_removed_listener_hears_nothing(tmp_path) -> None:
    seen: list[SaveEvent] = []
    add_listener(seen.append)()
    ddpckpt.save(tmp_path / "a", model=nn.Linear(2, 2))
    assert seen == []


def test_a_checkpoint_deleted_right_after_its_commit_still_saves(
    tmp_path, events, monkeypatch
) -> None:
    """Lightning's AsyncCheckpointIO lets ModelCheckpoint delete a top-k checkpoint while
    its write runs: the save committed, so it returns, with nothing left to report (it
    raised CheckpointNotFoundError from the report)."""
    from ddpckpt.storage import storage_for

    commit = storage_for(str(tmp_path)).commit
    original = commit.publish

    def publish_then_delete(store, staging, final, *, overwrite):
        original(store, staging, final, overwrite=overwrite)
        ddpckpt.remove_checkpoint(final)  # another thread's deletion, right after

    monkeypatch.setattr(commit, "publish", publish_then_delete)
    path = ddpckpt.save(tmp_path / "a", model=nn.Linear(4, 2), step=1)
    assert path == str(tmp_path / "a") and events == []
