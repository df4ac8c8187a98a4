"""Tensor data files: standard safetensors, every storable dtype, digests that catch damage."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import safetensors.torch
import torch

import ddpckpt.format.tensorfile as tensorfile
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedValueError
from ddpckpt.format.tensorfile import TensorFile, can_read_into, serialize, write_file

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


# --------------------------------------------------------------------------- the ring
# Tensors on a GPU pass through two pinned buffers (the copy of one piece runs while the
# other is hashed and written). On CPU the same code runs with the ring forced on.


@pytest.fixture
def ring_on_cpu(monkeypatch):
    monkeypatch.setattr(tensorfile, "_RING_FOR_CPU", True)
    monkeypatch.setattr(tensorfile, "_PIECE", 4096)  # many pieces, tensors straddling them
    monkeypatch.setattr(tensorfile, "_rings", [])


def ring_items() -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(6000.0).reshape(100, 60)
    return [
        ("big", torch.randn(5000)),  # five pieces
        ("strided", base[::3, 1::2]),
        ("small", torch.arange(7, dtype=torch.int16)),
        ("empty", torch.empty(0, 3)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("conj", torch.complex(base[:4], base[:4]).conj()),
        ("bits", torch.rand(4099) > 0.5),
    ]


def test_the_ring_writes_the_same_file_as_the_direct_path(tmp_path, ring_on_cpu) -> None:
    items = ring_items()
    ringed_path, ringed, ringed_entries = write(tmp_path, items, "ring.safetensors")
    assert len(tensorfile._rings) == 1  # kept for the next save
    tensorfile._RING_FOR_CPU = False
    direct_path, direct, direct_entries = write(tmp_path, items, "direct.safetensors")
    with open(ringed_path, "rb") as a, open(direct_path, "rb") as b:
        assert a.read() == b.read()
    assert (ringed.size, ringed.digest) == (direct.size, direct.digest)
    assert ringed_entries == {
        k: replace(e, file="ring.safetensors") for k, e in direct_entries.items()
    }


def test_a_ring_save_failing_midway_leaves_the_ring_reusable(
    tmp_path, ring_on_cpu, monkeypatch
) -> None:
    items = ring_items()
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) == 4:  # inside the big tensor: a copy of the next piece is in flight
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        write(tmp_path, items, "failed.safetensors")
    monkeypatch.setattr(os, "write", real_write)
    (ring,) = tensorfile._rings  # handed back, not lost with the failed save
    pointers = [b.data_ptr() for b in ring.buffers]
    path, entry, entries = write(tmp_path, items, "again.safetensors")
    assert [b.data_ptr() for b in tensorfile._rings[0].buffers] == pointers
    mapped = TensorFile(path, entry.size)
    for key, tensor in items:
        assert torch.equal(mapped.view(entries[key]), tensor.resolve_conj()), key


def test_a_failed_save_through_the_ring_commits_nothing(tmp_path, ring_on_cpu, monkeypatch) -> None:
    import ddpckpt
    from conftest import make_mlp

    monkeypatch.setattr(tensorfile, "_PIECE", 64)
    model = make_mlp()
    real_write, calls = os.write, []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(ddpckpt.CheckpointWriteError):
        ddpckpt.save(tmp_path / "ckpt", model=model)
    monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(tmp_path) == []  # no checkpoint, no temporary directory
    ddpckpt.save(tmp_path / "ckpt", model=model)
    state = ddpckpt.load_state_dict(tmp_path / "ckpt")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_written_through_pinned_buffers(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tensorfile, "_PIECE", 1 << 20)
    monkeypatch.setattr(tensorfile, "_rings", [])
    on_gpu = [(k, v.cuda()) for k, v in ring_items() if v.dtype != torch.complex64]
    on_gpu.append(("mixed_cpu", torch.arange(10)))
    x = on_gpu[0][1]
    torch.cuda._sleep(100_000_000)  # the values are produced by queued work
    x.mul_(2)
    path, entry, entries = write(tmp_path, on_gpu)
    assert tensorfile._rings[0].buffers[0].is_pinned()
    mapped = TensorFile(path, entry.size)
    for key, tensor in on_gpu:
        assert torch.equal(mapped.view(entries[key]), tensor.cpu()), key


def test_read_into_through_the_ring_verifies_on_the_way(tmp_path, ring_on_cpu) -> None:
    items = ring_items()
    tensorfile._RING_FOR_CPU = False
    path, entry, entries = write(tmp_path, items)
    tensorfile._RING_FOR_CPU = True
    mapped = TensorFile(path, entry.size)
    big = torch.empty(5000)
    assert mapped.read_into(entries["big"], big) is big and torch.equal(big, items[0][1])
    with open(path, "r+b") as f:  # flip one bit in the big tensor's fourth piece
        f.seek(entries["big"].begin + 3 * 4096 + 17)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="big"):
        TensorFile(path, entry.size).read_into(entries["big"], torch.empty(5000))
    (ring,) = tensorfile._rings
    os.truncate(path, entries["big"].begin + 6000)  # the file ends inside the tensor
    with pytest.raises(IncompleteCheckpointError, match="big"):
        mapped.read_into(entries["big"], torch.empty(5000))
    assert tensorfile._rings == [ring]  # handed back after each failure


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_into_a_gpu_tensor(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tensorfile, "_PIECE", 1 << 20)
    monkeypatch.setattr(tensorfile, "_rings", [])
    tensor = torch.randn(3_000_000)
    path, entry, entries = write(tmp_path, [("x", tensor)])
    target = torch.empty(3_000_000, device="cuda")
    assert can_read_into(target, entries["x"])
    got = TensorFile(path, entry.size).read_into(entries["x"], target)
    assert got is target and torch.equal(target.sum(), tensor.cuda().sum())
    assert torch.equal(target.cpu(), tensor)
