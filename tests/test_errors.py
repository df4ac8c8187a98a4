"""Every error ddpckpt raises or documents can be caught by its public name."""

from __future__ import annotations

import re
from pathlib import Path

import ddpckpt
import ddpckpt.errors


def test_every_error_class_and_every_documented_one_is_exported() -> None:
    root = Path(__file__).resolve().parents[1]
    pages = "".join(p.read_text() for p in [root / "README.md", *(root / "docs").rglob("*.md")])
    documented = {
        name for name in re.findall(r"\b([A-Z]\w*Error)\b", pages) if hasattr(ddpckpt.errors, name)
    }
    for name in set(ddpckpt.errors.__all__) | documented:
        assert name in ddpckpt.__all__, f"ddpckpt.{name} is not exported"
        assert getattr(ddpckpt, name) is getattr(ddpckpt.errors, name)
        assert issubclass(getattr(ddpckpt, name), ddpckpt.CheckpointError)


def test_a_partly_restored_load_is_no_corrupt_checkpoint() -> None:
    """``except CorruptCheckpointError: start fresh`` must not catch a load that wrote into
    the objects before it failed; it travels between ranks by name like every other."""
    error = ddpckpt.PartiallyRestoredError
    assert issubclass(error, ddpckpt.CheckpointError) and issubclass(error, RuntimeError)
    assert not issubclass(error, ddpckpt.CorruptCheckpointError)
    assert ddpckpt.errors.error_class("PartiallyRestoredError") is error
