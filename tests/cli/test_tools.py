"""inspect / diff / export as library functions."""

from __future__ import annotations

import os
import shutil

import pytest
import safetensors.torch
import torch

import ddpckpt
from conftest import TiedLM, make_mlp, train_steps
from ddpckpt._cli.export import export
from ddpckpt._cli.tools import diff, summary
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError


def test_summary_describes_sections_and_tensors(ckpt_dir) -> None:
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    train_steps(model, opt)
    ddpckpt.save(
        ckpt_dir, model=model, optimizer=opt, step=12, metrics={"acc": 0.5}, extra={"n": 1}
    )
    info = summary(ckpt_dir)
    assert (info["step"], info["metrics"]) == (12, {"acc": 0.5})
    assert info["sections"]["model"] == "Sequential" and info["sections"]["optimizer"] == "AdamW"
    assert info["sections"]["optimizer_groups"][0]["betas"] == [0.8, 0.9]
    names = [t["name"] for t in info["tensors"]]
    assert names[0] == "model/0.weight" and "optimizer/state/3.bias/exp_avg_sq" in names
    assert info["bytes"] == sum(
        os.path.getsize(os.path.join(ckpt_dir, f))
        for f in os.listdir(ckpt_dir)
        if f.endswith(".safetensors")
    )


def test_diff_reports_values_metadata_and_state(tmp_path) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt)
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=model, optimizer=opt, step=1, rng=False)
    assert diff(a, a).same
    with torch.no_grad():
        model[0].weight[0, 0] += 0.5
    opt.param_groups[0]["lr"] = 0.05
    ddpckpt.save(b, model=model, optimizer=opt, step=2, rng=False)
    report = diff(a, b)
    assert not report.same
    assert ("step", 1, 2) in report.header
    changed = {t.name: t for t in report.tensors}
    assert set(changed) == {"model/0.weight"}
    assert changed["model/0.weight"].mismatched == 1 and changed[
        "model/0.weight"
    ].max_abs == pytest.approx(0.5)
    assert ("state/optimizer/groups/0/hyper/lr", 0.1, 0.05) in report.state


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_plain_weights_for_inference(ckpt_dir, tmp_path, suffix) -> None:
    model = TiedLM()
    ddpckpt.save(ckpt_dir, model=model)
    out = export(ckpt_dir, os.fspath(tmp_path / f"weights{suffix}"))
    if suffix == ".pt":
        weights = torch.load(out, weights_only=True)
        assert weights["head.weight"] is weights["embed.weight"]
    else:
        weights = safetensors.torch.load_file(out)
    fresh = TiedLM()
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    with pytest.raises(FileExistsError):
        export(ckpt_dir, out)
    with pytest.raises(ValueError, match="safetensors or"):
        export(ckpt_dir, os.fspath(tmp_path / "weights.bin"))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_chooses_one_model_of_a_training_state(ckpt_dir, tmp_path, suffix) -> None:
    generator, critic = TiedLM(), make_mlp()
    ddpckpt.save(ckpt_dir, ddpckpt.TrainingState(G=generator, D=critic))
    out = os.fspath(tmp_path / f"g{suffix}")
    with pytest.raises(StateMismatchError, match="--model NAME"):
        export(ckpt_dir, out)
    with pytest.raises(StateMismatchError, match="no model 'E'"):
        export(ckpt_dir, out, model="E")
    export(ckpt_dir, out, model="G")
    if suffix == ".pt":
        weights = torch.load(out, weights_only=True)
    else:
        weights = safetensors.torch.load_file(out)
    fresh = TiedLM()
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.embed.weight, generator.embed.weight)


def test_diff_verifies_both_sides_before_trusting_checksums(tmp_path) -> None:
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=make_mlp(), step=1)
    shutil.copytree(a, b)
    target = os.path.join(b, "model-00000.safetensors")
    with open(target, "r+b") as f:  # one bit of one weight, as a failing disk would
        f.seek(os.path.getsize(target) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError, match=f"{b} is corrupt"):
        diff(a, b)
    trusted = diff(a, b, verify=False)  # documented: the recorded checksums are believed
    assert trusted.same and not trusted.verified


def test_a_quick_diff_still_catches_a_truncated_or_missing_file(tmp_path) -> None:
    """`diff --quick` reads no data, but a file's size costs nothing: a truncated copy used
    to be reported as identical (exit 0) while `ls --quick` called it INCOMPLETE."""
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=make_mlp(), optimizer=torch.optim.SGD(make_mlp().parameters()), step=1)
    shutil.copytree(a, b)
    truncated = os.path.join(b, "model-00000.safetensors")
    os.truncate(truncated, os.path.getsize(truncated) - 8)
    with pytest.raises(CorruptCheckpointError, match=f"{b} is corrupt") as caught:
        diff(a, b, verify=False)
    assert f"{truncated}: file is" in str(caught.value)
    os.remove(truncated)
    with pytest.raises(CorruptCheckpointError, match="missing, a data file the checkpoint lists"):
        diff(b, a, verify=False)


def test_diff_ignores_named_sections_but_counts_them(tmp_path) -> None:
    model = make_mlp()
    a, b = os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b")
    ddpckpt.save(a, model=model, step=1, extra={"tag": "x", "seen": torch.zeros(3)}, rng=False)
    ddpckpt.save(b, model=model, step=2, extra={"tag": "y", "seen": torch.ones(3)}, rng=False)
    report = diff(a, b)
    assert report.by_section() == {"step": 1, "extra/tag": 1, "extra/seen": 1}
    partial = diff(a, b, ignore=["extra/seen", "step"])
    assert partial.by_section() == {"extra/tag": 1}
    assert partial.ignored == {"extra/seen": 1, "step": 1}
    assert diff(a, b, ignore=["extra", "step"]).same
    with pytest.raises(ValueError, match="nothing called optimizer to ignore"):
        diff(a, b, ignore=["optimizer"])


def test_tools_name_a_run_directory_given_for_a_checkpoint(tmp_path) -> None:
    run = tmp_path / "run"
    with ddpckpt.Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.save(7)
    expected = "a run directory, not a checkpoint"
    with pytest.raises(CheckpointNotFoundError, match=expected):
        summary(run)
    with pytest.raises(CheckpointNotFoundError, match=expected):
        export(run, os.fspath(tmp_path / "w.pt"))
    assert summary(run / "step-00000007")["step"] == 7


def test_a_summary_without_the_tensor_table_reads_no_shard_index(tmp_path) -> None:
    """``inspect --no-tensors`` counts a sharded checkpoint's tensors from the manifest,
    without reading every writer's index (one is removed here); the table reads them."""
    fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "format-v6-hsdp")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture, ckpt)
    whole = summary(ckpt)
    assert whole["tensor_count"] == len(whole["tensors"]) == 32
    (ckpt / "shards-00003.json").unlink()
    brief = summary(ckpt, tensors=False)
    assert brief["tensor_count"] == 32 and brief["tensors"] == []
    with pytest.raises(CorruptCheckpointError, match=r"shards-00003\.json"):
        summary(ckpt)
