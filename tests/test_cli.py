"""The ddpckpt command line, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt.cli import main


def saved(path: str, seed: int = 0, step: int = 5) -> str:
    model = make_mlp(seed)
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    return ddpckpt.save(path, model=model, optimizer=opt, step=step, metrics={"loss": 1.5})


def test_inspect_prints_metadata_and_table(ckpt_dir, capsys) -> None:
    saved(ckpt_dir)
    assert main(["inspect", ckpt_dir]) == 0
    out = capsys.readouterr().out
    assert "step        5" in out and "loss=1.5" in out
    assert "optimizer: Adam" in out
    assert "model/0.weight" in out and "[8, 4]" in out and "F32" in out


def test_verify_exit_codes_name_bad_files(ckpt_dir, tmp_path, capsys) -> None:
    saved(ckpt_dir)
    assert main(["verify", ckpt_dir]) == 0
    target = os.path.join(ckpt_dir, "model-00000.safetensors")
    with open(target, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    capsys.readouterr()
    assert main(["verify", ckpt_dir, os.fspath(tmp_path / "missing")]) == 1
    out = capsys.readouterr().out
    assert "BAD  " + ckpt_dir in out and "model-00000.safetensors" in out
    assert "no checkpoint at this path" in out


def test_diff_export_import_commands(tmp_path, capsys) -> None:
    a = saved(os.fspath(tmp_path / "a"), seed=0)
    b = saved(os.fspath(tmp_path / "b"), seed=1, step=6)
    assert main(["diff", a, a]) == 0
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "step: 5 -> 6" in out and "model/0.weight" in out
    assert main(["export", a, os.fspath(tmp_path / "w.safetensors")]) == 0
    torch.save({"model": make_mlp().state_dict(), "epoch": 2}, tmp_path / "old.pth")
    assert main(["import", os.fspath(tmp_path / "old.pth"), os.fspath(tmp_path / "imported")]) == 0
    assert ddpckpt.verify(tmp_path / "imported").epoch == 2
    assert main(["inspect", os.fspath(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_console_script_runs(ckpt_dir) -> None:
    saved(ckpt_dir)
    result = subprocess.run(
        [sys.executable, "-m", "ddpckpt", "inspect", "--json", ckpt_dir],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert '"step": 5' in result.stdout
