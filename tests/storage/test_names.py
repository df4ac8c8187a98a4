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


@pytest.fixture
def fresh_reports(monkeypatch) -> None:
    """This process has reported no name yet."""
    import ddpckpt.storage._names as names

    monkeypatch.setattr(names, "_reported", set())


def test_an_object_is_named_by_its_full_key_and_bucket(fresh_reports, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        plain_name("./manifest.json", "run/step-6/./manifest.json", "s3://b/run/step-6", bucket="b")
    [message] = [r.getMessage() for r in caplog.records]
    assert "skipped the object 'run/step-6/./manifest.json' in bucket 'b'" in message
    assert "Delete it with your storage's own tools if nobody needs it" in message


def test_a_listed_prefix_is_said_to_be_one_with_every_object_under_it(
    fresh_reports, caplog
) -> None:
    """A delimited listing shows ``run/step-6/./`` for ``run/step-6/./manifest.json``: no
    object has that key, so the warning says which keys are skipped, not one to delete."""
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        plain_name(".", "run/step-6/./", "s3://b/run/step-6", bucket="b", prefix=True)
    [message] = [r.getMessage() for r in caplog.records]
    assert "skipped every object whose key starts with 'run/step-6/./' in bucket 'b'" in message
    assert "skipped the object" not in message


def test_each_object_is_reported_once_per_process_whichever_listing_meets_it(
    fresh_reports, caplog
) -> None:
    """The prefix (list of step-6), then its object from the run (walk of run), then from
    step-6 (walk of step-6): one line; the same key in another bucket is another object."""
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for _ in range(2):
            plain_name(".", "run/step-6/./", "s3://b/run/step-6", bucket="b", prefix=True)
            plain_name("step-6/./m", "run/step-6/./m", "s3://b/run", bucket="b")
            plain_name("./m", "run/step-6/./m", "s3://b/run/step-6", bucket="b")
        plain_name("./m", "run/step-7/./m", "s3://b/run/step-7")
        plain_name("step-7/./m", "run/step-7/./m", "s3://b/run")  # from another listing
        plain_name("./m", "run/step-6/./m", "s3://other/run/step-6", bucket="other")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "'run/step-6/./' in bucket 'b'" in messages[0]
    assert "'run/step-7/./m'" in messages[1]
    assert "'run/step-6/./m' in bucket 'other'" in messages[2]
