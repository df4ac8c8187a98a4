"""The manifest: JSON that round-trips, checks itself, and refuses what it cannot read."""

from __future__ import annotations

import json
import os

import pytest

from ddpckpt._format.manifest import FORMAT_VERSION, Manifest, read_manifest
from ddpckpt._format.tensorfile import FileEntry, TensorEntry
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ddpckpt.storage._location import locate


def sample() -> Manifest:
    m = Manifest(id="abc", step=7, epoch=1, metrics={"loss": 0.25}, world_size=2)
    m.files["model-00000.safetensors"] = FileEntry(
        "model-00000.safetensors", 120, "00ff00ff00ff00ff", 0
    )
    m.tensors["model/w"] = TensorEntry(
        "model-00000.safetensors", "w", "F32", (2, 3), 96, 120, "beefbeefbeefbeef"
    )
    m.state = {"model": {"keys": ["w"]}}
    m.ranks = [{}, {}]
    return m


def test_roundtrip() -> None:
    m = sample()
    back = Manifest.from_json(m.to_json("here"), "here")
    assert back == m


def test_any_edit_fails_the_checksum() -> None:
    text = sample().to_json("here").replace('"step": 7', '"step": 8')
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        Manifest.from_json(text, "here")


def test_newer_format_asks_for_an_upgrade() -> None:
    doc = json.loads(sample().to_json("here"))
    doc["format_version"] = FORMAT_VERSION + 1  # its checksum scheme may differ: not "corrupt"
    with pytest.raises(CorruptCheckpointError, match="Upgrade ddpckpt"):
        Manifest.from_json(json.dumps(doc), "x")


def test_reading_missing_incomplete_and_garbage(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        read_manifest(locate(os.fspath(tmp_path / "nope")))
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="an empty directory, not a checkpoint"):
        read_manifest(locate(os.fspath(tmp_path / "half")))
    (tmp_path / "half" / "model-00000.safetensors").write_bytes(b"")  # a save cut short
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        read_manifest(locate(os.fspath(tmp_path / "half")))
    (tmp_path / "half" / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        read_manifest(locate(os.fspath(tmp_path / "half")))
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="ddpckpt import"):
        read_manifest(locate(os.fspath(tmp_path / "file.pt")))


def test_the_writers_a_save_capped_are_format_7_and_round_trip() -> None:
    m = sample()
    assert "shard_writers" not in m.to_json("here")  # not capped: an older format
    m.shard_writers = 64
    back = Manifest.from_json(m.to_json("here"), "here")
    assert back.shard_writers == 64 and back.format_version == 7
    doc = json.loads(m.to_json("here"))
    doc.pop("manifest_xxh3_64")
    doc["shard_writers"] = 0
    from ddpckpt._format.manifest import _with_checksum

    with pytest.raises(CorruptCheckpointError, match="shard_writers"):
        Manifest.from_json(_with_checksum(doc), "here")
