"""The main job, end to end: crash a DDP run, let torchrun restart it, prove it exact."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import matplotlib.image
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_shows_a_crash_an_automatic_resume_and_a_bit_identical_result(tmp_path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "ddpckpt", "demo", "--out", str(out), "--steps", "60", "--every", "10"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bit-identical to reference  yes" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["identical"] and report["differences"] == []
    assert 10 <= report["resumed_from"] < report["killed_at"] < 60
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 300
    assert matplotlib.image.imread(out / "loss.png").shape[:2] == (height, width)  # decodes
    listing = (out / "checkpoints.txt").read_text()
    assert "latest" in listing and "verified" in listing
