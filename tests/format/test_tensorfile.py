"""Tensor data files: standard safetensors, every storable dtype, aligned layout, refusals."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from ddpckpt._format.tensorread import TensorFile
from ddpckpt._format.tensorwrite import write_file
from ddpckpt.errors import UnsupportedValueError
from ddpckpt.storage._location import locate
from tensor_files import write

STORABLE = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.uint16,
    torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    raw = torch.randint(0, 120, shape, dtype=torch.int64)
    if dtype == torch.bool:
        return raw % 2 == 1
    if dtype == torch.complex64:
        return torch.complex(raw.float(), -raw.float())
    return raw.to(dtype)


@pytest.mark.parametrize("dtype", STORABLE, ids=str)
def test_every_storable_dtype_roundtrips_through_safetensors_readers(tmp_path, dtype) -> None:
    tensor = sample(dtype)
    path, entry, entries = write(tmp_path, [("x", tensor)])
    back = TensorFile(locate(path), entry.size).view(entries["x"])
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    if dtype not in (torch.uint16, torch.uint32, torch.uint64):  # not all readers map these
        other = safetensors.torch.load_file(path)["x"]
        assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8))


def test_odd_shapes_and_layouts(tmp_path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    items = [
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 7)),
        ("transposed", base.t()),
        ("strided", base[::2, 1::3]),
        ("conj", torch.complex(base, base).conj()),
        ("param", torch.nn.Parameter(torch.ones(2))),
    ]
    path, entry, entries = write(tmp_path, items)
    mapped = TensorFile(locate(path), entry.size)
    for key, tensor in items:
        back = mapped.view(entries[key])
        assert back.shape == tensor.shape and torch.equal(back, tensor.resolve_conj()), key
    assert safetensors.torch.load_file(path)["transposed"].equal(base.t())


def test_header_metadata_and_alignment(tmp_path) -> None:
    path, _, entries = write(
        tmp_path,
        [
            ("byte", torch.ones(3, dtype=torch.uint8)),
            ("double", torch.ones(3, dtype=torch.float64)),
        ],
    )
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert entries["double"].begin % 8 == 0  # widest first: views are aligned


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.zeros(2, dtype=torch.complex128), "dtype torch.complex128"),
        (torch.zeros(2).to_sparse(), "sparse"),
        (torch.empty(2, device="meta"), "meta"),
    ],
    ids=["complex128", "sparse", "meta"],
)
def test_unstorable_tensors_are_refused_naming_the_key(tmp_path, tensor, why) -> None:
    with pytest.raises(UnsupportedValueError, match=f"model/bad.*{why}|{why}.*"):
        write_file(
            locate(os.fspath(tmp_path / "x")), [("model/bad", tensor)], writer=0, metadata={}
        )
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize(
    "shape", [[0, 2**61, 2**61], [2**62, 0], [0, 2**63 - 1]], ids=["product", "one", "largest"]
)
def test_an_empty_tensor_whose_strides_overflow_is_refused_as_damaged(shape) -> None:
    # No bytes, yet torch's strides over such dimensions overflow 64 bits: refused when the
    # header is read, before anything reaches torch.
    import json
    import struct

    from ddpckpt._format.tensorfile import read_header
    from ddpckpt.errors import CorruptCheckpointError

    doc = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    blob = struct.pack("<Q", len(doc)) + doc

    def read(offset: int, length: int) -> bytes:
        return blob[offset : offset + length]

    with pytest.raises(CorruptCheckpointError, match="spans 2\\*\\*62 bytes or more"):
        read_header(read, len(blob), "ckpt/model-00000.safetensors", "model-00000.safetensors")
