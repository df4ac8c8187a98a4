"""Helpers of the tensor-file tests: write a safetensors file the way a save does."""

from __future__ import annotations

import os

from ddpckpt._format.tensorwrite import write_file
from ddpckpt.storage._location import locate


def write(tmp_path, items, name="t.safetensors"):
    path = os.fspath(tmp_path / name)
    entry, entries = write_file(locate(path), items, writer=0, metadata={"format": "pt"})
    return path, entry, {e.key: e for e in entries}
