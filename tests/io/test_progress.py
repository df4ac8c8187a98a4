"""Progress: every byte saved and loaded is counted; a bar only on a terminal."""

from __future__ import annotations

import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps


@pytest.fixture
def ckpt_dir(ckpt_root) -> str:
    """Where each test saves: on disk, then in memory (``ckpt_root``)."""
    return os.fspath(ckpt_root / "ckpt")


def test_progress_counts_every_byte_saved_and_loaded(ckpt_dir, monkeypatch) -> None:
    import ddpckpt._io.load as loading

    seen: dict[str, list[int]] = {}

    class Recorder:
        def __init__(self, description: str, total: int) -> None:
            self.key = description.split()[0]
            seen[self.key] = [total, 0]

        def update(self, n: int) -> None:
            seen[self.key][1] += n

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    import ddpckpt._io.writing as writing

    monkeypatch.setattr(loading, "Progress", Recorder)
    monkeypatch.setattr(writing, "Progress", Recorder)
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    assert seen["saving"][0] == seen["saving"][1] > 0
    ddpckpt.load(ckpt_dir, model=model, optimizer=opt)
    assert 0 < seen["loading"][1] <= seen["loading"][0]


def test_progress_bar_only_on_a_terminal_and_not_when_disabled(monkeypatch) -> None:
    from ddpckpt._io import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert progress._wanted()
    monkeypatch.setenv("DDPCKPT_PROGRESS", "0")
    assert not progress._wanted()
    monkeypatch.setenv("DDPCKPT_PROGRESS", "1")
    monkeypatch.setenv("RANK", "3")
    assert not progress._wanted()
