"""What a resume makes of the fast tier's holdings (ddpckpt._run.fast_steps): the copy most
nodes hold, the ranks that can read it with their own files, and those whose node holds
it at all (a node keeping only its partners' files: FastTier(partners=...))."""

from __future__ import annotations

from ddpckpt._coord.rankset import RankSet
from ddpckpt._run.fast_steps import LACKING, by_step, holdings


def test_the_copy_most_nodes_hold_counts_nodes_lacking_their_ranks_files_too() -> None:
    views = [{"5": "a"}, {"5": "a"}, {"5": "b"}, {"5": "b"}, {"5": "b" + LACKING}, {}]
    held = by_step(views)
    have, copies = holdings(held["5"])
    assert have == RankSet.of([2, 3]) and copies == RankSet.of([2, 3, 4])


def test_a_copy_no_rank_can_read_with_its_own_files_is_still_a_copy() -> None:
    have, copies = holdings(by_step([{"7": "a" + LACKING}, {"7": "a" + LACKING}])["7"])
    assert len(have) == 0 and copies == RankSet.of([0, 1])
