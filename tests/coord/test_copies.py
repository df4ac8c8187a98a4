"""Bulk copies between storage domains on a gloo group of each transfer's own
(ddpckpt._coord.copies): a failed transfer leaves nothing behind for later saves or for the
user's own process groups. Real processes on two simulated nodes, saving to memory://
(per process, so node-local: each rank is a storage domain of its own)."""

from __future__ import annotations

import pytest

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.copies import send_to_leaders
from ddpckpt._coord.store import StoreGroup
from launch import torchrun_nodes
from thread_ranks import ranks, sim


@pytest.mark.parametrize("failing_save", ["first", "second"])
def test_saves_and_user_groups_work_after_a_failed_copy(tmp_path, failing_save) -> None:
    """Rank 1 fails in the copies step of one save (before the transfer group was ever made,
    or after a transfer succeeded on it): that save fails on both ranks, the next ones
    succeed and load bit for bit, and the user's ``dist.new_group`` still matches."""
    args = ["--mode", failing_save, "--timeout", "3", "--pg-timeout", "30"]
    launch = torchrun_nodes(
        "copies_after_failure", tmp_path, nnodes=2, nproc=1, args=args, timeout=120
    ).ok()
    failing = 0 if failing_save == "first" else 1
    for rank in (0, 1):
        result = launch.result(rank)
        expected = ["ok"] * 3
        expected[failing] = "RankFailureError"
        assert result["outcomes"] == expected, (rank, result)
        assert result["exact"] is True, (rank, result)
        assert result["user_group"] == 2.0, (rank, result)


def test_a_transfer_leaves_no_keys_in_the_store() -> None:
    """gloo's rendezvous writes each rank's address into the store; a save on node-local
    storage makes a transfer group each time, so what it leaves would pile up for the job."""

    def body(group: StoreGroup) -> dict[int, bytes]:
        with Comm.open("ddpckpt.save", timeout=60, group=group) as comm:
            return comm.run(
                "copies", lambda: send_to_leaders(comm, [[0, 1], [2]], b"r%d" % group.rank)
            )

    server = sim.Server()
    results, _ = ranks(3, body, server)
    assert results == [{2: b"r2"}, {}, {0: b"r0", 1: b"r1"}]
    assert server.store.num_keys() == 3 + 1  # the heartbeat records and their roster only
