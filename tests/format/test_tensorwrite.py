"""Writing tensor files: digests computed while streaming, files never overwritten."""

from __future__ import annotations

import os

import pytest
import torch

from ddpckpt._format.tensorread import TensorFile
from ddpckpt._format.tensorwrite import serialize, write_file
from ddpckpt.storage._location import locate
from tensor_files import write


def test_digests_match_a_second_read(tmp_path) -> None:
    path, entry, _ = write(tmp_path, [("a", torch.randn(1000)), ("b", torch.randn(7, 9))])
    assert os.path.getsize(path) == entry.size
    assert TensorFile(locate(path), entry.size).digest() == entry.digest
    blob, memory_entry, _ = serialize(
        "t.safetensors", [("a", torch.zeros(2))], writer=0, metadata={}
    )
    assert len(blob) == memory_entry.size


def test_files_are_never_overwritten(tmp_path) -> None:
    path, _, _ = write(tmp_path, [("w", torch.ones(1))])
    with pytest.raises(FileExistsError):
        write_file(locate(path), [("w", torch.ones(1))], writer=0, metadata={})


def test_shards_carry_a_digest_per_chunk(tmp_path, monkeypatch) -> None:
    import xxhash

    import ddpckpt._format.tensorwrite as tensorwrite

    monkeypatch.setattr(tensorwrite, "CHUNK", 64)
    shard, whole = torch.randn(50), torch.randn(3)  # 200 bytes: chunks of 64, 64, 64, 8
    path = tmp_path / "f.safetensors"
    _, entries = write_file(locate(str(path)), [("s", shard), ("w", whole)], writer=0, metadata={},
                            chunked={"s"})  # fmt: skip
    by_key = {e.key: e for e in entries}
    raw = shard.numpy().tobytes()
    assert by_key["s"].chunks == tuple(
        xxhash.xxh3_64(raw[i : i + 64]).hexdigest() for i in range(0, 200, 64)
    )
    assert by_key["w"].chunks == ()
    read = TensorFile(locate(str(path)), path.stat().st_size).read_chunks(by_key["s"], 1, 3, 64)
    assert bytes(read.numpy()) == raw[64:192]
