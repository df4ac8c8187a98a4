"""Every error ddpckpt raises or documents can be caught by its public name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ddpckpt
import ddpckpt.errors

CAUGHT_MOST = {
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "InexactResumeError",
    "PartiallyRestoredError",
}


def test_every_error_class_and_every_documented_one_is_public_in_errors() -> None:
    root = Path(__file__).resolve().parents[1]
    pages = "".join(p.read_text() for p in [root / "README.md", *(root / "docs").rglob("*.md")])
    classes = {
        name
        for name, value in vars(ddpckpt.errors).items()
        if isinstance(value, type) and issubclass(value, ddpckpt.CheckpointError)
    }
    documented = {name for name in re.findall(r"\b([A-Z]\w*Error)\b", pages) if name in classes}
    assert classes == set(ddpckpt.errors.__all__) and documented <= classes
    assert {n for n in ddpckpt.__all__ if n.endswith("Error")} == CAUGHT_MOST
    for name in CAUGHT_MOST:
        assert getattr(ddpckpt, name) is getattr(ddpckpt.errors, name)


@pytest.mark.parametrize("name", sorted(set(ddpckpt.errors.__all__) - CAUGHT_MOST))
def test_the_other_errors_at_the_top_level_still_work_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"use ddpckpt\.errors\.{name} .*2027-06-01"):
        value = getattr(ddpckpt, name)
    assert value is getattr(ddpckpt.errors, name)


def test_a_partly_restored_load_is_no_corrupt_checkpoint() -> None:
    """``except CorruptCheckpointError: start fresh`` must not catch a load that wrote into
    the objects before it failed; it travels between ranks by name like every other."""
    error = ddpckpt.PartiallyRestoredError
    assert issubclass(error, ddpckpt.CheckpointError) and issubclass(error, RuntimeError)
    assert not issubclass(error, ddpckpt.CorruptCheckpointError)
    assert ddpckpt.errors.error_class("PartiallyRestoredError") is error


def test_no_code_or_page_of_the_project_uses_a_deprecated_top_level_error_name() -> None:
    root = Path(__file__).resolve().parents[1]
    old = "|".join(sorted(set(ddpckpt.errors.__all__) - CAUGHT_MOST))
    pattern = re.compile(rf"\bddpckpt\.({old})\b|from ddpckpt import [^\n]*\b({old})\b")
    files = [root / "README.md", *(root / "docs").rglob("*.md")]
    for top in ("src", "examples", "benchmarks", "tests"):
        files += (root / top).rglob("*.py")
    files.remove(root / "docs" / "reference" / "which-call.md")  # it names the old spelling
    assert [f"{f.relative_to(root)}" for f in files if pattern.search(f.read_text())] == []
