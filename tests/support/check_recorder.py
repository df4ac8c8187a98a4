"""Fixtures of the resume check's tests (a plugin of tests/conftest.py): the checked
process's recorder, started afresh in a test and undone after it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddpckpt import _observe
from ddpckpt._resumecheck import record


@pytest.fixture
def fresh_recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The core's seam looks at the environment once per process: look again in this test,
    and undo the recorder's hooks, its path mapping and its seed watching afterwards."""
    monkeypatch.setattr(_observe, "_looked", False)
    monkeypatch.setattr(_observe, "_installed", None)
    monkeypatch.setattr(record, "_RECORDER", None)
    yield
    if record._RECORDER is not None:
        record._RECORDER.close()


@pytest.fixture
def under_check(
    monkeypatch: pytest.MonkeyPatch, fresh_recorder: None
) -> Callable[[Path], record.Recorder]:
    """``under_check(run_dir)``: this process as a process of a check's run ``run_dir``
    (a second call: the same run's next process, as after a restart)."""

    def start(run_dir: Path) -> record.Recorder:
        if record._RECORDER is not None:
            record._RECORDER.close()
        monkeypatch.setattr(record, "_RECORDER", None)
        monkeypatch.setattr(_observe, "_looked", False)
        monkeypatch.setenv(record.ENV, json.dumps({"dir": str(run_dir), "kill": None}))
        recorder = record.active()
        assert recorder is not None
        return recorder

    return start
