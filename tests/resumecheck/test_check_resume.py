"""``ddpckpt check-resume`` on real torchrun jobs: a script that resumes exactly (at 2 and 4
ranks), and planted bugs (at 2), each named by the component and the step where it first
shows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from launch import _env, _finish, _start, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SCRIPT = Path(__file__).parents[1] / "support" / "tiny_train.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# tiny_train.py: 6 steps an epoch at any world size, 2 epochs; saves at 4, 6 (epoch end), 8, 12 (and epoch end).
# Killed at step 10, the restarted run resumes from 8 and its first step is 9.
KILL, RESUMED, FIRST = "10", 8, 9


def check(
    tmp: Path, *options: str, bug: str = "", reference: Path | None = None, elastic: bool = True,
    nproc: int = 2, sharded: str = "",
) -> tuple[int, str, dict[str, Any]]:  # fmt: skip
    """Run the checker on tiny_train.py. ``elastic``: torchrun restarts the killed job itself
    (--max-restarts 1); otherwise torchrun gives up and the checker starts it again.
    ``sharded``: tiny_train.py's SHARDED (``zero``, ``fsdp``)."""
    out = tmp / "check"
    port = free_port()
    launcher = (
        ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1",
         "--monitor-interval=0.2", "--local-addr=127.0.0.1"]
        if elastic
        else ["--master-addr=127.0.0.1", f"--master-port={port}"]
    )  # fmt: skip
    command = [TORCHRUN, f"--nproc-per-node={nproc}", *launcher, str(SCRIPT), "--dir",
               str(tmp / "user")]  # fmt: skip
    argv = [sys.executable, "-m", "ddpckpt", "check-resume", "--out", str(out), "--timeout=150",
            *options, *(["--reference", str(reference)] if reference else []), "--", *command]  # fmt: skip
    env = _env({"PLANTED_BUG": bug, "SHARDED": sharded, "PYTHONWARNINGS": "ignore::FutureWarning"})
    ((code, output),) = _finish([_start(argv, env, tmp)], 600)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return code, output, report


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, dict[str, Any]]:
    """The correct script, checked at the default kill points; its uninterrupted run is
    reused by the checks of the bugs that act only after a resume."""
    tmp = tmp_path_factory.mktemp("exact")
    return (tmp / "check", *check(tmp, elastic=False))


def test_a_correct_script_is_bit_identical_at_both_default_kill_points(exact) -> None:
    _, code, output, report = exact
    assert code == 0, output[-5000:]
    assert report["identical"] is True
    points = report["points"]
    assert [p["kill"] for p in points] == [
        "at step 10 (before any save of it)",  # inside epoch 2, after the mid-epoch save at 8
        "right after the save of step 6",  # epoch 1's end
    ]
    assert [p["resumed_from"] for p in points] == [8, 6]
    assert [p["steps_compared"] for p in points] == [2 * 4, 2 * 6]  # steps x ranks
    assert all(p["rank"] == 1 and p["divergence"] is None for p in points)
    assert all(len(p["launches"]) == 2 for p in points)  # torchrun gave up; started again
    components = set(points[0]["components"])
    assert {"model.parameters", "model.buffers", "optimizer", "scheduler", "rng.torch",
            "rng.numpy", "loader.loader", "loader.loader.samples", "inputs", "loss"} <= components  # fmt: skip
    assert (
        "bit-identical at every step on every rank: 4 steps after the restart x 2 ranks" in output
    )
    assert "verdict: the resume is exact at every kill point" in output


def test_four_ranks_resume_bit_identical_with_ddps_gradient_buckets_restored(tmp_path) -> None:
    """From 3 ranks on, the order DDP sums gradients in depends on its bucket layout, which
    a restarted process must get back from the checkpoint."""
    code, output, report = check(tmp_path, f"--kill-at={KILL}", nproc=4)
    assert code == 0, output[-5000:]
    (point,) = report["points"]
    assert point["resumed_from"] == RESUMED and point["divergence"] is None, point["divergence"]
    assert point["steps_compared"] == 4 * 4 and len(point["launches"]) == 1
    assert "bit-identical at every step on every rank: 4 steps after the restart x 4 ranks" in (
        output
    )


def test_zero_optimizer_state_is_checked_bit_identical(tmp_path) -> None:
    """ZeRO-1's optimizer state is compared shard by shard on each rank (its own
    state_dict() would refuse without a consolidation). FSDP2's DTensors: the recorder's
    digest is checked in tests/test_sharded.py; SHARDED=fsdp runs here too, at the cost of
    another minute."""
    code, output, report = check(tmp_path, f"--kill-at={KILL}", sharded="zero")
    assert code == 0, output[-5000:]
    (point,) = report["points"]
    assert point["resumed_from"] == RESUMED and point["divergence"] is None, point["divergence"]
    assert point["steps_compared"] == 2 * 4
    assert {"model.parameters", "optimizer", "scheduler"} <= set(point["components"])


@pytest.mark.parametrize(
    ("bug", "phase", "component", "ranks", "cause"),
    [
        ("numpy", "start", "rng.numpy", [0, 1], "seeds it after resume()"),
        ("scheduler", "start", "scheduler", [0, 1], "steps the scheduler 1 more time"),
        ("broadcast", "start", "model.buffers", [1], "broadcast_buffers=False"),
    ],
)
def test_a_bug_after_resume_is_named_with_its_component_and_step(
    exact, tmp_path: Path, bug: str, phase: str, component: str, ranks: list[int], cause: str
) -> None:
    reference = exact[0]
    code, output, report = check(tmp_path, f"--kill-at={KILL}", bug=bug, reference=reference)
    assert code == 1, output[-5000:]
    (point,) = report["points"]
    divergence = point["divergence"]
    assert point["resumed_from"] == RESUMED
    assert (divergence["step"], divergence["phase"]) == (FIRST, phase), divergence
    assert (divergence["component"], divergence["ranks"]) == (component, ranks), divergence
    assert cause in divergence["cause"]
    assert len(point["launches"]) == 1  # torchrun restarted the killed job itself
    assert f"DIFFERENT: first at step {FIRST}" in output and divergence["fix"] in output


@pytest.mark.parametrize(
    ("bug", "phase", "component", "fix"),
    [
        ("optimizer", "end", "optimizer:unsaved.0", "optimizer=optimizer"),
        # the unsaved loader's new pass draws its seed from torch's generator, then restarts
        ("loader", "start", "rng.torch", "extra={'loader': loader}"),
        # loader workers augment from their own global generators: same samples, other noise
        ("augment", "end", "inputs", "ddpckpt.SeededDataset(dataset, seed)"),
    ],
)
def test_a_bug_from_the_start_is_named_with_its_component_and_step(
    tmp_path: Path, bug: str, phase: str, component: str, fix: str
) -> None:
    code, output, report = check(tmp_path, f"--kill-at={KILL}", bug=bug)
    assert code == 1, output[-5000:]
    (point,) = report["points"]
    divergence = point["divergence"]
    assert (divergence["step"], divergence["phase"]) == (FIRST, phase), divergence
    assert divergence["component"] == component, divergence
    assert fix in divergence["fix"]


def test_a_script_given_without_its_launcher_is_named_with_the_command_to_give(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`ddpckpt check-resume train.py` said "No such file or directory: 'train.py'" of a
    file that is there: it is run as a command, which needs its launcher."""
    from ddpckpt._cli.main import main

    (tmp_path / "train.py").write_text("print('hello')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check-resume", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "cannot start 'train.py'" in err
    assert "ddpckpt check-resume -- torchrun --nproc-per-node 2 train.py" in err
