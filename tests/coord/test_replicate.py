"""Which copy a node lacking a checkpoint receives (ddpckpt._coord.replicate): one that
keeps its ranks' own files, with the fast tier's partners as without; and what is said
when no node keeps them. Pure, on rank 0's side."""

from __future__ import annotations

import pytest

from ddpckpt._coord.plan import Partners
from ddpckpt._coord.rankset import RankSet
from ddpckpt._coord.replicate import _sources
from ddpckpt.errors import CorruptCheckpointError

NODES = [[0, 1], [2, 3], [4, 5], [6, 7]]


def _kept(partners: Partners, lost: set[int], world: int = 8) -> tuple[list[bool], list]:
    """What each rank reports: whether it holds the checkpoint with its own file, and (on a
    holding node's first rank) the ranks whose files its copy keeps."""
    have = [not any(r in NODES[n] for n in lost) for r in range(world)]
    return have, _reported(partners, have)


def _reported(partners: Partners, have: list[bool]) -> list:
    kept: list = [None] * len(have)
    for index, node in enumerate(NODES):
        if all(have[r] for r in node):
            kept[node[0]] = RankSet.of(partners.ranks_kept_by(index)).to_json()
    return kept


@pytest.mark.parametrize(
    ("keepers", "lost", "groups"),
    [
        (None, {1}, [[0, [2]]]),  # every node keeps every file: the first holding node's copy
        (None, {0, 1, 2}, [[6, [0, 2, 4]]]),
        (1, {1}, [[4, [2]]]),  # node 2 keeps node 1's files
        (1, {0, 2}, [[2, [0]], [6, [4]]]),  # two copies, each to the node before it
        (2, {1, 2}, [[0, [4]], [6, [2]]]),  # nodes 3 and 0 keep node 2's, node 3 node 1's
    ],
)
def test_a_node_lacking_the_checkpoint_receives_a_copy_keeping_its_ranks_files(
    keepers, lost, groups
) -> None:
    have, kept = _kept(Partners(NODES, keepers), lost)
    assert _sources("ckpt", NODES, have, kept) == groups


def test_neighbours_lost_beyond_the_partners_are_named() -> None:
    have, kept = _kept(Partners(NODES, 1), {1, 2})
    with pytest.raises(CorruptCheckpointError, match=r"keeps the own files .* of ranks 2-3,"):
        _sources("ckpt", NODES, have, kept)


def test_a_node_holding_the_step_without_its_ranks_files_receives_a_copy_that_keeps_them():
    """After a restart that put other ranks on node 0: its copy lacks their files, so it
    receives the copy of node 1, which keeps node 0's ranks' files too."""
    partners = Partners(NODES, 1)
    have, _ = _kept(partners, set())
    have[0] = have[1] = False  # their node holds the step, without their files
    assert _sources("ckpt", NODES, have, _reported(partners, have)) == [[2, [0]]]
