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
from ddpckpt._coord.copies import from_first_leader, send_to_leaders
from ddpckpt._coord.plan import Partners
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
                "copies",
                lambda: send_to_leaders(comm, Partners([[0, 1], [2]]), b"r%d" % group.rank),
            )

    server = sim.Server()
    results, _ = ranks(3, body, server)
    assert results == [{2: b"r2"}, {}, {0: b"r0", 1: b"r1"}]
    assert server.store.num_keys() == 3 + 1  # the heartbeat records and their roster only


def _copies(domains: list[list[int]], keepers: int | None = None):
    """Every rank sends its bundle to the first rank of every domain that keeps its files
    (a node-local save's copies step; every other domain's without ``keepers``), and rank 0
    its shared part to every leader, in one call, which rank 0 leaves last (it then deletes
    the shared keys). Each rank returns what it received, and the shared part if it got it."""
    others_left = threading.Barrier(sum(len(d) for d in domains))

    def body(group: StoreGroup) -> dict[int, bytes]:
        comm = Comm.open("ddpckpt.save", timeout=120, group=group)
        bundle = b"rank%d" % group.rank * (group.rank + 1)  # sizes differ
        partners = Partners(domains, keepers)

        def exchange() -> dict[int, bytes]:
            found = send_to_leaders(comm, partners, bundle)
            if keepers is None:  # rank 0's shared part travels with its bundle (settling.py)
                return found
            shared = from_first_leader(comm, domains, b"shared" if group.rank == 0 else None)
            return {**found, **({-1: shared} if shared is not None and group.rank else {})}

        found = comm.run_transfer("copies", exchange)
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


@pytest.mark.parametrize(
    ("domains", "keepers"),
    [
        ([[0, 1], [2], [3, 4, 5], [6], [7]], 1),
        ([[0], [1], [2], [3], [4], [5]], 2),
        ([[0], [1, 2], [3], [4]], 2),  # 2 after and 2 before: the same leaders, other rounds
        ([[0], [1], [2]], 5),  # more than there are: every other domain
    ],
)
def test_with_partners_a_leader_receives_the_bundles_of_the_domains_it_keeps(domains, keepers):
    results, _ = ranks(sum(map(len, domains)), _copies(domains, keepers))
    partners = Partners(domains, keepers)
    for index, domain in enumerate(domains):
        kept = [r for i in partners.kept_by(index)[1:] for r in domains[i]]
        expected = {r: b"rank%d" % r * (r + 1) for r in kept} | ({-1: b"shared"} if index else {})
        assert results[domain[0]] == expected, (domain, results[domain[0]])
        assert all(results[r] == {} for r in domain[1:])


def test_partners_keep_each_domain_s_files_on_its_own_and_k_other_domains() -> None:
    """At 4,096 domains: each domain's files are kept by itself and the k after it; each
    domain keeps its own and the k before it's; a save costs each domain k sends."""
    domains = [[r] for r in range(4096)]
    for keepers in (1, 2, 3):
        partners = Partners(domains, keepers)
        kept = [0] * len(domains)
        for index in range(len(domains)):
            keepers_of = partners.keepers(index)
            assert len(set(keepers_of)) == keepers + 1 and keepers_of[0] == index
            for k in keepers_of:
                kept[k] += 1
            assert len(partners.ranks_kept_by(index)) == keepers + 1
        assert set(kept) == {keepers + 1}  # every domain keeps k + 1 domains' files
    assert Partners(domains).ranks_kept_by(7) == list(range(4096))  # the durable tier's


@pytest.fixture
def made(monkeypatch) -> dict[int, int]:
    """The gloo connections each rank makes (pair groups), counted; no liveness checks or
    looks for a failure mid-call."""
    monkeypatch.setattr(liveness, "MAX_PERIOD", 60.0)
    monkeypatch.setattr(copies, "_POLL", 60.0)
    counts: dict[int, int] = {}
    real_pair_group = comm_module.pair_group

    def counting_pair_group(store, key, rank, peer, *args):
        counts[rank] = counts.get(rank, 0) + 1
        return real_pair_group(store, key, rank, peer, *args)

    monkeypatch.setattr(comm_module, "pair_group", counting_pair_group)
    return counts


def test_a_node_local_copy_costs_every_rank_the_same_at_any_scale(made) -> None:
    """Store operations and gloo connections per rank for the copies of one save on
    node-local storage (each rank its own storage domain: the longest ring), at 4, 16 and
    64 ranks: the same. A group of every rank made each rank read every other rank's
    address (6 reads at 4 ranks, 18 at 16, 66 at 64) and open a connection to each."""
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


def test_with_a_partner_a_save_s_copies_cost_each_rank_log_d_connections(made) -> None:
    """The fast tier's copies (``FastTier(partners=1)``, each rank its own node): a rank
    connects to the node before and after it, and to those it passes rank 0's shared state
    to by doubling: at most 2 + ceil(log2 D) connections, in as many rounds; every rank
    receives 1 other node's files, not D - 1."""
    for n in (4, 16, 64):
        made.clear()
        results, _ = ranks(n, _copies([[r] for r in range(n)], keepers=1))
        assert all(len(found) == 1 + (rank > 0) for rank, found in enumerate(results)), n
        assert max(made.values()) <= 2 + (n - 1).bit_length(), (n, made)
