"""The pinned ring: tensors on a GPU pass through two pinned buffers, on save and on load."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ddpckpt._format import pinned_ring
from ddpckpt._format.tensorfile import can_read_into
from ddpckpt._format.tensorread import TensorFile
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage._location import locate
from tensor_files import write

# Tensors on a GPU pass through two pinned buffers (the copy of one piece runs while the
# other is hashed and written). On CPU the same code runs with the ring forced on.


@pytest.fixture
def ring_on_cpu(monkeypatch):
    monkeypatch.setattr(pinned_ring, "_RING_FOR_CPU", True)
    monkeypatch.setattr(pinned_ring, "_PIECE", 4096)  # many pieces, tensors straddling them
    monkeypatch.setattr(pinned_ring, "_rings", [])


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
    assert len(pinned_ring._rings) == 1  # kept for the next save
    pinned_ring._RING_FOR_CPU = False
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
    (ring,) = pinned_ring._rings  # handed back, not lost with the failed save
    pointers = [b.data_ptr() for b in ring.buffers]
    path, entry, entries = write(tmp_path, items, "again.safetensors")
    assert [b.data_ptr() for b in pinned_ring._rings[0].buffers] == pointers
    mapped = TensorFile(locate(path), entry.size)
    for key, tensor in items:
        assert torch.equal(mapped.view(entries[key]), tensor.resolve_conj()), key


def test_a_failed_save_through_the_ring_commits_nothing(tmp_path, ring_on_cpu, monkeypatch) -> None:
    import ddpckpt
    from conftest import make_mlp

    monkeypatch.setattr(pinned_ring, "_PIECE", 64)
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
    monkeypatch.setattr(pinned_ring, "_PIECE", 1 << 20)
    monkeypatch.setattr(pinned_ring, "_rings", [])
    on_gpu = [(k, v.cuda()) for k, v in ring_items() if v.dtype != torch.complex64]
    on_gpu.append(("mixed_cpu", torch.arange(10)))
    x = on_gpu[0][1]
    torch.cuda._sleep(100_000_000)  # the values are produced by queued work
    x.mul_(2)
    path, entry, entries = write(tmp_path, on_gpu)
    assert pinned_ring._rings[0].buffers[0].is_pinned()
    mapped = TensorFile(locate(path), entry.size)
    for key, tensor in on_gpu:
        assert torch.equal(mapped.view(entries[key]), tensor.cpu()), key


def test_read_into_through_the_ring_verifies_on_the_way(tmp_path, ring_on_cpu) -> None:
    items = ring_items()
    pinned_ring._RING_FOR_CPU = False
    path, entry, entries = write(tmp_path, items)
    pinned_ring._RING_FOR_CPU = True
    mapped = TensorFile(locate(path), entry.size)
    big = torch.empty(5000)
    assert mapped.read_into(entries["big"], big) is big and torch.equal(big, items[0][1])
    with open(path, "r+b") as f:  # flip one bit in the big tensor's fourth piece
        f.seek(entries["big"].begin + 3 * 4096 + 17)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="big"):
        TensorFile(locate(path), entry.size).read_into(entries["big"], torch.empty(5000))
    (ring,) = pinned_ring._rings
    os.truncate(path, entries["big"].begin + 6000)  # the file ends inside the tensor
    with pytest.raises(IncompleteCheckpointError, match="big"):
        mapped.read_into(entries["big"], torch.empty(5000))
    assert pinned_ring._rings == [ring]  # handed back after each failure


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_into_a_gpu_tensor(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pinned_ring, "_PIECE", 1 << 20)
    monkeypatch.setattr(pinned_ring, "_rings", [])
    tensor = torch.randn(3_000_000)
    path, entry, entries = write(tmp_path, [("x", tensor)])
    target = torch.empty(3_000_000, device="cuda")
    assert can_read_into(target, entries["x"])
    got = TensorFile(locate(path), entry.size).read_into(entries["x"], target)
    assert got is target and torch.equal(target.sum(), tensor.cuda().sum())
    assert torch.equal(target.cpu(), tensor)
