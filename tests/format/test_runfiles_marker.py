"""The fast tier's marker and the run directory's identity, parsed at the trust boundary:
any bytes give a typed record or :class:`CorruptCheckpointError`, nothing else."""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpckpt._format.runfiles import (
    FAST_TIER_KIND,
    FAST_TIER_MARKER,
    MAX_IDENTITY_BYTES,
    RUN_DIR_IDENTITY,
    FastTierMarker,
    parse_fast_tier_marker,
    parse_run_identity,
    read_fast_tier_marker,
    read_run_identity,
)
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_markers = st.fixed_dictionaries(
    {},
    optional={
        "format": st.integers(-2, 3) | _json_values,
        "kind": st.just(FAST_TIER_KIND) | _json_values,
        "run": st.text(max_size=60) | _json_values,
    },
).map(lambda doc: json.dumps(doc).encode())


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=300) | _markers | st.text(max_size=80).map(str.encode))
def test_any_bytes_are_a_marker_or_a_corrupt_checkpoint_error(data: bytes) -> None:
    try:
        marker = parse_fast_tier_marker(data, "fast/owner.json")
    except CorruptCheckpointError as exc:
        message = str(exc)
        assert message.startswith("fast/owner.json: "), message
        return
    assert isinstance(marker, FastTierMarker)
    assert isinstance(marker.run, str) and marker.run and "\0" not in marker.run
    assert marker.format in (0, 1)
    assert parse_fast_tier_marker(marker.as_bytes(), "again") == FastTierMarker(marker.run)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=80).map(str.encode))
def test_any_bytes_are_a_run_identity_or_a_corrupt_checkpoint_error(data: bytes) -> None:
    try:
        identity = parse_run_identity(data, "run/fast-tier-owner")
    except CorruptCheckpointError as exc:
        message = str(exc)
        assert message.startswith("run/fast-tier-owner: "), message
        return
    assert isinstance(identity, str) and identity and identity.encode() == data


def test_the_marker_written_is_read_back_and_the_previous_releases_is_format_0() -> None:
    written = FastTierMarker("/runs/exp2#0123456789abcdef0123456789abcdef").as_bytes()
    doc = json.loads(written)
    assert doc == {"format": 1, "kind": FAST_TIER_KIND, "run": doc["run"]}
    assert parse_fast_tier_marker(written, "w") == FastTierMarker(doc["run"], 1)
    old = parse_fast_tier_marker(b"/runs/exp2#0123", "w")
    assert old == FastTierMarker("/runs/exp2#0123", 0) and old.run_directory == "/runs/exp2"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"\xff\xfe", "neither JSON nor the UTF-8 text"),
        (b"", "is empty"),
        (b'{"format": 2, "kind": "ddpckpt-fast-tier", "run": "a#b"}', "reads format 1"),
        (b'{"format": 1, "kind": "other", "run": "a#b"}', "field 'kind'"),
        (b'{"format": 1, "kind": "ddpckpt-fast-tier"}', "field 'run' is missing"),
        (b'{"format": true, "kind": "ddpckpt-fast-tier", "run": "a"}', "field 'format'"),
        (b'{"run": ' + b"[" * 5000, "nests deeper"),
        (b"a#\0b", "NUL"),
    ],
)
def test_a_damaged_marker_is_named_with_its_problem(data: bytes, said: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"fast/owner\.json") as caught:
        parse_fast_tier_marker(data, "fast/owner.json")
    assert said in str(caught.value)


@pytest.mark.parametrize("name", [FAST_TIER_MARKER, RUN_DIR_IDENTITY])
@pytest.mark.parametrize("how", ["fifo", "sparse", "directory", "symlink"])
def test_the_files_are_read_bounded_and_only_when_regular(tmp_path, name, how) -> None:
    """A FIFO is not waited on, an 8 GiB sparse file not read, a link not followed."""
    path = tmp_path / name
    if how == "fifo":
        os.mkfifo(path)
    elif how == "sparse":
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    elif how == "directory":
        path.mkdir()
    else:
        (tmp_path / "target").write_text("a#b")
        path.symlink_to(tmp_path / "target")
    read = read_fast_tier_marker if name == FAST_TIER_MARKER else read_run_identity
    with pytest.raises(CorruptCheckpointError, match=re.escape(name)) as caught:
        read(locate(str(tmp_path)))
    if how == "sparse":
        assert f"more than the {MAX_IDENTITY_BYTES}" in str(caught.value)


def test_missing_files_are_none(tmp_path) -> None:
    assert read_fast_tier_marker(locate(str(tmp_path))) is None
    assert read_run_identity(locate(str(tmp_path))) is None
