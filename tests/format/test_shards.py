"""Sharded tensor records: written as read, and refused when they could leave part of a
tensor unwritten or read outside a shard."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddpckpt
from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.shards import ShardedEntry
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate


def _record() -> dict:
    """A [7, 5] float32 tensor in two shards (4 and 3 rows), as FSDP2 on 2 ranks stores it."""
    return {
        "dtype": "F32", "shape": [7, 5], "mesh": [2], "placements": ["S0"], "chunk": 64,
        "pieces": [
            {"offsets": [0, 0], "shape": [4, 5], "file": "model-00000.safetensors",
             "key": "w@0,0", "range": [100, 180], "xxh3_64": "a" * 16, "chunks": ["b" * 16] * 2},
            {"offsets": [4, 0], "shape": [3, 5], "file": "model-00001.safetensors",
             "key": "w@4,0", "range": [100, 160], "xxh3_64": "c" * 16, "chunks": ["d" * 16]},
        ],
    }  # fmt: skip


def test_a_record_reads_back_as_written() -> None:
    record = ShardedEntry.from_json(_record(), "ckpt")
    assert record.to_json() == _record()
    assert record.nbytes == 140
    assert record.describe() == "mesh (2,), placements (S0), 2 shards"


def test_a_grid_of_shards_over_two_dimensions_is_accepted() -> None:
    doc = {"dtype": "BF16", "shape": [4, 6], "mesh": [2, 2], "placements": ["S0", "S1"],
           "chunk": 1 << 20, "pieces": []}  # fmt: skip
    for row in (0, 2):
        for col in (0, 3):
            doc["pieces"].append(
                {
                    "offsets": [row, col],
                    "shape": [2, 3],
                    "file": "f",
                    "key": f"k{row}{col}",
                    "range": [0, 12],
                    "xxh3_64": "0" * 16,
                    "chunks": ["0" * 16],
                }
            )
    assert len(ShardedEntry.from_json(doc, "ckpt").pieces) == 4


def _set(path: list, value):
    def change(doc: dict) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _drop_piece(doc: dict) -> None:
    doc["pieces"].pop()


def _twice(doc: dict) -> None:
    doc["mesh"] = [4]
    doc["pieces"].append(doc["pieces"][1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(["pieces", 1, "offsets"], [3, 0]), "overlap or leave a gap"),
        (_set(["pieces", 1, "offsets"], [5, 0]), "outside the shape"),
        (_drop_piece, "cover 4 of 7"),
        (_twice, "tile"),
        (_set(["pieces", 0, "range"], [100, 170]), "does not hold 80 bytes"),
        (_set(["pieces", 0, "chunks"], ["b" * 16]), "1 chunk digests for 80 bytes"),
        (_set(["placements"], ["S2"]), "do not fit"),
        (_set(["placements"], ["S01"]), "do not fit"),
        (_set(["placements"], ["R", "S0"]), "do not fit"),
        (_set(["mesh"], [0]), "mesh"),
        (_set(["mesh"], [1]), "2 shards on a mesh of 1"),
        (_set(["chunk"], 0), "chunk size"),
        (_set(["chunk"], True), "'chunk'"),
        (_set(["dtype"], "F33"), "unknown tensor dtype"),
        (_set(["shape"], [7, -5]), "shape"),
        (_set(["pieces", 0, "shape"], [0, 5]), "shard shape"),
        (_set(["pieces", 0, "file"], 3), "'file'"),
        (_set(["pieces", 0], []), "not a JSON object"),
    ],
)
def test_malformed_records_are_refused(change, message) -> None:
    doc = copy.deepcopy(_record())
    change(doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        ShardedEntry.from_json(doc, "ckpt")


def test_an_empty_tensor_has_no_shards() -> None:
    doc = {**_record(), "shape": [0, 5]}
    with pytest.raises(CorruptCheckpointError, match="outside"):
        ShardedEntry.from_json(doc, "ckpt")
    assert ShardedEntry.from_json({**doc, "pieces": []}, "ckpt").pieces == ()


@pytest.mark.parametrize(
    "shape",
    [
        [0, 2**63],  # beyond torch's 64-bit sizes
        [0, 2**62],
        [0, 2**61, 2**61],  # each below, together beyond torch's strides
        [2**200, 0],
        [0, 10**4299],  # as long as an integer JSON parses may be
    ],
)
def test_an_empty_tensor_of_huge_dimensions_is_refused_before_torch_sees_it(shape) -> None:
    """An empty tensor has no shards, so nothing else bounds its dims: each and their
    product are checked here, never handed to torch (whose TypeError/RuntimeError would
    escape as a traceback)."""
    doc = {**_record(), "shape": shape, "pieces": []}
    with pytest.raises(CorruptCheckpointError, match=r"shape .*(2\*\*62)"):
        ShardedEntry.from_json(doc, "ckpt")


@pytest.mark.parametrize(
    "change",
    [
        _set(["pieces", 0, "offsets"], [2**64, 0]),
        _set(["pieces", 0, "range"], [2**63, 2**63 + 80]),
        _set(["pieces", 1, "shape"], [2**62, 5]),
    ],
)
def test_offsets_and_ranges_beyond_2_62_are_refused(change) -> None:
    doc = copy.deepcopy(_record())
    change(doc)
    with pytest.raises(CorruptCheckpointError, match=r"2\*\*62"):
        ShardedEntry.from_json(doc, "ckpt")


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _fixture_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of the format-5 fixtures, unsharded, before any step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(),
                          nn.Linear(7, 4))  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("version", [5, 6, 7])
@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_sharded_checkpoints_of_formats_5_to_7_still_load(kind, version) -> None:
    """FSDP2 over 4 ranks and HSDP 2 x 2, one AdamW step, written by ddpckpt on 2026-11-28:
    format 5 with every shard's record in the manifest, format 6 with them in each writer's
    index file, format 7 (the files of format 6's, listed as a job of more than
    ``TABLE_RANKS`` ranks lists them: in file tables of 2 ranks each)."""
    path = os.path.join(FIXTURES, f"format-v{version}-{kind}")
    expected = load_file(os.path.join(FIXTURES, f"format-v{version}-{kind}-expected.safetensors"))
    assert read_manifest(locate(path)).format_version == version
    ddpckpt.verify(path)
    model, opt = _fixture_model()
    info = ddpckpt.load(path, model=model, optimizer=opt, rng=False)
    assert info.step == 1 and info.world_size == 4
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[f"model/{name}"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[param][key], expected[f"optimizer/{name}/{key}"])
    weights = ddpckpt.load_state_dict(path)
    assert all(torch.equal(weights[n], expected[f"model/{n}"]) for n, _ in model.named_parameters())
