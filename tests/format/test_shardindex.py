"""Sharded tensors' index files (format 6): a reader finds every shard's writer by the
save's own rule, reads only the indexes it needs, and refuses an index that is damaged,
forged or lists another cell; the manifest and a rank's index stay the same size from 16
to 4,096 ranks (counted, in one process)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file
from torch import nn

import ddpckpt
import ddpckpt._format.shardindex as shardindex
from ddpckpt._format.filetable import FileTable
from ddpckpt._format.manifest import Manifest
from ddpckpt._format.shardgrid import SHARD_WRITERS, cells_overlapping, region_at
from ddpckpt._format.shardindex import ShardIndex, index_document
from ddpckpt._io.shardwrite import plan_shards, shard_specs
from ddpckpt._state.sharded import MeshLayout
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate
from hostile import edit_manifest, refresh_file
from shard_snapshots import LAYOUTS, snapshot_of

FIXTURE = Path(__file__).parent.parent / "data" / "format-v6-fsdp"


def _index_of(layout: MeshLayout, domain: list[int] | None, rank: int = 0) -> ShardIndex:
    """A reader's index of a save of ``snapshot_of`` on ``layout`` (no files: only the
    writer rule is used)."""
    plan = plan_shards(snapshot_of(layout, rank), [list(layout.ranks)], rank, len(layout.ranks))
    return ShardIndex(
        locate("ckpt"),
        "id",
        shard_specs(plan.specs, "ckpt"),
        dict(plan.meshes),
        FileTable(),
        domain,
    )


@pytest.mark.parametrize(("mesh", "placements", "domains"), LAYOUTS)
def test_a_reader_finds_the_rank_that_wrote_each_shard(mesh, placements, domains) -> None:
    layout = MeshLayout(mesh, tuple(reversed(range(8))), placements)  # ranks out of order
    for domain in domains:
        index = _index_of(layout, domain if len(domains) > 1 else None)
        for rank in domain:
            plan = plan_shards(snapshot_of(layout, rank), domains, rank, 8)
            for name, offsets in plan.pieces.items():
                coordinate = layout.coordinate(rank)
                record = index.records[name]
                key = cells_overlapping(
                    record.shape,
                    record.mesh,
                    record.placements,
                    region_at(record.shape, mesh, placements, coordinate),
                )
                assert region_at(record.shape, mesh, placements, key[0])[0] == offsets
                assert index.writer(name, key[0]) == rank, (name, offsets)


@pytest.mark.parametrize(("mesh", "placements"), [((4096,), ("S0",)), ((512, 8), ("R", "S0"))])
def test_at_4096_ranks_a_rank_reads_one_index_and_the_manifest_does_not_grow(mesh, placements):
    """FSDP2 over 4,096 ranks and HSDP (512 nodes of 8): a rank's own shards were all
    written by one rank, whose index lists as many shards as at 16 ranks; a reader finding
    them evaluates the grid per tensor of the mesh, never per rank; the manifest's records
    of the sharded state are as large as at 16 ranks."""
    small_mesh = (16,) if len(mesh) == 1 else (2, 8)
    shapes = [(8192, 64), (8192,), (40960, 8), (4096, 4096)]
    sizes = {}
    for each in (small_mesh, mesh):
        world = 16 if each == small_mesh else 4096
        layout = MeshLayout(each, range(world), placements)
        rank = world - 1
        plan = plan_shards(snapshot_of(layout, rank, shapes), [list(range(world))], rank, world)
        records = shard_specs(plan.specs, "ckpt")
        manifest = Manifest(shards=records, meshes=dict(plan.meshes))
        sizes[world] = (len(json.dumps([manifest.to_json("ckpt")])), len(plan.pieces))
        index = ShardIndex(
            locate("ckpt"), "id", records, dict(plan.meshes), FileTable(), None, SHARD_WRITERS
        )
        calls = Counter()
        real = shardindex.region_at

        def counted(*args, real=real, calls=calls):
            calls["region_at"] += 1
            return real(*args)

        shardindex.region_at = counted
        try:
            writers = set()
            for name, record in records.items():
                region = layout.region(record.shape, rank)
                for coordinate in cells_overlapping(record.shape, record.mesh,
                                                    record.placements, region):  # fmt: skip
                    writers.add(index.writer(name, coordinate))
        finally:
            shardindex.region_at = real
        if placements[0] == "S0":
            assert writers == {rank}
        else:  # at most SHARD_WRITERS replicas of a shard share its tensors
            assert len(writers) == min(each[0], len(records), SHARD_WRITERS), writers
        assert calls["region_at"] <= 2 * len(records), calls  # per tensor of the mesh, not per rank
    # the shards one rank lists in its index: one per tensor at most (fewer where replicas
    # share them), at any number of ranks
    assert sizes[4096][1] <= len(shapes) * 2 and sizes[16][1] <= len(shapes) * 2
    if placements[0] == "S0":
        assert sizes[4096][1] == sizes[16][1] == len(shapes) * 2
    assert sizes[4096][0] <= sizes[16][0] + 64, sizes  # a few more digits, never a record per rank


def _fixture_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(),
                          nn.Linear(7, 4))  # fmt: skip
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, path)
    return path


def test_a_plain_model_loads_from_every_writer_s_index(ckpt) -> None:
    expected = load_file(str(FIXTURE) + "-expected.safetensors")
    model, opt = _fixture_model()
    ddpckpt.load(ckpt, model=model, optimizer=opt, rng=False)
    assert all(torch.equal(p.detach(), expected[f"model/{n}"]) for n, p in model.named_parameters())
    assert sorted(p.name for p in ckpt.glob("shards-*.json")) == [
        f"shards-{r:05d}.json" for r in range(4)
    ]


def _edit_index(ckpt: Path, rank: int, edit) -> None:
    """Change ``rank``'s index as an attacker would: its digest recomputed in the manifest."""
    name = f"shards-{rank:05d}.json"
    doc = json.loads((ckpt / name).read_text())
    edit(doc)
    (ckpt / name).write_bytes(index_document(doc["id"], doc["rank"], doc["pieces"])
                              if {"id", "rank", "pieces"} <= doc.keys()
                              else json.dumps(doc).encode())  # fmt: skip
    refresh_file(ckpt, name)


def _first_piece(doc: dict) -> dict:
    return next(iter(doc["pieces"].values()))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(id="another"), "not the shard index of rank 1 of this checkpoint"),
        (lambda d: d.update(rank=2), "not the shard index of rank 1"),
        (lambda d: _first_piece(d).update(offsets=[0]), "does not list the shard"),
        (
            lambda d: _first_piece(d).update(file="model-00002.safetensors"),
            "lies outside the files rank 1 wrote",
        ),
        (lambda d: _first_piece(d).update(file="../../etc/passwd"), "lies outside the files"),
        (lambda d: d["pieces"].update({"model/nonexistent": {}}), "no sharded tensor"),
        (lambda d: d["pieces"].clear(), "does not list the shard"),
        (lambda d: _first_piece(d).update(range=[0, 10**30]), "malformed shard index"),
        (lambda d: d.update(pieces=[1, 2]), "not the shard index of rank 1"),
    ],
)
def test_a_forged_index_is_refused_naming_it(ckpt, edit, message) -> None:
    _edit_index(ckpt, 1, edit)
    _refused(ckpt, message)
    with pytest.raises(CorruptCheckpointError, match=r"shards-00001\.json|index"):
        ddpckpt.verify(ckpt)


def test_a_damaged_missing_or_linked_index_is_refused(ckpt) -> None:
    index = ckpt / "shards-00002.json"
    data = bytearray(index.read_bytes())
    data[40] ^= 1
    index.write_bytes(bytes(data))
    _refused(ckpt, r"shards-00002\.json: file checksum mismatch")
    index.unlink()
    _refused(ckpt, r"shards-00002\.json, which the checkpoint lists, is missing")
    with pytest.raises(CorruptCheckpointError) as found:  # the index named, no data file blamed
        ddpckpt.verify(ckpt)
    assert "shards-00002.json" in str(found.value) and "model-0000" not in str(found.value)
    os.symlink("/dev/zero", index)
    _refused(ckpt, r"shards-00002\.json: the shard index is a symbolic link; refused")


def _refused(ckpt: Path, message: str) -> None:
    """A load fails with ``message`` in its checks, before anything is written into the
    objects (it reads the indexes and opens the files of what it will read first)."""
    model, opt = _fixture_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CorruptCheckpointError, match=message):
        ddpckpt.load(ckpt, model=model, optimizer=opt, rng=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_manifest_s_mesh_must_fit_its_tensors(ckpt) -> None:
    def wrong_size(doc):
        doc["shards"]["model/0.weight"]["mesh"] = [2]

    edit_manifest(ckpt, wrong_size)
    with pytest.raises(CorruptCheckpointError, match="names no mesh of 2 ranks"):
        ddpckpt.verify(ckpt)
    edit_manifest(ckpt, lambda d: d["meshes"].update({next(iter(d["meshes"])): [[0, 2**40]]}))
    with pytest.raises(CorruptCheckpointError, match="meshes"):
        ddpckpt.verify(ckpt)
    edit_manifest(ckpt, lambda d: d["meshes"].update({next(iter(d["meshes"])): [[-1, 4]]}))
    with pytest.raises(CorruptCheckpointError, match="meshes"):
        ddpckpt.verify(ckpt)
    for runs in ([[0, 3]], [[0, 2], [0, 2]], [[0, 1], [2, 2]], [[0, 3], [2, 1]]):
        edit_manifest(
            ckpt, lambda d, runs=runs: d["meshes"].update({next(iter(d["meshes"])): runs})
        )
        with pytest.raises(CorruptCheckpointError, match="each of the 4 ranks once"):
            ddpckpt.verify(ckpt)


def test_a_missing_data_file_is_found_before_anything_is_written(ckpt) -> None:
    (ckpt / "model-00002.safetensors").unlink()
    _refused(ckpt, r"model-00002\.safetensors")


def test_a_sharded_record_without_its_shards_or_mesh_is_refused(ckpt) -> None:
    """A record with neither shards (format 5) nor a mesh (format 6) would load nothing into
    the tensor: refused, as an empty list of shards is."""

    def phantom(doc):
        doc["shards"]["model/0.weight"]["ranks"] = ""

    edit_manifest(ckpt, phantom)
    with pytest.raises(CorruptCheckpointError, match="is not the key of a mesh"):
        ddpckpt.verify(ckpt)


def test_an_index_is_verified_by_its_digest_like_any_file() -> None:
    blob = index_document("t", 0, {})
    assert json.loads(blob) == {"format": "ddpckpt-shards", "id": "t", "rank": 0, "pieces": {}}
    assert xxhash.xxh3_64(blob).hexdigest()


def test_at_most_shard_writers_replicas_write_and_a_reader_finds_each_one() -> None:
    """HSDP over 256 nodes of 8 with 400 tensors: every shard is written by one of its first
    SHARD_WRITERS replicas, exactly the one the reader computes, so a rank loading its own
    shards reads at most SHARD_WRITERS indexes (256 before format 7: one per replica)."""
    layout = MeshLayout((256, 8), range(2048), ("R", "S0"))
    shapes = [(64, 16)] * 400
    position = 5  # the ranks holding shard position 5: replica r is rank 8 r + 5
    written = {}
    for replica in range(256):
        rank = 8 * replica + position
        plan = plan_shards(snapshot_of(layout, rank, shapes), [list(range(2048))], rank, 2048)
        for name in plan.pieces:
            written[name] = rank
        if replica == 0:
            records = shard_specs(plan.specs, "ckpt")
            meshes = dict(plan.meshes)
    assert len(written) == len(records)  # each shard once
    assert max(written.values()) < 8 * SHARD_WRITERS  # by the first SHARD_WRITERS replicas
    assert len(set(written.values())) == SHARD_WRITERS
    index = ShardIndex(locate("ckpt"), "id", records, meshes, FileTable(), None, SHARD_WRITERS)
    key = layout.coordinate(position)
    for name, rank in written.items():
        record = records[name]
        cell = cells_overlapping(record.shape, record.mesh, record.placements,
                                 layout.region(record.shape, position))  # fmt: skip
        assert index.writer(name, cell[0]) == rank, name
    assert key == (0, position)
