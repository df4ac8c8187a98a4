"""keep_best says once per run when a save's metrics cannot rank it (a misspelled monitor,
no metrics, a value that is no finite number), instead of keeping nothing as best quietly."""

from __future__ import annotations

import logging

import pytest

from conftest import make_mlp
from ddpckpt import Checkpointer
from ddpckpt.policies import KeepAnyOf, KeepBest, KeepLast


def notices(caplog) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.levelno == logging.WARNING and "monitors" in r.getMessage()
    ]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_misspelled_monitor_is_said_once_naming_what_was_given(
    tmp_path, caplog, async_save
) -> None:
    run = tmp_path / "exp1"
    ckpt = Checkpointer(
        run, model=make_mlp(), keep_last=3, keep_best=2, monitor="val_los", async_save=async_save
    )
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for step in (10, 20, 30, 40):
            ckpt.save(step, metrics={"val_loss": 1.0 / step})
        ckpt.close()
    said = notices(caplog)
    assert len(said) == 1, [r.getMessage() for r in said]  # once per run, not every save
    message = said[0].getMessage()
    assert message.startswith(
        "keep_best=2 monitors 'val_los', but save(step=10, metrics=...) gave only 'val_loss': "
    ), message
    assert f"no checkpoint of {run} is kept as best" in message
    assert "pass metrics={'val_los': ...} to save(), or monitor='val_loss'" in message
    assert said[0].ddpckpt_same_on_every_rank  # printed by rank 0 alone
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-00000020",
        "step-00000030",
        "step-00000040",
    ]


def test_a_save_without_metrics_is_said_once(tmp_path, caplog) -> None:
    ckpt = Checkpointer(tmp_path / "run", model=make_mlp(), keep_best=1, monitor="loss")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ckpt.save(1, metrics={"loss": 0.5})
        ckpt.save(2)
        ckpt.save(3)
        ckpt.close()
    said = notices(caplog)
    assert len(said) == 1, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert message.startswith("keep_best=1 monitors 'loss', but save(step=2) gave no metrics: ")
    assert "step 2 cannot count as best" in message
    assert "the one kept as best by it is step 1" in message  # true: an earlier save had it
    assert "pass metrics={'loss': ...} to save()" in message


@pytest.mark.parametrize(
    ("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), ("0.3", "'0.3'")]
)
def test_a_value_that_is_no_finite_number_is_said(tmp_path, caplog, value, shown) -> None:
    ckpt = Checkpointer(tmp_path / "run", model=make_mlp(), keep_best=1, monitor="loss")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ckpt.save(1, metrics={"loss": value, "acc": 0.5})
        ckpt.close()
    (said,) = notices(caplog)
    assert f"save(step=1, metrics=...) gave 'loss'={shown}, which is no finite number" in (
        said.getMessage()
    )


def test_saves_the_monitor_can_rank_are_not_reported(tmp_path, caplog) -> None:
    retention = KeepAnyOf(KeepLast(1), KeepBest(1, "loss"), KeepBest(1, "acc", "max"))
    ckpt = Checkpointer(tmp_path / "run", model=make_mlp(), retention=retention)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for step in (1, 2):
            ckpt.save(step, metrics={"loss": 0.5 / step, "acc": 0.1 * step})
        ckpt.save(3, metrics={"loss": 0.1})  # no "acc": one notice, for that monitor only
        ckpt.close()
    said = notices(caplog)
    assert len(said) == 1 and said[0].getMessage().startswith(
        "keep_best=1 monitors 'acc', but save(step=3, metrics=...) gave only 'loss': "
    ), [r.getMessage() for r in said]
