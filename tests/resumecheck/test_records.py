"""check-resume's records are read through the trust boundary: what the recorder writes reads
back, and a damaged or crafted records file (a FIFO, a link to a device, a huge file,
JSON of the wrong shape) is one CorruptCheckpointError naming the file and the field,
reported by the command as a one-line error with status 2; never a traceback or a hang."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpckpt
from ddpckpt._resumecheck import record
from ddpckpt._resumecheck.records import MAX_RECORDS_BYTES, read_records
from ddpckpt.errors import CorruptCheckpointError

START = {"event": "start", "pid": 7, "world": 1, "restart": 0, "initial": {}, "time": 1.0}
STEP = {"event": "step", "step": 1, "start": None, "end": {"loss": [0.5]}}


def _loop(directory: Path) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ddpckpt.Checkpointer(directory, model=model, optimizer=optimizer, every_steps=2)
    ckpt.resume()
    torch.manual_seed(1)
    for step in range(1, 4):
        loss = model(torch.randn(4, 3)).sum()
        loss.backward()
        optimizer.step()
        ckpt.log_step(loss)
        if ckpt.should_save(step):
            ckpt.save(step)
    ckpt.close()


def test_what_the_recorder_writes_reads_back_across_a_torn_restart(
    tmp_path: Path, under_check: Callable[[Path], record.Recorder]
) -> None:
    """A process killed while writing a record leaves a torn line; the next process of the
    rank starts on a line of its own, and the torn record is dropped."""
    check = tmp_path / "check"
    first = under_check(check)
    _loop(tmp_path / "run")
    first._exited()
    with (check / "records" / "rank0.jsonl").open("a") as f:
        f.write('{"event": "step", "step": 4, "sta')  # killed mid-line
    second = under_check(check)
    _loop(tmp_path / "run")
    second._exited()

    processes = read_records(str(check))[0]
    assert len(processes) == 2
    for events in processes:
        kinds = [e["event"] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "exit"
        assert {"attach", "resume", "seed", "step"} <= set(kinds)
    assert "save" in [e["event"] for e in processes[0]]
    assert [e["step"] for e in processes[0] if e["event"] == "step"] == [1, 2, 3]


def _reference(tmp_path: Path, write: Callable[[Path], None]) -> tuple[Path, Path]:
    """A --reference directory whose rank 0 records ``write`` makes."""
    folder = tmp_path / "ref" / "runs" / "reference" / "records"
    folder.mkdir(parents=True)
    write(folder / "rank0.jsonl")
    return tmp_path / "ref", folder / "rank0.jsonl"


def _lines(*events: object) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text("".join(e if isinstance(e, str) else json.dumps(e) + "\n" for e in events))

    return write


def _sparse(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(MAX_RECORDS_BYTES + 1)


HOSTILE = {
    "fifo": (lambda p: os.mkfifo(p), "a FIFO"),
    "link-to-dev-zero": (lambda p: os.symlink("/dev/zero", p), "a symbolic link"),
    "huge-sparse-file": (_sparse, f"more than the {MAX_RECORDS_BYTES}"),
    "wrong-type": (_lines(START, {**STEP, "step": "1"}), "line 2: malformed check-resume record: field 'step'"),
    "missing-key": (_lines(START, {"event": "save", "step": 1}), "line 2: malformed check-resume record: field 'label' is missing"),
    "not-an-object": (_lines(START, [1, 2]), "line 2: malformed check-resume record: is a list"),
    "unknown-event": (_lines(START, {"event": "party"}), "field 'event' is 'party'"),
    "no-start": (_lines(STEP), "line 1: the file's first check-resume record is no 'start'"),
    "torn-in-the-middle": (_lines(START, '{"event": "st\n', STEP), "line 2: the check-resume record is not valid JSON"),
    "world-zero": (_lines({**START, "world": 0}), "field 'world' is 0"),
    "deep": (_lines(START, "[" * 100_000 + "\n", STEP), "line 2: the check-resume record nests deeper"),
    "bad-utf8": (lambda p: p.write_bytes(json.dumps(START).encode() + b"\n\xff\xfe\n" + json.dumps(STEP).encode()), "line 2: the check-resume record is not valid JSON"),
    "samples-not-batches": (_lines(START, {**STEP, "end": {"loader.samples": [1, 2]}}), "'loader.samples' is no list of batches"),
    "rng-not-a-digest": (_lines({**START, "initial": {"rng.torch": {"a": 1}}}), "'rng.torch' is a JSON object"),
}  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_damaged_records_file_is_one_error_naming_it(tmp_path: Path, case: str) -> None:
    write, said = HOSTILE[case]
    reference, path = _reference(tmp_path, write)
    with pytest.raises(CorruptCheckpointError) as caught:
        read_records(str(reference / "runs" / "reference"))
    assert str(path) in str(caught.value) and said in str(caught.value)
    assert str(caught.value).endswith("(a --reference directory: run the check again without it)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["fifo", "link-to-dev-zero", "huge-sparse-file", "missing-key"])
def test_check_resume_reports_a_damaged_reference_in_one_line_with_status_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpckpt._cli.main import main

    reference, path = _reference(tmp_path, HOSTILE[case][0])
    argv = ["check-resume", "--out", str(tmp_path / "out"), "--reference", str(reference), "--",
            sys.executable, "-c", "pass"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("ddpckpt check-resume: error: ") and str(path) in line


def test_what_the_recorder_writes_fits_what_the_checker_reads() -> None:
    # a long warning (a load_latest failure listing every checkpoint) is cut, never refused
    from ddpckpt._resumecheck.records import check_event, within_limits

    long = "x" * (1 << 17)
    event = within_limits(
        {"event": "warning", "logger": "ddpckpt", "level": "WARNING", "text": long,
         "after_step": 3, "resumed_from": None}
    )  # fmt: skip
    assert len(event["text"]) == 1 << 16 and event["text"].endswith("\u2026")
    assert check_event(event, "rank0.jsonl:2")["text"] == event["text"]
    route = within_limits({"event": "route", "call": "save", "path": long, "to": "t", "how": "h"})
    assert check_event(route, "rank0.jsonl:3")["path"].endswith("\u2026")
    created = within_limits({"event": "created", "paths": [long, "short"]})
    assert check_event(created, "rank0.jsonl:4")["paths"][1] == "short"
