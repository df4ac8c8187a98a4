"""Ray Train (ddpckpt.integrations.ray): a run on a local Ray cluster, its storage on S3,
whose worker is SIGKILLed resumes bit for bit after Ray Train restarts the worker group;
where the checkpoints go on the run's storage; a damaged checkpoint falls back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch import WORKER

pytestmark = pytest.mark.skipif(find_spec("ray") is None, reason="no ray extra")


@pytest.mark.processes
@pytest.mark.long
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (the Ray page's snippet too)
@pytest.mark.timeout(480)  # beyond the run's own 420 s, which reports what it printed
def test_a_worker_killed_mid_epoch_resumes_bit_for_bit_from_s3_after_ray_restarts_it(
    s3_root, tmp_path: Path
) -> None:
    """Two runs in one Ray session (see ray_worker.py), the run's storage on a real S3
    server (RunConfig(storage_path="s3://...")): uninterrupted, and one whose worker 1 is
    SIGKILLed after step 8 of 14 (FailureConfig(max_failures=1)). Every step after the
    resume trains the same batch with the same loss, to the same weights; the resume comes
    from a checkpoint Ray Train recorded, written by ddpckpt into the run's storage, and
    CheckpointConfig(num_to_keep=2) applies. (The Ray page's script, run by test_docs,
    keeps its run on a local path.)"""
    # Ray Train's watcher of cloud nodes' preemption notices is an actor of its own in each
    # run (5 s of CPU here), and has nothing to watch on one machine
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(WORKER.with_name("ray_worker.py")), "--out", str(tmp_path),
         "--storage", str(s3_root)],
        capture_output=True, text=True, timeout=420, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    reference, killed = result["reference"], result["killed"]
    for rank in ("0", "1"):
        assert reference["ranks"][rank]["resumed_from"] == [0]
        first, again = killed["ranks"][rank]["resumed_from"]
        assert first == 0 and again in (3, 6), killed["ranks"][rank]["resumed_from"]
        assert killed["ranks"][rank]["steps"] == reference["ranks"][rank]["steps"], rank
        assert killed["ranks"][rank]["weights"] == reference["ranks"][rank]["weights"], rank
    for run in (reference, killed):
        assert run["checkpoint"] == "step-00000012"
        assert [n for n in run["stored"] if n.startswith("step-")] == [
            "step-00000009", "step-00000012"
        ]  # fmt: skip
    if killed["ranks"]["0"]["resumed_from"][1] == 3:  # step 6 was committed, not recorded
        assert "step-00000006 newer and committed, but not what Ray Train restored" in (done.stderr)


def test_checkpoints_go_to_the_runs_storage_as_ddpckpt_names_it() -> None:
    from ddpckpt.integrations.ray import _location

    assert _location(SimpleNamespace(type_name="local"), "/shared/runs/a/step-1") == (
        "/shared/runs/a/step-1"
    )
    assert _location(SimpleNamespace(type_name="s3"), "bucket/runs/a/step-1") == (
        "s3://bucket/runs/a/step-1"
    )
    with pytest.raises(ValueError, match=r"this run's storage is 'gcs' \(bucket/a\)"):
        _location(SimpleNamespace(type_name="gcs"), "bucket/a")


@pytest.fixture
def fake_ray(monkeypatch, tmp_path: Path):
    """One worker's view of a Ray Train run whose storage is ``tmp_path/run`` (no cluster):
    what report() sent to Ray Train, and the checkpoint Ray Train restores."""
    import ray.train

    import ddpckpt.integrations.ray as integration

    local = SimpleNamespace(type_name="local")
    run = tmp_path / "run"
    storage = SimpleNamespace(storage_filesystem=local, experiment_fs_path=str(run))
    context = SimpleNamespace(get_world_rank=lambda: 0, get_storage=lambda: storage)
    fake = SimpleNamespace(run=run, reported=[], restored=None)
    monkeypatch.setattr(ray.train, "get_context", lambda: context)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: fake.restored)
    monkeypatch.setattr(
        ray.train,
        "report",
        lambda metrics, checkpoint=None, **kw: fake.reported.append(checkpoint),
    )
    monkeypatch.setattr(integration, "_newest", {})
    return fake


def test_a_damaged_restored_checkpoint_falls_back_to_the_previous_one_and_says_so(
    fake_ray, caplog
) -> None:
    """resume() used to raise on a damaged checkpoint, so Ray Train restarted the group
    into the same failure until max_failures; now it loads the previous one, with
    WARNINGs naming both, and names a newer checkpoint Ray Train never recorded."""
    import torch

    import ddpckpt
    from ddpckpt.integrations.ray import report, resume

    model = torch.nn.Linear(4, 2)
    state = ddpckpt.TrainingState(model=model)
    saved = {}
    for step in (3, 6, 9):
        with torch.no_grad():
            model.weight.fill_(step)
        report({"step": step}, state, step=step)
        saved[step] = model.weight.clone()
    assert [c.path for c in fake_ray.reported] == [
        str(fake_ray.run / f"step-0000000{s}") for s in (3, 6, 9)
    ]
    with pytest.raises(ValueError, match=r"report\(step=9\): this run already has step 9"):
        report({}, state, step=9)
    damaged = fake_ray.run / "step-00000006" / "model-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + b"\xff" * 8)
    fake_ray.restored = fake_ray.reported[1]  # Ray recorded 6, not 9 (the group failed)
    info = resume(state)
    assert info is not None and info.step == 3
    assert torch.equal(model.weight, saved[3])
    text = caplog.text
    assert "step-00000009 newer and committed, but not what Ray Train restored" in text
    assert "resume(): cannot load" in text and "step-00000006" in text
    assert "resume(): loaded" in text and "(step 3) instead of" in text
    report({}, state, step=6)  # saved again where Ray Train's record of step 6 points
    assert fake_ray.reported[-1] is None  # no second record of that path (metrics only)
    assert ddpckpt.verify(str(fake_ray.run / "step-00000006")).step == 6
    report({}, state, step=7)
    assert fake_ray.reported[-1].path == str(fake_ray.run / "step-00000007")
