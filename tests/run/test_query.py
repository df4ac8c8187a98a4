"""The read-only queries of a run directory: right answers, and no side effects at all."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import make_mlp
from ddpckpt import Checkpointer
from ddpckpt._coord.comm import Comm
from ddpckpt._run import query
from ddpckpt._run.runlock import RunLock
from ddpckpt.errors import CheckpointNotFoundError
from ddpckpt.storage._location import locate


def tree(root) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            found[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture
def run(tmp_path):
    """A run with steps 2 (loss 0.5), 4 (loss 0.2), 6 (loss 0.9) and an incomplete step 8."""
    run = tmp_path / "run"
    with Checkpointer(run, model=make_mlp(), keep_last=None) as ckpt:
        for step, loss in ((2, 0.5), (4, 0.2), (6, 0.9), (8, 0.1)):
            ckpt.save(step, epoch=step // 2, metrics={"loss": loss})
    (run / "step-00000008" / "manifest.json").unlink()
    return run


@pytest.fixture
def nothing_collective(monkeypatch):
    """Any collective, store wait or lock taken fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a query ran a collective or took the lock")

    monkeypatch.setattr(Comm, "open", refuse)
    monkeypatch.setattr(Comm, "from_leader", refuse)
    monkeypatch.setattr(RunLock, "acquire", refuse)


def test_the_queries_answer_from_the_manifests(run, nothing_collective) -> None:
    directory = str(run)
    assert query.steps(locate(directory)) == [2, 4, 6]
    assert query.latest_step(locate(directory)) == 6
    assert query.best_step(locate(directory), "loss") == 4
    assert query.best_step(locate(directory), "loss", "max") == 6
    assert query.best_step(locate(directory), "accuracy") is None
    assert query.info(locate(directory), 4).epoch == 2
    assert query.resume_step(locate(directory)) == 6  # the incomplete step 8 is never a candidate
    assert query.resume_step(locate(directory), best="loss") == 4
    assert query.resume_step(locate(directory), step=2) == 2
    assert query.choose(directory, query.committed(locate(directory)), best="loss") == [4, 2, 6]
    with pytest.raises(CheckpointNotFoundError, match="step 8"):
        query.resume_step(locate(directory), step=8)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint has a finite metric"):
        query.resume_step(locate(directory), best="accuracy")
    with pytest.raises(ValueError, match="not both"):
        query.resume_step(locate(directory), step=2, best="loss")


@pytest.mark.parametrize("read_only", [False, True])
def test_checkpointer_queries_touch_nothing(run, nothing_collective, read_only) -> None:
    before = tree(run)
    ckpt = Checkpointer(run, model=make_mlp(), mode="max", read_only=read_only)
    assert ckpt.steps() == [2, 4, 6] and ckpt.latest_step() == 6
    assert ckpt.best("loss") == 6 and ckpt.best("loss", mode="min") == 4
    assert ckpt.info(6).metrics == {"loss": 0.9}
    assert ckpt.resume_step() == 6 and ckpt.resume_step(best="loss") == 6
    ckpt.close()
    assert tree(run) == before  # no lock file, no latest rewritten, nothing moved aside
    assert not torch.distributed.is_initialized()


def test_a_missing_directory_is_an_empty_run_and_is_not_created(
    tmp_path, nothing_collective
) -> None:
    absent = tmp_path / "absent"
    ckpt = Checkpointer(absent, model=make_mlp())
    assert ckpt.steps() == [] and ckpt.latest_step() is None and ckpt.best("loss") is None
    assert (
        ckpt.resume_step() is None and query.resume_step(locate(str(absent)), best="loss") is None
    )
    with pytest.raises(CheckpointNotFoundError):
        ckpt.info(1)
    ckpt.close()
    assert not absent.exists()


def test_resume_loads_what_resume_step_names(run) -> None:
    reader = Checkpointer(run, model=make_mlp(), read_only=True)
    expected = reader.resume_step(best="loss")
    assert reader.resume(best="loss").step == expected == 4
    reader.close()


def test_why_kept_reads_the_retention_the_saving_job_recorded(tmp_path) -> None:
    run = tmp_path / "run"
    assert query.why_kept(locate(str(run))) == {} and query.entries(locate(str(run))) == []
    with Checkpointer(run, model=make_mlp(), keep_last=1, keep_best=1, monitor="loss") as ckpt:
        for step, loss in ((1, 0.3), (2, 0.1), (3, 0.7)):
            ckpt.save(step, metrics={"loss": loss})
    assert query.why_kept(locate(str(run))) == {2: "best #1 by loss"}
    assert query.latest_name(locate(str(run))) == "step-00000003"
    assert [(e.step, e.status) for e in query.entries(locate(str(run)))] == [
        (2, "committed"),
        (3, "committed"),
    ]


def test_a_step_or_metric_of_the_wrong_type_says_so(run) -> None:
    directory = str(run)
    for ask in (
        lambda: query.info(locate(directory), "4"),
        lambda: query.resume_step(locate(directory), "4"),
    ):
        with pytest.raises(TypeError, match="step must be an int, got '4'"):
            ask()
    with pytest.raises(TypeError, match="metric is named by a string"):
        query.best_step(locate(directory), 4)
    assert query.info(locate(directory), np.int64(4)).epoch == 2
