"""The load's read planner: any region of a sharded tensor, assembled from the pieces that
tile it, reading whole chunks of rows and nothing outside the pieces that overlap it."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpckpt._format.reshard import overlap, plan_reads


def _cuts(draw, extent: int) -> list[tuple[int, int]]:
    """A split of ``range(extent)`` into consecutive non-empty intervals (offset, length)."""
    points = sorted(draw(st.sets(st.integers(1, max(extent - 1, 1)), max_size=3)) - {extent})
    edges = [0, *points, extent]
    return [(a, b - a) for a, b in itertools.pairwise(edges) if b > a]


@st.composite
def tiled(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
    grids = [_cuts(draw, n) for n in shape]
    pieces = [((), ())] if not shape else []
    if shape:
        for cell in itertools.product(*grids):
            pieces.append((tuple(c[0] for c in cell), tuple(c[1] for c in cell)))
    starts = [draw(st.integers(0, n - 1)) for n in shape]
    sizes = [draw(st.integers(1, n - s)) for n, s in zip(shape, starts, strict=True)]
    return shape, pieces, (tuple(starts), tuple(sizes))


@settings(max_examples=200, deadline=None)
@given(tiled(), st.sampled_from([1, 4, 8, 64]), st.sampled_from([1, 8, 40, 1 << 20]))
def test_any_region_is_assembled_from_the_pieces(case, chunk, budget) -> None:
    shape, pieces, region = case
    whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    stored = [whole[tuple(slice(o, o + n) for o, n in zip(*p, strict=True))].contiguous()
              for p in pieces]  # fmt: skip
    target = torch.full(region[1], -1.0, dtype=torch.float64)
    read_pieces = set()
    for read in plan_reads(pieces, region, itemsize=8, chunk=chunk, budget=budget):
        piece = stored[read.piece]
        raw = piece.reshape(-1).view(torch.uint8)
        first, last = read.chunks
        data = raw[first * chunk : last * chunk]  # what the ranged read returns
        row = math.prod(piece.shape[1:]) * 8
        start = read.rows[0] * row - first * chunk
        count = read.rows[1] - read.rows[0]
        assert start >= 0 and start + count * row <= len(data)  # the chunks hold the rows
        assert count == 1 or count * row <= budget
        rows = data[start : start + count * row].view(torch.float64)
        rows = rows.reshape((count, *piece.shape[1:]) if piece.shape else ())
        target[read.target] = rows[read.source]
        read_pieces.add(read.piece)
    assert torch.equal(target, whole[tuple(slice(o, o + n) for o, n in zip(*region, strict=True))])
    assert read_pieces == {i for i, p in enumerate(pieces) if overlap(p, region) is not None}


def test_a_slice_of_one_shard_reads_only_the_chunks_around_it() -> None:
    # 2 shards of 100 rows x 1 KiB, 4 KiB chunks: rows 10..19 of the first lie in chunks 2..4
    pieces = [((0, 0), (100, 256)), ((100, 0), (100, 256))]
    reads = plan_reads(pieces, ((10, 0), (10, 256)), itemsize=4, chunk=4096)
    assert [(r.piece, r.rows, r.chunks) for r in reads] == [(0, (10, 20), (2, 5))]
