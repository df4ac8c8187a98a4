"""Which rank writes which shard: every distinct shard of every DTensor once per storage
domain, by one of its holders there, spread over the replicas; decided by each rank for its
own shards, at a cost that does not grow with the number of ranks (counted at 4,096)."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

import ddpckpt._io.shardwrite as shardwrite
import ddpckpt._state.dtensor as dtensor
from ddpckpt._format.shardgrid import nonempty_shards, region_at
from ddpckpt._io.shardwrite import plan_shards
from ddpckpt._state.sharded import MeshLayout, ShardedTensor
from ddpckpt.errors import UnsupportedValueError
from shard_snapshots import LAYOUTS, SHAPES, snapshot_of


def written(layout: MeshLayout, domains: list[list[int]]) -> dict[int, Counter]:
    """Every rank's plan: per domain, how many times each (tensor, offsets) is written, and
    checks that only a holder writes its own shard."""
    by_domain: dict[int, Counter] = {d: Counter() for d in range(len(domains))}
    for d, domain in enumerate(domains):
        for rank in domain:
            plan = plan_shards(snapshot_of(layout, rank), domains, rank, len(layout.ranks))
            for name, offsets in plan.pieces.items():
                shape = SHAPES[int(name.split(".")[0][1:])]
                assert layout.region(shape, rank)[0] == offsets
                by_domain[d][(name, offsets)] += 1
    return by_domain


def distinct_shards(layout: MeshLayout) -> set[tuple[str, tuple[int, ...]]]:
    found = set()
    for i, shape in enumerate(SHAPES):
        for (offsets, _), _holders in ShardedTensor(None, shape, layout).holders():  # type: ignore[arg-type]
            found |= {(f"t{i}.weight", offsets), (f"t{i}.exp_avg", offsets)}
    return found


@pytest.mark.parametrize(("mesh", "placements", "domains"), LAYOUTS)
def test_every_shard_is_written_once_per_domain_by_a_holder_there(mesh, placements, domains):
    layout = MeshLayout(mesh, tuple(reversed(range(8))), placements)  # ranks out of order
    wanted = distinct_shards(layout)
    for counts in written(layout, domains).values():
        assert set(counts) == wanted and set(counts.values()) == {1}


@pytest.mark.parametrize("domains", [[list(range(8))], [[0, 1, 2, 3], [4, 5, 6, 7]]])
def test_replicas_share_the_bytes_they_write(domains) -> None:
    """Weights and small norms alternate by name: taking turns by tensor put every weight of
    a shard on one replica (half the ranks wrote nearly everything). Largest first to the
    least-loaded replica, each rank's bytes are within one tensor of its replicas'."""
    layout = MeshLayout((4, 2), tuple(range(8)), ("R", "S0"))
    shapes = [(64, 64) if i % 2 else (64,) for i in range(40)]
    written_bytes: Counter = Counter()
    for rank in range(8):
        snapshot = snapshot_of(layout, rank, shapes)
        plan = plan_shards(snapshot, domains, rank, 8)
        written_bytes[rank] = sum(t.numel() * t.element_size() for _, t in plan.items)
    largest = 32 * 64 * 4  # one tensor's shard
    for domain in domains:
        for shard in (0, 1):  # the replicas of each shard in this domain
            loads = [written_bytes[r] for r in domain if layout.coordinate(r)[1] == shard]
            assert max(loads) - min(loads) <= largest, written_bytes


def test_a_node_that_lacks_a_shard_is_refused_on_its_ranks() -> None:
    # FSDP2 over 8 ranks, a disk per node of 4: neither node holds every shard
    layout = MeshLayout((8,), tuple(range(8)), ("S0",))
    for rank in (0, 5):
        with pytest.raises(UnsupportedValueError, match=r"t0\.exp_avg: no rank of one node holds"):
            plan_shards(snapshot_of(layout, rank), [[0, 1, 2, 3], [4, 5, 6, 7]], rank, 8)


@pytest.mark.parametrize("mesh", [(1,), (4,), (3, 5), (2, 3, 4)])
def test_counting_non_empty_shards_agrees_with_visiting_them(mesh) -> None:
    for shape in [(0,), (1,), (7,), (12, 5), (3, 1, 9)]:
        for placements in itertools.product(
            ["R", *(f"S{d}" for d in range(len(shape)))], repeat=len(mesh)
        ):
            regions = {
                region_at(shape, mesh, placements, c)
                for c in itertools.product(*(range(m) for m in mesh))
            }
            visited = sum(1 for _, size in regions if math.prod(size))
            assert nonempty_shards(shape, mesh, placements) == visited, (shape, placements)


def counted_plan(ranks: int, mesh, placements, domains) -> Counter:
    """The coordinates and regions one rank computes to plan its part of a save of 50
    sharded tensors on ``ranks`` ranks (its last rank, whose mesh position is last)."""
    calls: Counter = Counter()
    real_coordinate, real_region = MeshLayout.coordinate_at, shardwrite.region_at

    def coordinate_at(self, index):
        calls["coordinate"] += 1
        return real_coordinate(self, index)

    def region(*args):
        calls["region"] += 1
        return real_region(*args)

    layout = MeshLayout(mesh, tuple(range(ranks)), placements)
    rank = ranks - 1
    snapshot = snapshot_of(layout, rank, [(4096, 64)] * 25)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MeshLayout, "coordinate_at", coordinate_at)
        patch.setattr(shardwrite, "region_at", region)
        patch.setattr(ShardedTensor, "holders", lambda self: pytest.fail("visited every rank"))
        plan_shards(snapshot, domains(ranks), rank, ranks)
    return calls


@pytest.mark.parametrize(
    ("mesh", "placements", "domains"),
    [
        (lambda n: (n,), ("S0",), lambda n: [list(range(n))]),  # FSDP2, shared storage
        (lambda n: (n // 8, 8), ("R", "S0"), lambda n: [list(range(n))]),  # HSDP, shared
        (  # HSDP, a disk per node of 8 (one replica each)
            lambda n: (n // 8, 8),
            ("R", "S0"),
            lambda n: [list(range(i, i + 8)) for i in range(0, n, 8)],
        ),
    ],
    ids=["fsdp2-shared", "hsdp-shared", "hsdp-node-local"],
)
def test_planning_a_rank_s_shards_costs_the_same_at_16_and_4096_ranks(
    mesh, placements, domains
) -> None:
    """Every rank used to enumerate every shard of every tensor and sort them all (N·T
    regions and an N·T log(N·T) sort per rank and per storage domain, at every save)."""
    small = counted_plan(16, mesh(16), placements, domains)
    large = counted_plan(4096, mesh(4096), placements, domains)
    assert large == small, (small, large)
    # its own region of each tensor; with a disk per node, also each of its node's 8 ranks'
    # (checking that the node holds every shard), their coordinates found once per mesh;
    # and its place among its shard's replicas, once per mesh
    per_tensor = 1 if len(domains(16)) == 1 else 1 + 8
    assert large["region"] == 50 * per_tensor, large
    assert large["coordinate"] == 50 * per_tensor + (0 if per_tensor == 1 else 8) + 1, large


def test_a_sharded_tensor_s_fingerprint_does_not_list_the_ranks() -> None:
    """Ranks compare a digest of the mesh's rank order, not its N ranks per tensor."""
    layout = MeshLayout((4096,), tuple(reversed(range(4096))), ("S0",))
    fingerprint = ShardedTensor(torch.empty(1), (4096,), layout).fingerprint()
    assert len(json.dumps(fingerprint)) < 100, fingerprint  # the ranks listed: 20 kB
    other = MeshLayout((16,), tuple(range(16)), ("S0",))
    assert other.ranks.digest != MeshLayout((16,), tuple(reversed(range(16))), ("S0",)).ranks.digest


class FakeMesh:
    def __init__(self, ranks: int) -> None:
        self.read = 0
        self._mesh = torch.arange(ranks)

    @property
    def mesh(self) -> torch.Tensor:
        self.read += 1
        return self._mesh


def test_the_ranks_of_a_mesh_are_read_once_for_all_its_tensors() -> None:
    mesh = FakeMesh(4096)
    orders = [dtensor.rank_order(mesh) for _ in range(100)]
    assert mesh.read == 1 and all(order is orders[0] for order in orders)
    assert orders[0].covers_the_job and orders[0].position[4095] == 4095
    other = FakeMesh(4)
    assert dtensor.rank_order(other) is not orders[0] and other.read == 1
