"""Retention policies say why they keep a checkpoint (what ``ddpckpt ls`` shows as notes)."""

from __future__ import annotations

import pytest

from ddpckpt.policies import KeepAll, KeepAnyOf, KeepBest, KeepLast, Record, _retention_from

RECORDS = [
    Record(10, {"loss": 0.3, "acc": 0.5}),
    Record(20, {"loss": 0.1, "acc": 0.9}),
    Record(30, {"loss": float("nan"), "acc": 0.7}),
    Record(40, {"acc": 0.2}),
]


def test_keep_best_names_each_kept_step_by_rank_and_metric() -> None:
    assert KeepBest(2, "loss").why_kept(RECORDS) == {20: "best #1 by loss", 10: "best #2 by loss"}
    assert KeepBest(1, "acc", "max").why_kept(RECORDS) == {20: "best #1 by acc"}


def test_keeping_the_newest_or_all_needs_no_note() -> None:
    assert KeepLast(2).why_kept(RECORDS) == {} and KeepAll().why_kept(RECORDS) == {}


def test_a_union_as_rebuilt_from_run_json_gives_the_notes_of_its_parts() -> None:
    policy = KeepAnyOf(KeepLast(1), KeepBest(1, "loss"), KeepBest(2, "acc", "max"))
    rebuilt = _retention_from(policy.describe())
    assert rebuilt is not None
    assert rebuilt.why_kept(RECORDS) == {
        20: "best #1 by acc",  # both keep it; the later policy's note shows
        30: "best #2 by acc",
    }


@pytest.mark.parametrize(
    ("old", "new"),
    [("Union", "KeepAnyOf"), ("schedule", "_schedule"), ("keeping", "_keeping"),
     ("retention_from", "_retention_from"), ("best_first", "_best_first")],
)  # fmt: skip
def test_earlier_names_warn_and_still_work(old: str, new: str) -> None:
    import ddpckpt.policies as policies

    assert old not in policies.__all__
    with pytest.warns(DeprecationWarning, match=rf"ddpckpt\.policies\.{old} is deprecated"):
        found = getattr(policies, old)
    assert found is getattr(policies, new)
