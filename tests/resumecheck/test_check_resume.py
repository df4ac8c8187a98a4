"""``ddpckpt check-resume`` on real torchrun jobs: a script that resumes exactly (at 2 and 4
ranks), and planted bugs (at 2), each named by the component and the step where it first
shows, with the cause the runs' own evidence supports. (Other script shapes:
test_check_resume_shapes.py; the README's first recipe: test_docs.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiny_check import FIRST, KILL, RESUMED, check_tiny

pytestmark = [pytest.mark.processes, pytest.mark.long]


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, dict[str, Any]]:
    """The correct script, checked at the default kill points; its uninterrupted run is
    reused by the checks of the bugs that act only after a resume."""
    tmp = tmp_path_factory.mktemp("exact")
    return (tmp / "check", *check_tiny(tmp))


def test_a_correct_script_is_bit_identical_at_both_default_kill_points(exact) -> None:
    _, code, output, report = exact
    assert code == 0, output[-5000:]
    assert report["identical"] is True and report["verdict"] == "exact"
    points = report["points"]
    assert [p["kill"] for p in points] == [
        "at step 10 (before any save of it)",  # inside epoch 2, after the mid-epoch save at 8
        "right after the save of step 6",  # epoch 1's end
    ]
    assert [p["resumed_from"] for p in points] == [8, 6]
    assert [(p["steps_compared"], p["ranks"]) for p in points] == [(4, 2), (6, 2)]
    assert [p["replayed"] for p in points] == [2, 0]  # steps 9, 10: the killed run's own
    assert all(p["rank"] == 1 and p["divergence"] is None for p in points)
    assert all(len(p["launches"]) == 1 for p in points)  # torchrun restarted the killed job
    components = points[0]["components"]
    assert {"model.parameters", "model.buffers", "optimizer", "scheduler", "rng.torch",
            "rng.numpy", "loader", "loader.samples", "inputs", "loss"} <= set(components)  # fmt: skip
    line = (
        "bit-identical at every step compared on every rank: 4 steps after the restart x 2 "
        f"ranks, {len(components)} components each: "
    )
    assert line in output
    kinds = output.split(line)[1].split("\n")[0].split(", ")  # inputs, loader (2), ...
    assert sum(int(k.split("(")[1][:-1]) if "(" in k else 1 for k in kinds) == len(components)
    assert "verdict: the resume is exact at every kill point" in output
    assert "isolation: " in output and "user/ckpt (Checkpointer)" in output
    assert not (exact[0].parent / "user").exists()  # the script's own directory: untouched


def test_four_ranks_resume_bit_identical_with_ddps_gradient_buckets_restored(tmp_path) -> None:
    """From 3 ranks on, the order DDP sums gradients in depends on its bucket layout, which
    a restarted process must get back from the checkpoint."""
    code, output, report = check_tiny(tmp_path, f"--kill-at={KILL}", nproc=4)
    assert code == 0, output[-5000:]
    (point,) = report["points"]
    assert point["resumed_from"] == RESUMED and point["divergence"] is None, point["divergence"]
    assert (point["steps_compared"], point["ranks"]) == (4, 4) and len(point["launches"]) == 1
    assert "bit-identical at every step compared on every rank: 4 steps after the restart x 4 " in (
        output
    )


def test_zero_optimizer_state_is_checked_bit_identical(tmp_path) -> None:
    """ZeRO-1's optimizer state is compared shard by shard on each rank (its own
    state_dict() would refuse without a consolidation). FSDP2's DTensors: the recorder's
    digest is checked in tests/test_sharded.py; SHARDED=fsdp runs here too, at the cost of
    another minute."""
    code, output, report = check_tiny(tmp_path, f"--kill-at={KILL}", sharded="zero")
    assert code == 0, output[-5000:]
    (point,) = report["points"]
    assert point["resumed_from"] == RESUMED and point["divergence"] is None, point["divergence"]
    assert (point["steps_compared"], point["ranks"]) == (4, 2)
    assert {"model.parameters", "optimizer", "scheduler"} <= set(point["components"])


@pytest.mark.parametrize(
    ("bug", "phase", "component", "ranks", "cause"),
    [
        # the seeding call itself, found in the resumed run: its file and line
        (
            "numpy",
            "start",
            "rng.numpy",
            [0, 1],
            "seeds it after resuming: np.random.seed(0) at tiny_train.py:",
        ),
        ("scheduler", "start", "scheduler", [0, 1], "steps the scheduler 1 more time"),
        ("broadcast", "start", "model.buffers", [1], "broadcast_buffers=False"),
    ],
)
def test_a_bug_after_resume_is_named_with_its_component_and_step(
    exact, tmp_path: Path, bug: str, phase: str, component: str, ranks: list[int], cause: str
) -> None:
    reference = exact[0]
    code, output, report = check_tiny(tmp_path, f"--kill-at={KILL}", bug=bug, reference=reference)
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
        ("augment", "end", "inputs", "ddpckpt.data.SeededDataset(dataset, seed)"),
    ],
)
def test_a_bug_from_the_start_is_named_with_its_component_and_step(
    tmp_path: Path, bug: str, phase: str, component: str, fix: str
) -> None:
    code, output, report = check_tiny(tmp_path, f"--kill-at={KILL}", bug=bug)
    assert code == 1, output[-5000:]
    (point,) = report["points"]
    divergence = point["divergence"]
    assert (divergence["step"], divergence["phase"]) == (FIRST, phase), divergence
    assert divergence["component"] == component, divergence
    assert fix in divergence["fix"]


def test_a_rank_that_dies_in_the_interpreters_teardown_after_its_script_ended_is_noted(
    exact, tmp_path: Path
) -> None:
    """torch 2.13's gloo threads abort finished processes at exit at random: the check goes
    on with the complete records and says so, instead of calling the script failed."""
    code, output, report = check_tiny(
        tmp_path, f"--kill-at={KILL}", bug="teardown", reference=exact[0]
    )
    assert code == 0, output[-5000:]
    (point,) = report["points"]
    assert point["resumed_from"] == RESUMED and point["divergence"] is None
    assert len(point["launches"]) == 1  # not started again: it had finished
    assert "every rank's script ran to its end, then the launcher exited with 1" in output
    assert "pytorch/pytorch#190489" in output


def test_a_script_that_exits_with_an_error_after_its_last_step_fails_the_check(
    exact, tmp_path: Path
) -> None:
    code, output, _ = check_tiny(tmp_path, f"--kill-at={KILL}", bug="exit-3", reference=exact[0])
    assert code != 0 and "the script failed (exit 1)" in output, output[-5000:]


def test_a_restart_at_the_next_epoch_is_named_quoting_the_runs_own_warning(exact, tmp_path) -> None:
    """Restarting at info.epoch + 1 (the ImageNet habit) after a checkpoint saved inside epoch
    0: the resumed run skips the rest of that epoch, warns so, and ends two steps early."""
    code, output, report = check_tiny(tmp_path, "--kill-at=5", bug="epoch", reference=exact[0])
    assert code == 1, output[-5000:]
    (point,) = report["points"]
    divergence = point["divergence"]
    assert point["resumed_from"] == 4 and (divergence["step"], divergence["phase"]) == (5, "start")
    assert divergence["component"] == "rng.torch", divergence
    assert divergence["cause"].startswith("the loop restarted at another epoch"), divergence
    (quoted,) = divergence["quoted"]
    assert "the remaining 2 batches of epoch 0 are skipped" in quoted
    assert f"the run said: {quoted}" in output
    assert "the resumed run ended at step 10; the uninterrupted run at step 12" in output


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
