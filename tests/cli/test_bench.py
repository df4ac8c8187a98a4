"""``ddpckpt bench``: the launcher finds the benchmark in a source checkout and says how to
run it from a plain install; the benchmark (``benchmarks/bench.py``) end to end on a tiny
state: every method runs, every figure is a ratio.

Speed itself is never asserted here (the numbers of a 2-core CI box say nothing); this
only guards that the benchmark a user runs completes and reports what it promises.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpckpt._cli.bench_cmd import NOT_INSTALLED, harness_path, load_harness

ROOT = Path(__file__).resolve().parents[2]

_METHODS = {
    "torch.save rank 0 + barrier",
    "safetensors save_file rank 0",
    "DCP save",
    "DCP async_save",
    "ddpckpt",
    "ddpckpt async",
    "ddpckpt async overlap",
}


def _run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=cwd
    )


@pytest.mark.processes
def test_the_package_holds_no_benchmark_and_a_plain_install_says_how_to_run_it(tmp_path):
    # A plain install: the package files alone, as a wheel lays them out, no source tree.
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "src" / "ddpckpt", site / "ddpckpt")
    names = {path.name for path in (site / "ddpckpt").rglob("*.py")}
    assert not names & {"bench.py", "_bench_worker.py"}, "benchmark code in the package"
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = _run([sys.executable, "-m", "ddpckpt", "bench", "--out", "out"], env, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"ddpckpt bench: error: {NOT_INSTALLED}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.processes
def test_a_source_checkout_finds_the_benchmark_and_runs_it_as_a_script(tmp_path):
    assert harness_path() == ROOT / "benchmarks" / "bench.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = [sys.executable, str(ROOT / "benchmarks" / "bench.py")]
    done = _run([*script, "--nproc", "one", "--out", "out"], env, tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["bench: error: --nproc one: give world sizes like 1,2"]
    usage = _run([*script, "--help"], env, tmp_path).stdout
    assert "usage: python benchmarks/bench.py" in usage and "--device {cpu,cuda}" in usage
    assert not (tmp_path / "out").exists()


@pytest.mark.long
def test_bench_reports_every_method_against_same_run_references(tmp_path):
    bench = load_harness()
    out = tmp_path / "bench"
    report = bench.run_bench(
        str(out), nprocs=(1, 2), params=200_000, every=2, steps=6, compute=0.01, repeat=1,
        timeout=120,
    )  # fmt: skip

    saved = json.loads((out / "results.json").read_text())
    assert [run["world_size"] for run in saved["runs"]] == [1, 2]
    for run in saved["runs"]:
        assert set(run["methods"]) == _METHODS
        for reference in ("write_ceiling", "read_ceiling", "memcpy"):
            assert run["references"][reference] > 0
        for name, figures in run["ratios"]["methods"].items():
            for key, value in figures.items():
                assert math.isfinite(value), (name, key, value)
            assert figures["durable_s"] >= figures["stall_s"] > 0, name
        assert run["ratios"]["targets"], "no targets evaluated"
    assert "gil" in saved["runs"][0]

    markdown = (out / "results.md").read_text()
    assert markdown == bench.format_markdown(report)
    for name in _METHODS:
        assert f"| {name} |" in markdown
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "checkpoints" / "ranks-1").exists(), "benchmark checkpoints left behind"


def test_a_gpu_run_is_reported_against_the_pinned_copy_floor() -> None:
    # The figures of the recorded H100 run (see BENCHMARKS.md): ratios and the targets
    # are computed from the raw measurements; CI never needs a GPU for this.
    bench = load_harness()
    recorded = ROOT / "benchmarks" / "gpu-h100-2026-11-23-after.json"
    report = json.loads(recorded.read_text())
    run = report["runs"][0]
    run["ratios"] = bench.ratios(run)
    floor = run["state_bytes"] / run["references"]["memcpy"]
    assert run["ratios"]["snapshot_floor_s"] == pytest.approx(floor)
    async_ = run["ratios"]["methods"]["ddpckpt async"]
    assert async_["first_stall_s"] == run["first_stall"]["ddpckpt async"]
    targets = run["ratios"]["targets"]
    assert "first async save stall <= 1.2x copy floor" in targets
    assert targets["sync save durable <= 1.1x async time to durable"][0] == pytest.approx(
        run["methods"]["ddpckpt"]["durable"] / run["methods"]["ddpckpt async"]["durable"]
    )
    markdown = bench.format_markdown(report)
    assert "first-save stall s" in markdown and "NVIDIA H100" in markdown
    for name in run["methods"]:
        assert f"| {name} |" in markdown
