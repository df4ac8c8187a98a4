"""Bulk copies between storage domains on a gloo group of each transfer's own
(ddpckpt._coord.copies): a failed transfer leaves nothing behind for later saves or for the
user's own process groups. Real processes on two simulated nodes, saving to memory://
(per process, so node-local: each rank is a storage domain of its own)."""

from __future__ import annotations

import threading

import pytest

import ddpckpt._coord.comm as comm_module
from ddpckpt._coord import copies, liveness
from ddpckpt._coord.comm import Comm
from ddpckpt._coord.copies import send_to_leaders
from ddpckpt._coord.store import StoreGroup
from launch import torchrun_nodes
from thread_ranks import ranks, sim


@pytest.mark.processes
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
            return comm.run_transfer(
                "copies", lambda: send_to_leaders(comm, [[0, 1], [2]], b"r%d" % group.rank)
            )

    server = sim.Server()
    results, _ = ranks(3, body, server)
    assert results == [{2: b"r2"}, {}, {0: b"r0", 1: b"r1"}]
    assert server.store.num_keys() == 3 + 1  # the heartbeat records and their roster only


def _copies(domains: list[list[int]]):
    """Every rank sends its bundle to every other domain's first rank (a node-local save's
    copies step) in one call, which rank 0 leaves last (it then deletes the shared keys)."""
    others_left = threading.Barrier(sum(len(d) for d in domains))

    def body(group: StoreGroup) -> dict[int, bytes]:
        comm = Comm.open("ddpckpt.save", timeout=120, group=group)
        bundle = b"rank%d" % group.rank * (group.rank + 1)  # sizes differ
        found = comm.run_transfer("copies", lambda: send_to_leaders(comm, domains, bundle))
        if group.rank:
            comm.close()
        others_left.wait()
        if not group.rank:
            comm.close()
        return found

    return body


def test_every_domain_leader_receives_every_other_domains_bundles() -> None:
    domains = [[0, 1], [2], [3, 4, 5], [6], [7]]  # a ring of five leaders (odd: three waves)
    results, _ = ranks(8, _copies(domains))
    for domain in domains:
        for rank in domain:
            expected = {}
            if rank == domain[0]:
                expected = {r: b"rank%d" % r * (r + 1) for r in range(8) if r not in domain}
            assert results[rank] == expected, (rank, results[rank])


def test_a_node_local_copy_costs_every_rank_the_same_at_any_scale(monkeypatch) -> None:
    """Store operations and gloo connections per rank for the copies of one save on
    node-local storage (each rank its own storage domain: the longest ring), at 4, 16 and
    64 ranks: the same. A group of every rank made each rank read every other rank's
    address (6 reads at 4 ranks, 18 at 16, 66 at 64) and open a connection to each."""
    monkeypatch.setattr(liveness, "MAX_PERIOD", 60.0)  # no liveness checks mid-call
    monkeypatch.setattr(copies, "_POLL", 60.0)  # nor looks for a failure while waiting
    made: dict[int, int] = {}
    real_pair_group = comm_module.pair_group

    def counting_pair_group(store, key, rank, peer, *args):
        made[rank] = made.get(rank, 0) + 1
        return real_pair_group(store, key, rank, peer, *args)

    monkeypatch.setattr(comm_module, "pair_group", counting_pair_group)
    costs = {}
    for n in (4, 16, 64):
        made.clear()
        server = sim.Server()
        results, stats = ranks(n, _copies([[r] for r in range(n)]), server)
        assert all(len(found) == n - 1 for found in results), results
        ops = [
            sum(c for op, c in s.by_op.items() if op not in ("check", "delete_key")) for s in stats
        ]
        deletes = [s.by_op.get("delete_key", 0) for s in stats]
        costs[n] = {
            "ops rank 0": ops[0],
            "ops other (max)": max(ops[1:]),
            "deletes (max)": max(deletes),
            "connections (max)": max(made.values()),
        }
        assert server.store.num_keys() == n + 1  # the heartbeat records and their roster only
    print("per rank, one node-local save's copies:", costs)
    assert costs[4] == costs[16] == costs[64]
    assert costs[64]["connections (max)"] == 2  # its neighbours in the ring
