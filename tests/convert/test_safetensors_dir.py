"""Importing a directory of safetensors weights without any pickle: what DCP's
HuggingFaceStorageWriter writes (whole, and sharded one file per rank, as DCP's own
HuggingFaceStorageReader reads it back) and a save_pretrained directory."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

import ddpckpt
from ddpckpt.convert import import_checkpoint
from ddpckpt.errors import CorruptCheckpointError


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_dcps_hugging_face_writer_imports_and_loads_the_same_weights(tmp_path: Path) -> None:
    model = _model(0)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf")))
    done = import_checkpoint(tmp_path / "hf", tmp_path / "imported")
    assert done.left_out == ()
    again = _model(1)
    ddpckpt.load(done.path, model=again)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _sharded(directory: Path, model: torch.nn.Module, world: int) -> None:
    """A sharded save as HuggingFaceStorageWriter(save_distributed=True) writes it: each
    rank's file its row chunk of every tensor, the chunk's offsets in the header's
    DCP_SHARDING_INFO."""
    directory.mkdir()
    for rank in range(world):
        tensors, info = {}, {}
        for key, value in model.state_dict().items():
            rows = -(-value.shape[0] // world)
            chunk = value[rank * rows : (rank + 1) * rows].contiguous()
            tensors[key] = chunk
            info[key] = {"saved_offsets": [rank * rows] + [0] * (value.dim() - 1)}
        save_file(tensors, directory / f"shard-{rank:05d}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0",
                            "format": "pt"})  # fmt: skip


def test_a_sharded_save_is_put_together_as_dcps_own_reader_does(tmp_path: Path) -> None:
    model = _model(0)
    _sharded(tmp_path / "hf", model, world=2)
    theirs = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(theirs, storage_reader=HuggingFaceStorageReader(str(tmp_path / "hf")))
    done = import_checkpoint(tmp_path / "hf", tmp_path / "imported")
    again = _model(1)
    ddpckpt.load(done.path, model=again)
    for key, value in again.state_dict().items():
        assert torch.equal(value, theirs[key]) and torch.equal(value, model.state_dict()[key]), key


def test_a_save_pretrained_directory_imports_its_weights_and_names_the_rest(
    tmp_path: Path,
) -> None:
    model = _model(0)
    (tmp_path / "pretrained").mkdir()
    save_file(model.state_dict(), tmp_path / "pretrained" / "model.safetensors")
    (tmp_path / "pretrained" / "config.json").write_text("{}")
    done = import_checkpoint(tmp_path / "pretrained", tmp_path / "imported")
    assert done.left_out == ("config.json (not read: the import takes the weights)",)


@pytest.mark.parametrize("damage", ["overlap", "missing", "huge", "not-json", "index"])
def test_damaged_or_hostile_shards_are_refused(tmp_path: Path, damage: str) -> None:
    model = _model(0)
    directory = tmp_path / "hf"
    _sharded(directory, model, world=3)
    files = sorted(directory.iterdir())
    if damage == "missing":  # (the last rank's missing cannot be told: the tensor then ends
        files[1].unlink()  # early, and loading it refuses its shape)
    else:  # rank 1's chunk of 2.bias moved onto rank 0's, or far out
        with safe_open(files[1], framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open's)
            metadata = f.metadata()
        info = json.loads(metadata["DCP_SHARDING_INFO"])
        info["2.bias"]["saved_offsets"] = {"overlap": [0], "huge": [2**40]}.get(damage, [1])
        metadata["DCP_SHARDING_INFO"] = "{not json" if damage == "not-json" else json.dumps(info)
        save_file(tensors, files[1], metadata=metadata)
    if damage == "index":
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"0.weight": files[1].name, "ghost.weight": files[1].name}})
        )
    expected = {
        "overlap": "overlaps another file's",
        "missing": "do not cover it",
        "huge": "claim a tensor of",
        "not-json": "DCP_SHARDING_INFO is not JSON",
        "index": "names .ghost.weight. in shard-00001",
    }[damage]
    with pytest.raises(CorruptCheckpointError, match=expected):
        import_checkpoint(directory, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_empty_chunks_far_out_claim_no_tensor(tmp_path: Path) -> None:
    """Two empty chunks hold no bytes, but their offsets made a tensor of about 2**62
    elements in each other dimension (torch's RuntimeError escaped)."""
    directory = tmp_path / "hf"
    directory.mkdir()
    for rank in range(2):
        info = {"w": {"saved_offsets": [0, 2**61 * rank, 2**61]}}
        save_file({"w": torch.zeros(0, 1, 1)}, directory / f"shard-{rank}.safetensors",
                  metadata={"DCP_SHARDING_INFO": json.dumps(info)})  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="claim a tensor of"):
        import_checkpoint(directory, tmp_path / "imported")
