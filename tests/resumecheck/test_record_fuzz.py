"""Fuzzing check-resume's records reader: a mutated or random records file is read as
typed records (every event of a kind the checker knows, with its fields of their types) or
refused with CorruptCheckpointError; nothing else, within a bounded time."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpckpt._resumecheck.records import check_event, read_rank_file
from ddpckpt.errors import CorruptCheckpointError

VALID = [
    {"event": "start", "pid": 7, "world": 2, "restart": 0, "initial": {"rng.torch": "ab"},
     "time": 1.5},
    {"event": "attach", "directory": "/runs/a"},
    {"event": "seed", "generator": "rng.torch", "value": "0", "where": "train.py:3",
     "after_step": None, "resumed_from": None},
    {"event": "step", "step": 1, "start": {"rng.torch": "ab", "lr": [0.1]},
     "end": {"loader.samples": [[0, 1]], "inputs": {"forwards": 1, "digest": "cd"},
             "loss": [0.25]}},
    {"event": "save", "step": 1, "label": 1, "n": 1, "epoch": 0, "epoch_end": False,
     "path": "/runs/a/step-1", "state": {"model.parameters": {"w": "ef"}}},
    {"event": "resume", "step": 1, "label": 1, "epoch": 0, "state": {}},
    {"event": "warning", "logger": "ddpckpt._run", "level": "WARNING", "text": "hm",
     "after_step": 1, "resumed_from": 1},
    {"event": "route", "call": "Checkpointer", "path": "a", "to": "b", "how": "mapped"},
    {"event": "created", "paths": ["/runs/a"]},
    {"event": "exit", "failed": False},
]  # fmt: skip
CONTENT = "".join(json.dumps(e) + "\n" for e in VALID).encode()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _mutate_bytes(data: bytes, draw: st.DrawFn) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip" and out:
            out[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = draw(st.binary(max_size=16))
        elif out:
            del out[at : at + draw(st.integers(1, 64))]
    return bytes(out)


def _mutate_fields(draw: st.DrawFn) -> bytes:
    events = [dict(e) for e in VALID]
    for _ in range(draw(st.integers(1, 4))):
        event = draw(st.sampled_from(events))
        key = draw(st.sampled_from([*event, "event", "extra"]))
        if draw(st.booleans()):
            event.pop(key, None)
        else:
            event[key] = draw(json_values)
    return "".join(json.dumps(e) + "\n" for e in events).encode()


@st.composite
def record_files(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["bytes", "fields", "random"]))
    if how == "bytes":
        return _mutate_bytes(CONTENT, draw)
    if how == "fields":
        return _mutate_fields(draw)
    return draw(st.binary(max_size=512))


@settings(
    max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=record_files())
def test_a_mutated_records_file_is_typed_records_or_one_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(data)
    try:
        records = read_rank_file(str(path))
    except CorruptCheckpointError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert str(path) in message
        return
    for events in records.processes:
        assert events[0]["event"] == "start"
        for event in events:
            assert check_event(event, "again") is event


def test_the_unmutated_file_reads_back_whole(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(CONTENT)
    assert read_rank_file(str(path)).processes == [VALID]
