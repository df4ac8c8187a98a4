"""What the checked runs leave outside the check's directory is said in the report
(ddpckpt._resumecheck.leftovers); single process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ddpckpt._resumecheck.leftovers import changed_beside, leftover_notes


def _route(path: str, how: str = "mapped") -> dict[str, object]:
    return {"path": path, "to": "/elsewhere", "calls": ["Checkpointer"], "how": how}


def test_a_file_of_the_users_own_replaced_by_a_checked_run_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run left demo-output/final-weights.json; the check's runs of the same script
    wrote it again (not through ddpckpt, so not redirected), and the report said nothing:
    only a directory the check had made was ever looked into."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-output" / "checkpoints").mkdir(parents=True)
    old = tmp_path / "demo-output" / "notes.txt"
    old.write_text("untouched")
    os.utime(old, (1, 1))
    started = time.time()
    (tmp_path / "demo-output" / "final-weights.json").write_text("{}")  # a checked run's
    (tmp_path / "demo-output" / "logs").mkdir()  # not looked into
    (tmp_path / "check" / "runs").mkdir(parents=True)

    notes = leftover_notes(str(tmp_path / "check"), [_route("demo-output/checkpoints")], started)
    (note,) = notes
    assert note.startswith(f"{tmp_path / 'demo-output'}: files there changed while the check ran: ")
    assert "final-weights.json." in note and "notes.txt" not in note
    assert "replacing any copy that was there before the check" in note


def test_only_local_mapped_paths_and_their_directories_are_looked_into(tmp_path: Path) -> None:
    started = time.time()
    for name in ("pretrained", "run", "ckpt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.bin").write_text("new")
    routes = [
        _route(str(tmp_path / "pretrained" / "w.pt"), how="input"),  # read where it is
        _route("s3://bucket/run"),
        _route(str(tmp_path / "ckpt")),
        _route(str(tmp_path / "ckpt" / "step-4")),  # each directory once
    ]
    found = changed_beside(routes, started, skip=[str(tmp_path)])
    assert found == {str(tmp_path / "ckpt"): ["x.bin"]}
    many = tmp_path / "many"
    many.mkdir()
    for i in range(7):
        (many / f"f{i}").write_text("")
    (tmp_path / "check" / "runs").mkdir(parents=True)
    (note,) = leftover_notes(str(tmp_path / "check"), [_route(str(many / "ckpt"))], started)
    assert "f0, f1, f2, f3, f4, ... (7 in all)." in note
