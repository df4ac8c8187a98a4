"""The main job, end to end: ``ddpckpt demo`` crashes a DDP run, torchrun restarts it, and
``ddpckpt check-resume`` proves the resume exact on the bundled training script."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from ddpckpt._cli.demo import SCRIPT, demo_command


def _png_size(path: Path) -> tuple[int, int]:
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert matplotlib.image.imread(path).shape[:2] == (height, width)  # decodes
    return width, height


@pytest.mark.processes
@pytest.mark.long
def test_demo_shows_a_crash_an_automatic_resume_and_a_bit_identical_result(tmp_path) -> None:
    """At 3 ranks, where a resume is exact only with DDP's gradient buckets restored."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "ddpckpt", "demo", "--out", str(out), "--steps", "60", "--every", "10",
         "--kill-at", "36", "--nproc", "3"],
        capture_output=True, text=True, timeout=400, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ddpckpt demo: 3 ranks, 60 optimizer steps, a checkpoint every 10" in result.stdout
    assert "rank 1 SIGKILLed at step 36 (before any save of it); the launcher restarted it" in (
        result.stdout
    )
    line = (
        "bit-identical at every step compared on every rank: 30 steps after the restart x 3 ranks"
    )
    assert line in result.stdout
    count, kinds = result.stdout.split(line)[1].split("\n")[0].split(" components each: ")
    assert sum(int(k[k.index("(") + 1 : -1]) if "(" in k else 1 for k in kinds.split(", ")) == int(
        count.lstrip(", ")
    )  # "13 components each: extra (2), ..." adds up
    assert "verdict: the resume is exact at every kill point" in result.stdout
    assert "runs/demo (Checkpointer)" in result.stdout  # mapped into demo/, never written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    logs = "".join(p.read_text() for p in (out / "runs").glob("*/launch-*.log"))
    assert "stored once for all ranks differ" not in logs  # the EMA is updated on every rank

    report = json.loads((out / "report.json").read_text())
    assert report["identical"] and report["world"] == 3 and report["victim"] == 1
    (point,) = report["points"]
    assert point["resumed_from"] == 30 and point["divergence"] is None
    assert (point["steps_compared"], point["ranks"]) == (30, 3)  # as the summary says
    assert f"{len(point['components'])} components each" in result.stdout
    assert len(point["launches"]) == 1  # torchrun --max-restarts 1 restarted the job itself
    assert {"loss", "lr", "scheduler", "scaler", "extra.ema", "extra.accumulation",
            "loader.samples", "model.buffers", "rng.torch"} <= set(point["components"])  # fmt: skip
    # every step after the restart, the loss and the learning rate equal the uninterrupted run's
    for component in ("loss", "lr"):
        assert point["grid"][component] == {str(s): True for s in range(31, 61)}
    losses = report["losses"]
    assert losses["rank"] == 1 and [s for s, _ in losses["reference"]] == list(range(1, 61))
    before, after = losses["killed"][0]
    assert [s for s, _ in before] == list(range(1, 37))
    assert after == losses["reference"][30:]

    assert _png_size(out / "loss.png")[0] > 400 and _png_size(out / "resume-check.png")[0] > 400
    listing = (out / "checkpoints.txt").read_text()
    assert "latest" in listing and "verified" in listing
    assert f"training script: {SCRIPT}" in result.stdout


def test_the_training_script_is_an_example_file_not_a_module_of_the_package() -> None:
    assert SCRIPT.is_file() and SCRIPT.parent.name == "examples"
    assert not (SCRIPT.parent / "__init__.py").exists()
    assert "ckpt.log_step(" in SCRIPT.read_text()


def test_the_launch_binds_a_port_the_system_picks_never_one_found_free_before() -> None:
    # A port found free, closed, then passed to torchrun could be taken by another process
    # before the rendezvous binds it; port 0 is bound at once by the launch's own store.
    command = demo_command(nproc=2, steps=20, every=5)
    assert "--rdzv-endpoint=127.0.0.1:0" in command and "--max-restarts=1" in command
    assert command == demo_command(nproc=2, steps=20, every=5)  # nothing drawn per call
