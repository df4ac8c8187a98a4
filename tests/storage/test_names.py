"""Listed object names: used exactly as listed, or skipped with a WARNING naming the key."""

from __future__ import annotations

import logging

import pytest

from ddpckpt.storage._names import is_plain_name, plain_name


@pytest.mark.parametrize("name", ["manifest.json", "step-00000002", "a/b", ".next-x/y", "..a"])
def test_names_of_real_segments_are_plain(name: str) -> None:
    assert is_plain_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "./manifest.json", "a//b", "a/", "/a", "a/../b"])
def test_names_with_an_empty_dot_or_dotdot_segment_are_skipped_once_with_a_warning(
    name: str, caplog
) -> None:
    assert not is_plain_name(name)
    key = f"run-{name!r}/{name}"
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert plain_name(name, key, "s3://bucket/run") is None
        assert plain_name(name, key, "s3://bucket/run") is None  # reported once
    assert [r.getMessage().count(repr(key)) for r in caplog.records] == [1]
    assert "s3://bucket/run" in caplog.text


def test_past_the_cap_one_line_says_the_rest_are_skipped_unnamed(caplog, monkeypatch) -> None:
    import ddpckpt.storage._names as names

    monkeypatch.setattr(names, "_MAX_REPORTED", 2)
    monkeypatch.setattr(names, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for _listing in range(3):  # every listing of a run holding 5 such keys
            for i in range(5):
                assert plain_name("./x", f"run/{i}/./x", "s3://b/run") is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages  # two keys named, then one line for the rest
    assert "more than 2 listed objects" in messages[-1]
