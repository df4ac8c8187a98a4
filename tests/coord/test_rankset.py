"""RankSet: a set of ranks as spans, the same set as the ranks it was made of, and small for
whole runs of nodes at any number of ranks."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from ddpckpt._coord.rankset import RankSet
from ddpckpt._run.fast_steps import by_step as _by_step


@given(st.lists(st.integers(0, 200), max_size=120))
def test_a_rank_set_holds_exactly_its_ranks(ranks) -> None:
    found = RankSet.of(ranks)
    assert len(found) == len(set(ranks))
    assert [r for r in range(-2, 205) if r in found] == sorted(set(ranks))
    assert found.mask(201) == [r in set(ranks) for r in range(201)]
    assert RankSet.from_json(json.loads(json.dumps(found.to_json()))) == found
    assert all(b > a for a, b in found.spans)
    assert all(later[0] > earlier[1] for earlier, later in itertools.pairwise(found.spans))


def held_answer(ranks: int) -> int:
    """The size of the fast tier's answer on what each node holds: 8 ranks a node, every node
    holding step 7, all but node 3 holding step 8 (replaced)."""
    views = [{"7": "id7", **({} if r // 8 == 3 else {"8": "id8"})} for r in range(ranks)]
    return len(json.dumps(_by_step(views)))


def test_what_every_rank_receives_of_the_fast_tier_s_holdings_does_not_grow_with_ranks() -> None:
    # every rank's view used to come back as a list of the ranks holding each step: 47 kB
    # per rank at 4,096 ranks, through rank 0's store to each of them
    assert held_answer(4096) < 100 and held_answer(4096) - held_answer(16) < 20  # digits
