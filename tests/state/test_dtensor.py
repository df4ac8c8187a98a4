"""Which part of a DTensor each rank holds: as DTensor itself computes it, for any mesh."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from ddpckpt._format.shardgrid import region_at
from ddpckpt._state.dtensor import placement_codes
from ddpckpt._state.sharded import MeshLayout, ShardedTensor
from ddpckpt.errors import UnsupportedValueError


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = tuple(
        draw(st.sampled_from(["R", *(f"S{d}" for d in range(len(shape)))])) for _ in mesh
    )
    return shape, mesh, placements


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_each_coordinate_holds_what_dtensor_says(case) -> None:
    shape, mesh, placements = case
    torch_placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in placements]
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        size, offset = _compute_local_shape_and_global_offset(
            shape, mesh, list(coordinate), torch_placements
        )
        offsets, sizes = region_at(shape, mesh, placements, coordinate)
        assert sizes == tuple(size)
        if all(sizes):  # where an empty shard "starts" differs and matters to nobody
            assert offsets == tuple(offset)


def test_replicas_are_grouped_and_empty_shards_left_out() -> None:
    # HSDP on a 2 x 2 mesh (replicate across rows, shard across columns); 3 rows in 2 shards
    layout = MeshLayout((2, 2), (0, 1, 2, 3), ("R", "S0"))
    assert layout.coordinate(3) == (1, 1)
    shard = ShardedTensor(local=None, shape=(3, 4), layout=layout)  # type: ignore[arg-type]
    assert dict(shard.holders()) == {((0, 0), (2, 4)): [0, 2], ((2, 0), (1, 4)): [1, 3]}
    one_row = ShardedTensor(local=None, shape=(1, 4), layout=layout)  # type: ignore[arg-type]
    assert dict(one_row.holders()) == {((0, 0), (1, 4)): [0, 2]}  # ranks 1 and 3 hold nothing


@pytest.mark.parametrize("ranks", [16, 4096])
def test_finding_the_holders_of_a_tensor_costs_one_coordinate_per_rank(monkeypatch, ranks) -> None:
    """HSDP over (ranks / 8) x 8, ranks listed out of order: every rank's region is found
    from its position, never by searching the mesh for the rank (N² steps at N ranks)."""
    order = tuple(reversed(range(ranks)))
    layout = MeshLayout((ranks // 8, 8), order, ("R", "S0"))
    calls = []
    real = MeshLayout.coordinate_at
    monkeypatch.setattr(
        MeshLayout, "coordinate_at", lambda self, i: calls.append(i) or real(self, i)
    )
    monkeypatch.setattr(MeshLayout, "coordinate", lambda self, rank: pytest.fail("searched"))
    shard = ShardedTensor(local=None, shape=(64, 4), layout=layout)  # type: ignore[arg-type]
    found = dict(shard.holders())
    assert len(calls) == ranks
    assert len(found) == 8 and all(len(held) == ranks // 8 for held in found.values())
    assert found[((0, 0), (8, 4))] == [order[i] for i in range(0, ranks, 8)]


class _Placed:
    """What the checks read of a DTensor: its placements and dimensions."""

    def __init__(self, *placements: object, ndim: int = 2) -> None:
        self.placements, self.ndim = placements, ndim


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (Partial(), "Partial placement: a reduction still pending"),
        (_StridedShard(0, split_factor=2), "_StridedShard placement: FSDP combined with tensor"),
        (_MaskPartial(), "_MaskPartial placement: a reduction still pending"),
    ],
)
def test_unsupported_placements_are_refused_naming_the_tensor(placement, message) -> None:
    with pytest.raises(UnsupportedValueError, match=f"^model/w: a DTensor with a {message}"):
        placement_codes("model/w", _Placed(Shard(1), placement))
    assert placement_codes("model/w", _Placed(Replicate(), Shard(-1))) == ("R", "S1")
