"""Writing tensor files: digests computed while streaming, files never overwritten."""

from __future__ import annotations

import os

import pytest
import torch

from ddpckpt._format.tensorread import TensorFile
from ddpckpt._format.tensorwrite import serialize, write_file
from tensor_files import write


def test_digests_match_a_second_read(tmp_path) -> None:
    path, entry, _ = write(tmp_path, [("a", torch.randn(1000)), ("b", torch.randn(7, 9))])
    assert os.path.getsize(path) == entry.size
    assert TensorFile(path, entry.size).digest() == entry.digest
    blob, memory_entry, _ = serialize(
        "t.safetensors", [("a", torch.zeros(2))], writer=0, metadata={}
    )
    assert len(blob) == memory_entry.size


def test_files_are_never_overwritten(tmp_path) -> None:
    path, _, _ = write(tmp_path, [("w", torch.ones(1))])
    with pytest.raises(FileExistsError):
        write_file(path, [("w", torch.ones(1))], writer=0, metadata={})
