"""Local readers: verify and load_state_dict find damage and hand out plain weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt import CorruptCheckpointError, PartiallyRestoredError
from ddpckpt.errors import IncompleteCheckpointError
from ddpckpt.storage import storage_for
from ddpckpt.storage._location import locate
from io_helpers import assert_state_equal, flip_byte


@pytest.fixture
def ckpt_dir(ckpt_root) -> str:
    """Where each test saves: on disk, then in memory (``ckpt_root``)."""
    return os.fspath(ckpt_root / "ckpt")


def test_bit_flip_is_caught_by_load_and_verify(ckpt_dir) -> None:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    state_file = os.path.join(ckpt_dir, "state-00000.safetensors")
    flip_byte(state_file, storage_for(state_file).size(state_file) - 3)
    with pytest.raises(CorruptCheckpointError, match=r"state-00000\.safetensors"):
        ddpckpt.verify(ckpt_dir)
    target = make_mlp()
    with pytest.raises(PartiallyRestoredError) as raised:  # the model was read before it
        ddpckpt.load(ckpt_dir, model=target, optimizer=torch.optim.Adam(target.parameters()))
    assert isinstance(raised.value.__cause__, CorruptCheckpointError)
    assert "state-00000.safetensors: checksum mismatch" in str(raised.value.__cause__)
    ddpckpt.load(ckpt_dir, model=make_mlp())  # the model file itself is intact


def test_truncated_or_missing_files_are_reported(ckpt_dir) -> None:
    ddpckpt.save(ckpt_dir, model=make_mlp())
    model_file = os.path.join(ckpt_dir, "model-00000.safetensors")
    storage = storage_for(model_file)
    storage.replace(model_file, storage.read(model_file)[: storage.size(model_file) // 2])
    with pytest.raises(IncompleteCheckpointError, match=r"model-00000\.safetensors"):
        ddpckpt.load(ckpt_dir, model=make_mlp())
    storage.delete(model_file)
    with pytest.raises(CorruptCheckpointError, match=r"model-00000\.safetensors.*missing"):
        ddpckpt.verify(ckpt_dir)


def test_load_state_dict_gives_plain_cpu_weights(ckpt_dir, process_group) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, model=DDP(model))
    weights = ddpckpt.load_state_dict(ckpt_dir)
    assert all(not k.startswith("module.") for k in weights)
    assert all(v.device.type == "cpu" for v in weights.values())
    inference = make_mlp(seed=9)
    inference.load_state_dict(weights)
    assert_state_equal(inference.state_dict(), model.state_dict())


def test_a_whole_tensor_above_one_chunk_is_read_in_part_and_verified_by_chunk(
    tmp_path, monkeypatch
) -> None:
    """A tensor saved whole (DDP) and loaded into a shard (FSDP2) is read only around the
    shard, each chunk verified: not read and hashed whole on every rank."""
    from ddpckpt._format.manifest import read_manifest
    from ddpckpt._format.tensorfile import CHUNK
    from ddpckpt._format.tensorread import TensorFile
    from ddpckpt._io.reader import FileSource

    rows, width = 4 * CHUNK // (4 * 1024), 1024  # 4 chunks of float32 rows
    big = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    model = torch.nn.Module()
    model.big, model.small = torch.nn.Parameter(big), torch.nn.Parameter(torch.ones(3))
    path = tmp_path / "ckpt"
    ddpckpt.save(path, model=model)
    manifest = read_manifest(locate(str(path)))
    entry = manifest.tensors["model/big"]
    assert len(entry.chunks) == 4 and manifest.tensors["model/small"].chunks == ()

    read: list[int] = []
    real = TensorFile.read_chunks

    def counting(self, entry, first, last, chunk):
        read.append(last - first)
        return real(self, entry, first, last, chunk)

    monkeypatch.setattr(TensorFile, "read_chunks", counting)
    source = FileSource(locate(str(path)), manifest, prefix="model/")
    quarter = rows // 4
    target = torch.empty(quarter, width)
    source.read_region("big", target, ((quarter, 0), (quarter, width)))  # the second quarter
    assert torch.equal(target, big[quarter : 2 * quarter]) and sum(read) == 1
    assert ddpckpt.verify(path) is not None

    flip_byte(str(path / entry.file), entry.begin + 3 * CHUNK + 5)  # in the last chunk only
    source = FileSource(locate(str(path)), manifest, prefix="model/")
    source.read_region("big", target, ((quarter, 0), (quarter, width)))  # still good
    assert torch.equal(target, big[quarter : 2 * quarter])
    with pytest.raises(CorruptCheckpointError, match="chunk 3"):
        source.read_region("big", target, ((3 * quarter, 0), (quarter, width)))
