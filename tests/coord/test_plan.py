"""Which rank writes what: every tensor once, bytes balanced within one tensor."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpckpt._coord.plan import assign, assign_shards, plan_owners


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


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.integers(0, 10**9), max_size=40),
    st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True),
    st.integers(1, 4),
    st.data(),
)
def test_each_domain_writes_a_full_copy(sizes, ranks, count, data) -> None:
    domains = [ranks[i::count] for i in range(count) if ranks[i::count]]
    movable = data.draw(st.sets(st.sampled_from(sorted(sizes))) if sizes else st.just(set()))
    plans = plan_owners(sizes, domains, movable)
    assert len(plans) == len(domains)
    for domain, owners in zip(domains, plans, strict=True):
        assert owners.keys() == sizes.keys()  # every tensor once per domain
        assert all(owners[n] == domain[0] for n in sizes if n not in movable)
        assert all(owners[n] in domain for n in movable)
        assert owners == {**dict.fromkeys(sizes, domain[0]), **assign(
            {n: sizes[n] for n in movable}, list(reversed(domain)))}  # fmt: skip
    assert plan_owners(sizes, domains, movable) == plans  # a pure function: same on every rank


def test_a_two_node_plan_splits_replicated_weights_within_each_node() -> None:
    sizes = {"w1": 400, "w2": 300, "w3": 200, "buffer": 8}
    nodes = [[0, 1], [2, 3]]
    first, second = plan_owners(sizes, nodes, movable={"w1", "w2", "w3"})
    assert first == {"w1": 0, "w2": 1, "w3": 1, "buffer": 0}
    assert second == {"w1": 2, "w2": 3, "w3": 3, "buffer": 2}


def test_each_shard_is_written_once_per_domain_by_one_of_its_holders() -> None:
    # HSDP on 4 ranks: shard a held by ranks 0 and 2, b by 1 and 3; two nodes {0, 1}, {2, 3}
    shards = {"a": (100, [0, 2]), "b": (100, [1, 3]), "c": (10, [0, 1, 2, 3])}
    (one, loads_one), (two, loads_two) = assign_shards(shards, [[0, 1], [2, 3]])
    assert one == {"a": 0, "b": 1, "c": 0} and two == {"a": 2, "b": 3, "c": 2}
    assert loads_one == {0: 110, 1: 100} and loads_two == {2: 110, 3: 100}
    # replicas spread: six equal shards held by every rank go two to each of three ranks
    owners, _ = assign_shards({i: (8, [0, 1, 2]) for i in range(6)}, [[0, 1, 2]])[0]
    assert sorted(owners.values()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(LookupError):  # a node holding no replica of b cannot write a copy
        assign_shards(shards, [[0, 2], [1, 3]])


def test_replicated_tensors_fill_around_the_shards() -> None:
    owners = plan_owners({"x": 10, "y": 10}, [[0, 1]], {"x", "y"}, [{0: 100, 1: 0}])[0]
    assert owners == {"x": 1, "y": 1}
