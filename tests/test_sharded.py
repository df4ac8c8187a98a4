"""Sharded state under torchrun (gloo on CPU): ZeRO-1 under DDP and FSDP2 saved on 2 ranks,
killed, resumed bit-identically, loaded on 4 ranks, 3 ranks and in one process; the DTensor
``replicate()``, a 2 x 2 HSDP mesh and ZeRO-1 saved on 4 ranks and loaded on 4, 3 (HSDP into
a 1-D FSDP2 mesh) and 1; the tools on sharded checkpoints; one rank's sharded state on S3;
FSDP2 on 2 ranks under the Checkpointer's guarantees (fallback past a damaged shard,
preemption, S3, BatchNorm statistics).

Five launches in all (see tests/support/sharded_worker.py): one per world size, one more
for the kill, one for the guarantees.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import load_torch_model
from safetensors.torch import load_file
from torch import nn

import ddpckpt
from ddpckpt._cli.export import export
from ddpckpt._cli.main import main
from ddpckpt._cli.tools import diff, summary
from ddpckpt._format.manifest import read_manifest
from ddpckpt._io.reader import all_pieces
from ddpckpt.storage._location import locate
from launch import forked_ranks
from stored import shard_piece

pytestmark = pytest.mark.processes
WORKER = Path(__file__).parent / "support" / "sharded_worker.py"
SAVED_AT = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """ZeRO-1 and FSDP2 checkpoints of 2 ranks (steps 3 and 5), after which rank 1 was killed."""
    root = tmp_path_factory.mktemp("sharded")
    launch = forked_ranks("save_then_die", root / "out", args=["--ckpt", str(root / "ckpt")],
                      worker=WORKER, timeout=180)  # fmt: skip
    assert launch.returncode != 0, "rank 1 should have been SIGKILLed"
    return root / "ckpt", {rank: launch.result(rank) for rank in (0, 1)}


def _step(root: Path, kind: str, step: int = SAVED_AT) -> Path:
    return root / kind / f"step-{step:08d}"


def test_zero_and_fsdp2_resume_bit_identical_after_a_kill(saved, tmp_path) -> None:
    root, _ = saved
    launch = forked_ranks("resume", tmp_path, args=["--ckpt", str(root)], worker=WORKER,
                      timeout=180).ok()  # fmt: skip
    for rank in (0, 1):
        result = launch.result(rank)
        for kind in ("zero", "fsdp"):
            assert result[f"{kind}_resumed_from"] == SAVED_AT
            assert result[f"{kind}_steps_kept"] == [3, SAVED_AT]
            assert result[f"{kind}_identical"], f"rank {rank}: {kind} resume differs"


@pytest.fixture(scope="module")
def four(saved, tmp_path_factory) -> dict[int, dict]:
    """On 4 ranks: replicate(), HSDP (2 x 2) and ZeRO-1 saved beside the 2-rank checkpoints
    and round-tripped; the 2-rank checkpoints loaded."""
    root, _ = saved
    launch = forked_ranks("four_ranks", tmp_path_factory.mktemp("four"), nproc=4,
                      args=["--ckpt", str(root)], worker=WORKER, timeout=180).ok()  # fmt: skip
    return {rank: launch.result(rank) for rank in range(4)}


def _check_loaded(found: dict, step: int, kind: str, rank: int) -> None:
    assert found["step"] == step
    assert found["wrong"] == [], f"rank {rank}: {kind} differs from the saved state"


def test_two_rank_checkpoints_load_on_four_ranks(four) -> None:
    owned = 0
    for rank, result in four.items():
        for kind in ("zero", "fsdp"):
            _check_loaded(result["from_two"][kind], SAVED_AT, kind, rank)
        assert result["from_two"]["zero"]["lr"] == pytest.approx(1e-3 * 0.5**2)
        owned += result["from_two"]["zero"]["owns"]
    assert owned == 4  # each of the 4 parameters' state on exactly one of the 4 ranks


def test_two_and_four_rank_checkpoints_load_on_three_ranks(four, saved, tmp_path) -> None:
    root, _ = saved
    launch = forked_ranks("reshard", tmp_path, nproc=3, args=["--ckpt", str(root)],
                      worker=WORKER, timeout=180).ok()  # fmt: skip
    owned = {"zero": 0, "zero4": 0}
    for rank in range(3):
        result = launch.result(rank)
        for kind in ("zero", "fsdp"):
            _check_loaded(result[kind], SAVED_AT, kind, rank)
        for kind in ("hsdp", "zero4"):  # 4 ranks -> 3; HSDP's 2 x 2 mesh -> FSDP2's 1-D one
            _check_loaded(result[kind], 3, kind, rank)
        assert result["zero"]["lr"] == pytest.approx(1e-3 * 0.5**2)
        for kind in owned:
            owned[kind] += result[kind]["owns"]
    assert owned == {"zero": 4, "zero4": 4}


def test_saving_zero_state_gathers_nothing(saved) -> None:
    _, results = saved
    for result in results.values():
        assert result["zero_shard_bytes"] == pytest.approx(result["zero_state_bytes"] / 2, rel=0.1)
        # A consolidating save would hold the other rank's shard too: 8 MB more.
        assert result["zero_save_extra_rss"] < result["zero_shard_bytes"] / 2, result


def test_an_unsupported_placement_is_refused_and_nothing_stored(saved) -> None:
    _, results = saved
    for result in results.values():
        assert result["refused"].startswith("extra/pending: a DTensor with a Partial placement")
        assert "redistribute" in result["refused"]
        assert set(result["partial_listing"]) <= {".lock"}  # no checkpoint, no temporary


def _plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(),
                         nn.Linear(7, 4))  # fmt: skip


def _check_against(reference: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference["model"][name]), name
    for name, param in model.named_parameters():
        for key, value in opt.state[param].items():
            assert torch.equal(value, reference["optim"][name][key]), f"{name}.{key}"


def test_sharded_checkpoints_load_into_plain_objects_in_one_process(saved) -> None:
    root, _ = saved
    reference = torch.load(root / "reference.pt")
    zero = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(2)))
    fsdp = _plain_model()
    for kind, model, lr in (("zero", zero, 1e-3), ("fsdp", fsdp, 1e-2)):
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        info = ddpckpt.load(_step(root, kind), model=model, optimizer=opt)
        assert info.step == SAVED_AT and info.world_size == 2
        _check_against(reference[kind], model, opt)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5**2)
    weights = ddpckpt.load_state_dict(_step(root, "fsdp"))
    assert all(torch.equal(v, reference["fsdp"]["model"][k]) for k, v in weights.items())


def test_tools_on_sharded_checkpoints(saved, tmp_path, capsys) -> None:
    root, _ = saved
    reference = torch.load(root / "reference.pt")["fsdp"]["model"]
    fsdp, zero = _step(root, "fsdp"), _step(root, "zero")
    assert ddpckpt.verify(fsdp).step == SAVED_AT and ddpckpt.verify(zero).step == SAVED_AT
    info = summary(fsdp)
    assert info["format_version"] == 6
    weight = next(t for t in info["tensors"] if t["name"] == "model/0.weight")
    assert weight["placement"] == {"mesh": [2], "placements": ["S0"]}
    assert [s["shape"] for s in weight["shards"]] == [[17, 16], [16, 16]]
    assert summary(zero)["sections"]["optimizer"] == "AdamW (ZeroRedundancyOptimizer over 2 ranks)"
    assert main(["inspect", "--no-tensors", str(fsdp)]) == 0
    assert "  model: Sequential (FSDP2)\n" in capsys.readouterr().out  # not FSDPSequential
    assert diff(fsdp, fsdp).same
    changed = diff(_step(root, "fsdp", 3), fsdp)
    assert {t.name for t in changed.tensors} >= {
        "model/0.weight",
        "optimizer/state/0.weight/exp_avg",
    }
    out = export(fsdp, tmp_path / "model.safetensors")
    plain = _plain_model()
    plain.load_state_dict(load_file(out))
    assert all(torch.equal(v, reference[k]) for k, v in plain.state_dict().items())
    # A Hugging Face directory, each file holding whole tensors assembled from both ranks' pieces
    assert main(["export", str(fsdp), str(tmp_path / "hf"), "--max-shard-size", "1KB"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4, index  # 0.weight alone (over 1 KB) ...
    plain = _plain_model()
    load_torch_model(plain, tmp_path / "hf", strict=True)
    assert all(torch.equal(v, reference[k]) for k, v in plain.state_dict().items())


def test_a_damaged_shard_is_found_by_verify_and_load(saved, tmp_path) -> None:
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(_step(root, "fsdp"), copy)
    file, begin = shard_piece(copy, "model/2.weight", 1)
    with open(copy / file, "r+b") as f:
        f.seek(begin + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=file):
        ddpckpt.verify(copy)
    # found while the shard was read into the model: partly restored, the damage chained
    with pytest.raises(ddpckpt.PartiallyRestoredError, match=r"chunk 0 of .2\.weight@4,0.") as e:
        ddpckpt.load(copy, model=_plain_model())
    assert isinstance(e.value.__cause__, ddpckpt.CorruptCheckpointError)


def test_replicate_hsdp_and_zero_round_trip_on_four_ranks(four, saved) -> None:
    root, _ = saved
    for rank, result in four.items():
        for kind in ("replicate", "hsdp", "zero4"):
            assert result[f"{kind}_identical"] and result[f"{kind}_wrong"] == [], (rank, kind)
        assert result["hsdp_digest_local"]
    for kind, shown in (("hsdp", "FSDP2"), ("replicate", "replicate()")):
        assert summary(root / kind)["sections"]["model"] == f"Sequential ({shown})"
    manifest = read_manifest(locate(str(root / "hsdp")))
    pieces = all_pieces(locate(str(root / "hsdp")), manifest)
    writers = {p.entry.file for found in pieces.values() for p in found}
    assert len(writers) >= 3, writers  # the replicas of each shard share the writing
    weight = manifest.shards["model/0.weight"]
    assert weight.mesh == (2, 2) and weight.placements == ("R", "S0")
    assert len(pieces["model/0.weight"]) == 2  # each distinct shard once, not once per replica
    assert manifest.format_version == 7 and len(manifest.meshes) == 1
    assert sorted(manifest.files.tables) == ["files-00000.json", "files-00001.json"]
    whole = {entry.file for entry in manifest.tensors.values()}  # the manifest's own records'
    assert set(manifest.files.inline) == whole | set(manifest.files.tables)
    model = _plain_model()
    ddpckpt.load(root / "hsdp", model=model)  # 4 ranks -> 1 process
    reference = torch.load(root / "hsdp-reference.pt")["model"]
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def guarantees(s3_endpoint, tmp_path_factory) -> dict[int, dict]:
    """FSDP2 on 2 ranks under the Checkpointer's guarantees (BatchNorm statistics, fallback,
    preemption, S3): one launch, see ``scenario_guarantees``."""
    import s3server
    from ddpckpt.storage import storage_for

    root = tmp_path_factory.mktemp("guarantees")
    s3_root = f"s3://{s3server.BUCKET}/sharded-{root.name}"
    try:
        launch = forked_ranks("guarantees", root / "out", args=["--ckpt", str(root / "ckpt")],
                          env={"SHARDED_S3_ROOT": s3_root}, worker=WORKER, timeout=180)  # fmt: skip
        launch.ok()
    finally:
        storage_for(s3_root).delete_tree(s3_root)
    return {rank: launch.result(rank) for rank in (0, 1)}


def test_batchnorm_statistics_of_fsdp2_and_replicate_get_their_own_advice(guarantees) -> None:
    for kind, wrapper in (("fsdp", "FSDP2"), ("replicate", "replicate()")):
        (warning,) = [w for w in guarantees[0][f"{kind}_warnings"] if "differ" in w]
        assert "running_mean" in warning and "running_var" in warning, warning
        assert f"{wrapper} does not synchronize buffers" in warning, warning
        assert "SyncBatchNorm" in warning and "DistributedDataParallel" not in warning, warning
        assert guarantees[1][f"{kind}_warnings"] == []  # said once, on rank 0
        for rank in (0, 1):
            assert guarantees[rank][f"{kind}_own_statistics"], (rank, kind)


def test_fsdp2_resume_falls_back_past_a_damaged_shard_and_resumes_exactly(guarantees) -> None:
    damaged = guarantees[0]["damaged"]
    for rank in (0, 1):  # only rank 1 reads the damaged piece: both fall back together
        fallback = guarantees[rank]["fallback"]
        assert fallback["resumed_from"] == 3 and fallback["identical"], (rank, fallback)
        assert fallback["steps"] == [3], fallback  # the damaged one set aside
    (cannot,) = [w for w in guarantees[0]["fallback"]["warnings"] if "cannot resume" in w]
    assert f"step-{SAVED_AT:08d}" in cannot and damaged in cannot, cannot


def test_a_signal_to_one_fsdp2_rank_saves_a_checkpoint_that_resumes_exactly(guarantees) -> None:
    preempted = [guarantees[rank]["preempted"] for rank in (0, 1)]
    assert preempted[0] == preempted[1], preempted  # the same step on both ranks
    assert 4 <= preempted[0]["step"] < SAVED_AT + 3 and preempted[0]["exit_code"] == 138
    for rank in (0, 1):
        resumed = guarantees[rank]["preemption"]
        assert resumed["resumed_from"] == preempted[0]["step"] and resumed["identical"], rank


def test_fsdp2_on_two_ranks_saves_to_and_resumes_from_s3(guarantees) -> None:
    for rank in (0, 1):
        s3 = guarantees[rank]["s3"]
        assert s3["resumed_from"] == SAVED_AT and s3["steps"] == [3, SAVED_AT], s3
        assert s3["identical"], rank


def test_sharded_state_on_s3_in_one_process(process_group, s3_root) -> None:
    """FSDP2 and ZeRO-1 state (one rank) saved to S3 and read back by ranged reads."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def fsdp() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _plain_model()
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters())

    def zero() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = DDP(_plain_model())
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)

    def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        inner = getattr(opt, "optim", opt)
        values = [*model.state_dict().values()]
        values += [v for s in inner.state.values() for v in s.values()]
        return [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]

    for build in (fsdp, zero):
        model, opt = build()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        path = ddpckpt.save(s3_root / build.__name__, model=model, optimizer=opt, step=1)
        assert ddpckpt.verify(path).step == 1
        placed = [t["name"] for t in summary(path)["tensors"] if "placement" in t]
        assert len(placed) == (6 * 3 if build is fsdp else 0), placed  # weights and moments
        fresh, fresh_opt = build()
        ddpckpt.load(path, model=fresh, optimizer=fresh_opt)
        saved, loaded = state(model, opt), state(fresh, fresh_opt)
        assert len(loaded) == len(saved) == 6 + 6 * 3, build.__name__
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)), build.__name__
