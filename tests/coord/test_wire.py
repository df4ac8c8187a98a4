"""The store protocol's named values: marks and the close counter."""

from __future__ import annotations

import pytest

from ddpckpt._coord.failures import encode_error, unwrap
from ddpckpt._coord.wire import CloseCount, Mark
from ddpckpt.errors import CorruptCheckpointError


def test_every_mark_is_one_distinct_byte_and_data_neither_wakes_nor_raises() -> None:
    marks = [Mark.DATA, Mark.ERROR, Mark.FAILED, Mark.SILENT, Mark.PENDING, Mark.POSTED]
    assert all(len(m) == 1 for m in marks) and len(set(marks)) == len(marks)
    assert set(Mark.WAKES).isdisjoint(Mark.RAISES) and Mark.DATA not in Mark.WAKES + Mark.RAISES
    assert not Mark.wakes(Mark.DATA + b"T") and not Mark.raises(Mark.DATA + b"E")
    assert Mark.wakes(Mark.SILENT) and Mark.raises(Mark.FAILED + b"{}")


def test_an_encoded_error_is_raised_by_its_reader_and_data_is_returned() -> None:
    blob = encode_error(CorruptCheckpointError("damaged"))
    assert Mark.raises(blob)
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        unwrap(blob)
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        unwrap(Mark.FAILED + blob[1:])  # what a heartbeat copies from the failure key
    assert unwrap(Mark.DATA + b"payload") == b"payload"


@pytest.mark.parametrize("world", [1, 2, 3, 4096, (1 << 30) - 1])
def test_the_close_count_keeps_its_three_fields_apart_at_any_world_size(world: int) -> None:
    """Every rank adds once; the last one's reading says how many left, how many left
    orphans and whether rank 0 waits, whatever the order."""
    orphaning = len([r for r in range(min(world, 5)) if r % 2])  # a few ranks, never rank 0
    plain = world - 1 - orphaning
    count = (
        plain * CloseCount.add(False, waits=False)
        + orphaning * CloseCount.add(True, waits=False)
        + CloseCount.add(False, waits=True)  # rank 0
    )  # what the adds of every rank sum to, in any order, without a loop over them
    assert CloseCount.of(count) == CloseCount(world, orphaning, True)
    before_rank_0 = count - CloseCount.add(False, waits=True)
    assert CloseCount.of(before_rank_0) == CloseCount(world - 1, orphaning, False)
