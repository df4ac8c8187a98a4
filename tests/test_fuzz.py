"""Fuzzing: real checkpoints and torch.save files, mutated as an attacker or a failing disk
would, keep the property of ``tests/support/mutations.py`` (they load, or raise a documented
error; in bounded time and memory; opening nothing outside the checkpoint).

Derandomized (the same examples at every run), with example counts sized for CI; the
long-running target outside CI is ``tests/fuzz/fuzz_checkpoints.py`` (``make fuzz``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mutations import example


def fuzz(examples: int) -> settings:
    """The settings of a CI fuzz test: the same ``examples`` at every run."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,  # the property bounds each call's time itself
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no slow "explain" tracing
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Draws:
    """A mutation's choices, drawn by hypothesis (so failures shrink)."""

    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def integer(self, lo: int, hi: int) -> int:
        return self._data.draw(st.integers(lo, hi))

    def raw(self, at_most: int) -> bytes:
        return self._data.draw(st.binary(max_size=at_most))


def test_mutated_checkpoints_load_or_raise_a_documented_error(tmp_path_factory) -> None:
    one = example("checkpoint", tmp_path_factory.mktemp("checkpoint"))

    @fuzz(150)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()


def test_mutated_sharded_checkpoints_load_or_raise_a_documented_error(tmp_path_factory) -> None:
    """The format-6 shard indexes as well as the manifest, data and rank files."""
    one = example("sharded", tmp_path_factory.mktemp("sharded"))

    @fuzz(120)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()


def test_mutated_torch_files_import_or_are_refused(tmp_path_factory) -> None:
    one = example("torchfile", tmp_path_factory.mktemp("torchfile"))

    @fuzz(300)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()


def test_mutated_dcp_directories_import_or_are_refused(tmp_path_factory) -> None:
    one = example("dcp", tmp_path_factory.mktemp("dcp"))

    @fuzz(120)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()


def test_mutated_trainer_and_accelerate_directories_import_or_are_refused(tmp_path_factory) -> None:
    one = example("hf", tmp_path_factory.mktemp("hf"))

    @fuzz(150)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()


def test_mutated_deepspeed_checkpoints_import_or_are_refused(tmp_path_factory) -> None:
    one = example("deepspeed", tmp_path_factory.mktemp("deepspeed"))

    @fuzz(120)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        one(Draws(data))

    check()
