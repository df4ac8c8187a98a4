"""Reading tensor files: damage found and named, reads straight into live tensors."""

from __future__ import annotations

import os

import pytest
import torch

from ddpckpt._format.tensorfile import can_read_into
from ddpckpt._format.tensorread import TensorFile
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage._location import locate
from tensor_files import write


def test_flipped_bit_is_found_and_named(tmp_path) -> None:
    path, entry, entries = write(tmp_path, [("weight", torch.randn(64)), ("other", torch.randn(4))])
    with open(path, "r+b") as f:
        f.seek(entries["weight"].begin + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    mapped = TensorFile(locate(path), entry.size)
    assert torch.equal(mapped.view(entries["other"]), mapped.view(entries["other"]))
    with pytest.raises(CorruptCheckpointError, match=r"t\.safetensors.*'weight'"):
        mapped.view(entries["weight"])
    with pytest.raises(CorruptCheckpointError, match=r"t\.safetensors.*'weight'"):
        mapped.read_into(entries["weight"], torch.empty(64))
    assert mapped.digest() != entry.digest


def test_read_into_fills_the_destination_itself(tmp_path) -> None:
    big = torch.randn(3 << 20, dtype=torch.bfloat16)  # several read chunks
    small = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    path, entry, entries = write(tmp_path, [("big", big), ("small", small)])
    mapped = TensorFile(locate(path), entry.size)
    for key, original in (("big", big), ("small", small)):
        destination = torch.empty_like(original)
        assert can_read_into(destination, entries[key])
        assert mapped.read_into(entries[key], destination) is destination
        assert torch.equal(destination, original)
    assert not can_read_into(torch.empty(4, 3, dtype=torch.int32).t(), entries["small"])
    assert not can_read_into(torch.empty(3, 4, dtype=torch.int64), entries["small"])
    assert not can_read_into(torch.empty(12, dtype=torch.int32), entries["small"])
    os.unlink(path)  # (retention, or an overwrite) the file that was checked is still read
    destination = torch.empty_like(big)
    assert torch.equal(mapped.read_into(entries["big"], destination), big)


def test_truncated_file_is_reported_before_reading(tmp_path) -> None:
    path, entry, _ = write(tmp_path, [("w", torch.randn(100))])
    os.truncate(path, entry.size - 10)
    with pytest.raises(IncompleteCheckpointError, match="bytes, the manifest records"):
        TensorFile(locate(path), entry.size)
