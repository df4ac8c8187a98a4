"""Which rank writes what: every tensor once, bytes balanced within one tensor."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpckpt.dist.plan import assign


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=60),
    st.lists(st.integers(0, 64), min_size=1, max_size=8, unique=True),
)
def test_assignment_covers_everything_and_balances(sizes, ranks) -> None:
    owners = assign(sizes, ranks)
    assert owners.keys() == sizes.keys()
    assert set(owners.values()) <= set(ranks)
    loads = dict.fromkeys(ranks, 0)
    for name, rank in owners.items():
        loads[rank] += sizes[name]
    biggest = max(sizes.values(), default=0)
    assert max(loads.values()) - min(loads.values()) <= biggest
    assert assign(sizes, list(reversed(ranks))) == owners  # same on every rank, whatever order


def test_no_ranks_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        assign({"a": 1}, [])
