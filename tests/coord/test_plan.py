"""Which rank writes what: every tensor once, bytes balanced within one tensor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpckpt._coord.plan import FanOut, Transfer, assign, plan_owners


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=60),
    st.lists(st.integers(0, 64), min_size=1, max_size=8, unique=True),
)
def test_assignment_covers_everything_and_balances(sizes, ranks) -> None:
    ranks = sorted(ranks)  # as storage domains list them
    owners = assign(sizes, ranks)
    assert owners.keys() == sizes.keys()
    assert set(owners.values()) <= set(ranks)
    loads = dict.fromkeys(ranks, 0)
    for name, rank in owners.items():
        loads[rank] += sizes[name]
    biggest = max(sizes.values(), default=0)
    assert max(loads.values()) - min(loads.values()) <= biggest
    assert assign(dict(reversed(sizes.items())), ranks) == owners  # whatever the tensors' order


def test_no_ranks_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        assign({"a": 1}, [])


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=40),
    st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True),
    st.integers(1, 4),
    st.data(),
)
def test_each_domain_writes_a_full_copy(sizes, ranks, count, data) -> None:
    ranks = sorted(ranks)
    domains = [ranks[i::count] for i in range(count) if ranks[i::count]]
    movable = data.draw(st.sets(st.sampled_from(sorted(sizes))) if sizes else st.just(set()))
    for domain in domains:
        owners = plan_owners(sizes, domain, movable)
        assert owners.keys() == sizes.keys()  # every tensor once per domain
        assert all(owners[n] == domain[0] for n in sizes if n not in movable)
        assert all(owners[n] in domain for n in movable)
        assert owners == {**dict.fromkeys(sizes, domain[0]), **assign(
            {n: sizes[n] for n in movable}, domain)}  # fmt: skip
        assert plan_owners(sizes, domain, movable) == owners  # pure: same on every rank


def test_a_two_node_plan_splits_replicated_weights_within_each_node() -> None:
    sizes = {"w1": 400, "w2": 300, "w3": 200, "buffer": 8}
    movable = {"w1", "w2", "w3"}
    assert plan_owners(sizes, [0, 1], movable) == {"w1": 0, "w2": 1, "w3": 1, "buffer": 0}
    assert plan_owners(sizes, [2, 3], movable) == {"w1": 2, "w2": 3, "w3": 3, "buffer": 2}


@pytest.mark.parametrize("receivers", [0, 1, 2, 3, 4, 7, 8, 1000, 4095])
def test_a_fan_out_reaches_every_receiver_once_in_log_rounds(receivers) -> None:
    """Simulated at up to 4,095 receivers: every one receives the file exactly once, from a
    rank that had it, in ceil(log2(R + 1)) rounds; no rank acts twice in a round; matching
    parts agree."""
    line = [7, *range(100, 100 + receivers)]  # the holder, then the receivers
    fan = FanOut(line[0], tuple(line[1:]))
    assert fan.rounds == math.ceil(math.log2(receivers + 1))
    parts = {rank: fan.part(rank) for rank in line}
    assert fan.part(99) == []  # neither holder nor receiver
    assert fan.part_at(-1) == fan.part_at(receivers + 1) == []  # outside the line
    has = {line[0]: -1}  # rank: the round in which it got the file
    for k in range(fan.rounds):
        for rank in line:
            acts = [p for p in parts[rank] if p.round == k]
            assert len(acts) <= 1
            for act in acts:
                if act.role == "send":
                    assert has.get(rank, k) < k  # it had the file before this round
                    assert Transfer(k, "receive", rank) in parts[act.peer]
                else:
                    assert act.peer in has and rank not in has
                    has[rank] = k
    assert set(has) == set(line)
    assert max(len(p) for p in parts.values()) <= fan.rounds  # per rank: O(log R) parts
    assert all(p == sorted(p, key=lambda t: t.round) for p in parts.values())


def test_assigning_tensors_costs_the_tensors_not_the_ranks() -> None:
    """A billion ranks, never enumerated: only the first len(sizes) can get a tensor."""

    class Ranks(Sequence[int]):
        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, index):  # type: ignore[override]
            if isinstance(index, slice):
                return range(10**9)[index]
            return index

        def __iter__(self):  # type: ignore[override]
            raise AssertionError("every rank enumerated")

    owners = assign({"a": 30, "b": 20, "c": 10, "d": 5}, Ranks())
    assert owners == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert plan_owners({"x": 1, "y": 1}, Ranks(), {"x", "y"}) == {"x": 0, "y": 1}
