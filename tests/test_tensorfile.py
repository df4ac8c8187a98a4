"""Tensor data files: standard safetensors, every storable dtype, digests that catch damage."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedValueError
from ddpckpt.tensorfile import TensorFile, can_read_into, serialize, write_file

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


def write(tmp_path, items, name="t.safetensors"):
    path = os.fspath(tmp_path / name)
    entry, entries = write_file(path, items, writer=0, metadata={"format": "pt"})
    return path, entry, {e.key: e for e in entries}


@pytest.mark.parametrize("dtype", STORABLE, ids=str)
def test_every_storable_dtype_roundtrips_through_safetensors_readers(tmp_path, dtype) -> None:
    tensor = sample(dtype)
    path, entry, entries = write(tmp_path, [("x", tensor)])
    back = TensorFile(path, entry.size).view(entries["x"])
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
    mapped = TensorFile(path, entry.size)
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


def test_digests_match_a_second_read(tmp_path) -> None:
    path, entry, _ = write(tmp_path, [("a", torch.randn(1000)), ("b", torch.randn(7, 9))])
    assert os.path.getsize(path) == entry.size
    assert TensorFile(path, entry.size).digest() == entry.digest
    blob, memory_entry, _ = serialize(
        "t.safetensors", [("a", torch.zeros(2))], writer=0, metadata={}
    )
    assert len(blob) == memory_entry.size


def test_flipped_bit_is_found_and_named(tmp_path) -> None:
    path, entry, entries = write(tmp_path, [("weight", torch.randn(64)), ("other", torch.randn(4))])
    with open(path, "r+b") as f:
        f.seek(entries["weight"].begin + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    mapped = TensorFile(path, entry.size)
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
    mapped = TensorFile(path, entry.size)
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
        TensorFile(path, entry.size)


def test_files_are_never_overwritten(tmp_path) -> None:
    path, _, _ = write(tmp_path, [("w", torch.ones(1))])
    with pytest.raises(FileExistsError):
        write_file(path, [("w", torch.ones(1))], writer=0, metadata={})


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
        write_file(os.fspath(tmp_path / "x"), [("model/bad", tensor)], writer=0, metadata={})
    assert not os.path.exists(tmp_path / "x")
