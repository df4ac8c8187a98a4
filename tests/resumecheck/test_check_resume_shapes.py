"""``ddpckpt check-resume`` on the other shapes of script users write: started by
``torch.multiprocessing.spawn`` (no torchrun, no WORLD_SIZE), a plain save/latest/load loop of
two models and two optimizers; a script that never seeds, whose two uninterrupted runs
differ."""

from __future__ import annotations

import sys

import pytest

from launch import free_port
from tiny_check import SUPPORT, check, check_tiny

pytestmark = [pytest.mark.processes, pytest.mark.long]


def test_a_spawn_script_with_tcp_init_is_checked_on_its_real_world_size(tmp_path) -> None:
    """torch.multiprocessing.spawn with init_method="tcp://..." sets no WORLD_SIZE: the world
    size comes from the process group. Two models and two optimizers, a plain latest() +
    load() + save() loop, --rank 1 honoured."""

    def command() -> list[str]:  # a new port for each attempt
        return [sys.executable, str(SUPPORT / "spawn_train.py"), "--dir", "gan", "--port",
                str(free_port())]  # fmt: skip

    code, output, report = check(tmp_path, command, "--rank", "1")
    assert code == 0, output[-5000:]
    assert (report["world"], report["victim"], report["mode"]) == (2, 1, "plain")
    (point,) = report["points"]
    assert point["kill"] == "at step 9 (before any save of it)" and point["resumed_from"] == 7
    assert (point["steps_compared"], point["ranks"]) == (4, 2)  # steps 8 to 11 on both ranks
    assert {"model:G.parameters", "model:D.parameters", "optimizer:opt_G",
            "optimizer:opt_D"} <= set(point["components"])  # fmt: skip
    assert "uninterrupted run: 12 steps on 2 ranks" in output
    assert "kill 1: rank 1 SIGKILLed at step 9" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check"]  # no gan/ left behind


def test_an_unseeded_script_cannot_be_judged_and_the_missing_seed_is_named(tmp_path) -> None:
    """Two uninterrupted runs of a script that never seeds torch nor numpy differ from the
    first step; killed right after a save, nothing the killed run did can be replayed."""
    code, output, report = check_tiny(tmp_path, "--kill-at=6:after-save", bug="unseeded")
    assert code == 1, output[-5000:]
    assert report["verdict"] == "cannot-judge" and not report["identical"]
    (point,) = report["points"]
    found = point["nondeterminism"]
    assert (found["step"], found["phase"]) == (1, "before-kill"), found
    assert found["component"] in ("rng.numpy", "rng.torch"), found
    assert "is never seeded" in found["cause"] and "seed(" in found["fix"]
    assert "CANNOT JUDGE: two uninterrupted runs of the script differ, first at step 1" in output
    assert "verdict: cannot judge" in output
