"""Which copy a node lacking a checkpoint receives (ddpckpt._coord.replicate): one that
keeps the own files of the ranks now on it, with the fast tier's partners as without, from
any node holding the checkpoint; and what is said when no node keeps them. Pure, on rank
0's side."""

from __future__ import annotations

import pytest

from ddpckpt._coord.plan import Partners
from ddpckpt._coord.rankset import RankSet
from ddpckpt._coord.replicate import _sources
from ddpckpt.errors import CorruptCheckpointError

NODES = [[0, 1], [2, 3], [4, 5], [6, 7]]


def _reported(partners: Partners, holding: set[int], world: int = 8) -> list:
    """What each node holding the checkpoint reports on its first rank: the ranks whose
    files its copy keeps, and the world the checkpoint was saved with."""
    kept: list = [None] * sum(map(len, NODES))
    for index in holding:
        kept[NODES[index][0]] = {
            "kept": RankSet.of(partners.ranks_kept_by(index)).to_json(),
            "world": world,
        }
    return kept


def _have(lacking: set[int]) -> list[bool]:
    return [not any(r in NODES[n] for n in lacking) for r in range(8)]


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
    holding = set(range(4)) - lost
    assert (
        _sources("ckpt", NODES, _have(lost), _reported(Partners(NODES, keepers), holding)) == groups
    )


def test_neighbours_lost_beyond_the_partners_are_named() -> None:
    kept = _reported(Partners(NODES, 1), {0, 3})
    with pytest.raises(CorruptCheckpointError, match=r"own files .* of ranks 2-3: the nodes"):
        _sources("ckpt", NODES, _have({1, 2}), kept)


def test_nodes_holding_the_step_without_their_ranks_files_serve_and_receive() -> None:
    """Saved on machines h1-h4 (nodes 0-3, partners=1: each keeps its ranks' files and the
    node before it's); h3 replaced by h0, which the restart's rendezvous sorts first, so h1,
    h2 and h4 run the ranks of the node after them. h1 and h2 hold the step without the
    files of their new ranks, yet each keeps another node's: every node receives a copy
    that keeps its ranks' files, h1 and h2 serving one and receiving another."""
    then = Partners(NODES, 1)
    copies = {1: then.ranks_kept_by(0), 2: then.ranks_kept_by(1), 3: then.ranks_kept_by(3)}
    kept = [None] * 8
    for node, ranks in copies.items():  # now node 1 is h1, node 2 h2, node 3 h4
        kept[NODES[node][0]] = {"kept": RankSet.of(ranks).to_json(), "world": 8}
    have = [r in copies.get(n, []) for n, node in enumerate(NODES) for r in node]
    assert have == [False] * 6 + [True] * 2  # only h4 keeps its (unchanged) ranks' files
    assert _sources("ckpt", NODES, have, kept) == [[2, [0]], [4, [2]], [6, [4]]]


def test_a_node_is_never_its_own_source() -> None:
    kept = [None] * 8
    kept[0] = {"kept": [[0, 8]], "world": 8}  # reports it keeps its ranks' files ...
    kept[2] = {"kept": [[0, 8]], "world": 8}
    have = [False, False] + [True] * 6  # ... while its ranks say they lack them
    assert _sources("ckpt", NODES, have, kept) == [[2, [0]]]


def test_a_job_grown_by_a_node_loads_rank_0_s_state_on_the_new_ranks() -> None:
    """Saved on 3 nodes (6 ranks), resumed on 4: the new node's ranks, beyond the saved
    world, need rank 0's files, which node 0's copy keeps (the durable tier's every file)."""
    kept = [None] * 8
    for index in range(3):
        kept[NODES[index][0]] = {"kept": [[0, 6]], "world": 6}
    assert _sources("ckpt", NODES, _have({3}), kept) == [[0, [6]]]


def test_a_node_reports_the_ranks_its_copy_keeps_from_its_file_tables(tmp_path) -> None:
    """A node's copy written with partners, of a job large enough for file tables (format
    7): what it keeps is read from its own tables, found where its manifest was read."""
    from ddpckpt._coord.replicate import _kept_here
    from ddpckpt._format import filetable
    from ddpckpt._format.manifest import MANIFEST_NAME, Manifest
    from ddpckpt._format.rankparts import rank_file_name
    from ddpckpt._format.tensorfile import FileEntry
    from ddpckpt.storage._location import locate

    world, kept = 3 * filetable.TABLE_RANKS, range(filetable.TABLE_RANKS, 2 * filetable.TABLE_RANKS)
    path = tmp_path / "step-00000001"
    path.mkdir()
    manifest = Manifest(id="0123456789ab", step=1, world_size=world, rank_keys=["rng"])
    manifest.copy = {"index": 1, "count": 3, "partners": 1}
    for rank in kept:  # this node's ranks' own files, and no other node's
        name = rank_file_name(rank)
        manifest.files[name] = FileEntry(name, 100 + rank, f"{rank:016x}", rank)
    for name, blob in manifest.files.tabulate(set(), manifest.id, 0).items():
        (path / name).write_bytes(blob)
    (path / MANIFEST_NAME).write_bytes(manifest.to_json(str(path)).encode())
    assert RankSet.from_json(_kept_here(locate(str(path)))["kept"]) == RankSet.of(kept)
