"""A directory of safetensors weights, read without any pickle: what DCP's
``HuggingFaceStorageWriter`` writes (``dcp.save(state, storage_writer=
HuggingFaceStorageWriter(path))``, torchtitan's export to Hugging Face), or a model's
``save_pretrained``.

Every ``*.safetensors`` file of the directory is read, as DCP's own ``HuggingFaceStorageReader``
reads them: a file's tensor is the whole tensor, or, where the header's ``__metadata__`` holds
``DCP_SHARDING_INFO`` (JSON), a chunk of it at that entry's ``saved_offsets`` (a sharded save:
one file per rank). Chunks are put together into whole tensors: they may not overlap and
must cover the tensor, and no tensor may claim more than twice the bytes its chunks hold.
A sharded save records no tensor's whole shape (DCP's reader takes the chunks' extent, as
here), so the loss of the last rank's file cannot be told from the files: its tensors end
early, and loading them into the model refuses their shape.
``model.safetensors.index.json``, where present, must name only files of the directory that
hold its tensors.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ddpckpt._convert.hf import _SHARD_NAME, _at, _index, _regular, safetensors_file
from ddpckpt.errors import CorruptCheckpointError

INDEX = "model.safetensors.index.json"
SHARDING_INFO = "DCP_SHARDING_INFO"


def is_safetensors_directory(path: str) -> bool:
    """Whether ``path`` is a directory holding ``*.safetensors`` files (checked after the
    formats whose directories hold some too: the Trainer's, Accelerate's)."""
    return os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))


@dataclass
class _Tensor:
    """One tensor's chunks: ``(offsets, chunk)`` each, and the file of each, for messages."""

    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def read_safetensors_directory(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory, whole, in the order the files and their headers list
    them; local."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise CorruptCheckpointError(f"{directory}: holds no .safetensors file")
    found: dict[str, _Tensor] = {}
    for name in names:
        if not _SHARD_NAME.fullmatch(name):
            raise CorruptCheckpointError(
                f"{_at(directory, name[:200])}: not a name of a weights file"
            )
        path = _regular(directory, name)
        tensors, metadata = safetensors_file(path)
        offsets = _offsets(metadata, tensors, path)
        for key, tensor in tensors.items():
            entry = found.setdefault(key, _Tensor())
            entry.chunks.append((offsets.get(key, (0,) * tensor.dim()), tensor))
            entry.files.append(name)
    if INDEX in os.listdir(directory):
        for shard, keys in _index(directory, INDEX).items():
            missing = sorted(k for k in keys if shard not in found.get(k, _Tensor()).files)
            if missing:
                raise CorruptCheckpointError(
                    f"{_at(directory, INDEX)}: names {missing[0][:200]!r} in {shard[:200]}, which "
                    "does not hold it"
                )
    return {key: _whole(key, entry, directory) for key, entry in found.items()}


def _offsets(
    metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor], path: str
) -> dict[str, tuple[int, ...]]:
    """Each tensor's ``saved_offsets`` from the header's ``DCP_SHARDING_INFO``, if any."""
    text = metadata.get(SHARDING_INFO)
    if text is None:
        return {}
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(f"{path}: {SHARDING_INFO} is not JSON") from None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{path}: {SHARDING_INFO} is not a JSON object")
    out = {}
    for key, tensor in tensors.items():
        record = info.get(key)
        offsets = record.get("saved_offsets") if isinstance(record, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == tensor.dim()
            and all(type(o) is int and 0 <= o < 1 << 62 for o in offsets)
        ):
            raise CorruptCheckpointError(
                f"{path}: {SHARDING_INFO} gives {key[:200]!r} no offset per dimension"
            )
        out[key] = tuple(offsets)
    return out


def _whole(key: str, entry: _Tensor, directory: str) -> torch.Tensor:
    """The tensor ``key`` put together from its chunks."""
    (offsets, first), *rest = entry.chunks
    if not rest:
        if any(offsets):
            raise CorruptCheckpointError(
                f"{_at(directory, entry.files[0])}: {key[:200]!r} is a chunk at {list(offsets)} "
                "of a tensor no other file holds the rest of"
            )
        return first
    dtype, dims = first.dtype, first.dim()
    if any(c.dtype != dtype or c.dim() != dims for _, c in rest):
        raise CorruptCheckpointError(
            f"{directory}: the chunks of {key[:200]!r} ({', '.join(entry.files)[:300]}) differ "
            "in dtype or number of dimensions"
        )
    size = tuple(max(o[d] + c.shape[d] for o, c in entry.chunks) for d in range(dims))
    held = sum(c.numel() for _, c in entry.chunks)
    if math.prod(size) > 2 * held + (1 << 20) or any(d >= 1 << 40 for d in size):
        raise CorruptCheckpointError(
            f"{directory}: the chunks of {key[:200]!r} claim a tensor of {list(size)}, "
            f"{held} elements held; refused"
        )
    try:  # dimensions from the files' offsets: an empty chunk far out claims no bytes
        whole = torch.empty(size, dtype=dtype)
        covered = torch.zeros(size, dtype=torch.bool)
    except (RuntimeError, ValueError, OverflowError, MemoryError) as exc:
        raise CorruptCheckpointError(
            f"{directory}: the chunks of {key[:200]!r} claim a tensor of {list(size)} that "
            f"cannot be made ({type(exc).__name__}); refused"
        ) from None
    for (offset, chunk), name in zip(entry.chunks, entry.files, strict=True):
        region = tuple(slice(o, o + s) for o, s in zip(offset, chunk.shape, strict=True))
        if covered[region].any():
            raise CorruptCheckpointError(
                f"{_at(directory, name)}: its chunk of {key[:200]!r} overlaps another file's"
            )
        covered[region] = True
        whole[region] = chunk
    if not bool(covered.all()):
        raise CorruptCheckpointError(
            f"{directory}: the chunks of {key[:200]!r} do not cover it: a file is missing"
        )
    return whole
