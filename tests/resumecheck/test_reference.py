"""A reused uninterrupted run (``--reference``) is one of the same command with the records its
check wrote (ddpckpt._resumecheck.reference); single process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddpckpt._resumecheck.records import read_run
from ddpckpt._resumecheck.reference import SEAL, open_reference, seal
from ddpckpt.errors import CorruptCheckpointError

START = {"event": "start", "pid": 7, "world": 2, "restart": 0, "initial": {}, "time": 1.0}
STEP = {"event": "step", "step": 1, "start": None, "end": {"loss": [0.5]}}
COMMAND = ["torchrun", "--nproc-per-node", "2", "train.py", "--epochs", "2"]


def _reference(top: Path, *, sealed: bool = True) -> Path:
    """An earlier check's --out directory with an uninterrupted run of two ranks."""
    run = top / "runs" / "reference"
    (run / "records").mkdir(parents=True)
    for rank in (0, 1):
        lines = [json.dumps({**START, "pid": 7 + rank}), json.dumps(STEP)]
        (run / "records" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    if sealed:
        seal(str(run), COMMAND, read_run(str(run))[1])
    return run


def test_the_same_command_reuses_the_run_it_sealed(tmp_path: Path) -> None:
    run = _reference(tmp_path / "rc2")
    path, records, notes = open_reference(str(tmp_path / "rc2"), COMMAND)
    assert (path, notes) == (str(run), [])
    assert records == read_run(str(run))[0]


def test_another_command_is_refused_naming_both(tmp_path: Path) -> None:
    """A reference of --epochs 2 reused for --epochs 3 --every 4 made the report blame the
    script: 'the loop does not restart where the checkpoint left off'."""
    _reference(tmp_path / "rc2")
    other = ["torchrun", "--nproc-per-node", "2", "train.py", "--epochs", "3", "--every", "4"]
    with pytest.raises(ValueError) as caught:
        open_reference(str(tmp_path / "rc2"), other)
    said = str(caught.value)
    assert "`torchrun --nproc-per-node 2 train.py --epochs 2`, not of this one, " in said
    assert "`torchrun --nproc-per-node 2 train.py --epochs 3 --every 4`" in said
    assert "run the check without --reference" in said
    with pytest.raises(ValueError, match="--epochs 2`, not of this one"):  # another world
        open_reference(str(tmp_path / "rc2"), [*COMMAND[:2], "1", *COMMAND[3:]])


def test_a_record_changed_since_its_check_is_refused(tmp_path: Path) -> None:
    """One hex digit of a digest changed by hand made the report name a bug the script does
    not have (the model changed between two steps)."""
    run = _reference(tmp_path / "rc2")
    path = run / "records" / "rank1.jsonl"
    path.write_text(path.read_text().replace('"loss": [0.5]', '"loss": [0.6]'))
    with pytest.raises(CorruptCheckpointError) as caught:
        open_reference(str(tmp_path / "rc2"), COMMAND)
    assert str(path) in str(caught.value)
    assert "changed since the check that ran it wrote it" in str(caught.value)
    assert str(caught.value).endswith("run the check again without --reference")


def test_a_record_file_added_or_removed_is_refused(tmp_path: Path) -> None:
    run = _reference(tmp_path / "rc2")
    (run / "records" / "rank1.jsonl").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"holds the records \['rank0.jsonl'\], "):
        open_reference(str(tmp_path / "rc2"), COMMAND)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ([], "is a list, not a JSON object"),
        ({"format": 2, "command": COMMAND, "records": {}}, "'format'"),
        ({"format": 1, "command": [], "records": {}}, "'command' is no launch command"),
        ({"format": 1, "command": [1], "records": {}}, "'command' is no launch command"),
        ({"format": 1, "command": COMMAND, "records": {"../x": "0" * 16}}, "'../x'"),
        ({"format": 1, "command": COMMAND, "records": {"rank0.jsonl": 5}}, "'rank0.jsonl'"),
    ],
)
def test_a_damaged_seal_is_one_error_naming_it(tmp_path: Path, doc: object, said: str) -> None:
    run = _reference(tmp_path / "rc2")
    (run / SEAL).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError) as caught:
        open_reference(str(tmp_path / "rc2"), COMMAND)
    assert str(run / SEAL) in str(caught.value) and said in str(caught.value)
    assert str(caught.value).endswith("run the check again without --reference")


def test_an_earlier_releases_reference_is_checked_against_its_report_or_noted(
    tmp_path: Path,
) -> None:
    top = tmp_path / "rc2"
    run = _reference(top, sealed=False)
    path, _, notes = open_reference(str(top), COMMAND)
    assert path == str(run)
    assert any("the command it ran is not recorded (no report.json)" in n for n in notes)
    assert any("made by an earlier release" in n for n in notes)
    (top / "report.json").write_text(json.dumps({"command": COMMAND, "verdict": "exact"}))
    assert not any("not recorded" in n for n in open_reference(str(top), COMMAND)[2])
    with pytest.raises(ValueError, match="--epochs 2`, not of this one"):
        open_reference(str(top), [*COMMAND[:-1], "3"])


def test_a_directory_without_a_run_is_no_reference(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no uninterrupted run of an earlier"):
        open_reference(str(tmp_path), [sys.executable])
