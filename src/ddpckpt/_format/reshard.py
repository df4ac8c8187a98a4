"""Which bytes a rank reads to assemble its part of a sharded tensor: the load's planner.

A sharded tensor is stored as pieces that tile it (:mod:`ddpckpt._format.shards`); a
loading rank needs one region of it (its local shard under the live mesh and placements,
or the whole tensor for a plain model), whatever mesh and world size it was saved with.
:func:`plan_reads` lists, for that region, the reads to make: for every piece that
overlaps it, runs of the piece's rows (its first dimension, along which its bytes are
contiguous), each no larger than a budget, widened to whole chunks so that every byte used
is verified against its chunk digest. A read names the slice of those rows to take and
where it goes in the region.

Pure functions of shapes and offsets: every rank plans its own reads without talking to
any other, and the planner is tested apart from any file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

READ_BUDGET = 32 << 20  # bytes of rows one read holds, at most (beyond one row)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in the global tensor


@dataclass(frozen=True)
class Read:
    """One ranged read of a piece, and what to do with its bytes.

    The piece's rows ``rows`` (relative to the piece) lie in chunks ``chunks``
    (``[first, last)``); viewed as a tensor of shape ``(rows, *piece shape[1:])``, its
    ``source`` slice is copied to the ``target`` slice of the region.
    """

    piece: int
    rows: tuple[int, int]
    chunks: tuple[int, int]
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def overlap(a: Box, b: Box) -> Box | None:
    """The box where ``a`` and ``b`` meet, or ``None``."""
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    ends = tuple(
        min(xo + xs, yo + ys) for xo, xs, yo, ys in zip(a[0], a[1], b[0], b[1], strict=True)
    )
    if any(e <= s for s, e in zip(starts, ends, strict=True)):
        return None
    return starts, tuple(e - s for s, e in zip(starts, ends, strict=True))


def plan_reads(
    pieces: Sequence[Box],
    region: Box,
    *,
    itemsize: int,
    chunk: int,
    budget: int = READ_BUDGET,
) -> list[Read]:
    """The reads that fill ``region`` from ``pieces`` (see the module docstring).

    ``pieces`` tile the tensor; ``itemsize`` is the bytes of one element, ``chunk`` the
    bytes each chunk digest covers. A read holds at most ``budget`` bytes of rows, or one
    row where a row is larger; reads of a piece come in row order.
    """
    reads = []
    for index, piece in enumerate(pieces):
        met = overlap(piece, region)
        if met is None:
            continue
        (p_off, p_shape), (m_off, m_shape), r_off = piece, met, region[0]
        if not p_shape:  # a 0-d tensor: one row of one element
            reads.append(Read(index, (0, 1), (0, -(-itemsize // chunk)), (), ()))
            continue
        row_bytes = math.prod(p_shape[1:]) * itemsize
        first, last = m_off[0] - p_off[0], m_off[0] + m_shape[0] - p_off[0]
        step = max(1, budget // row_bytes)
        inner_source = tuple(
            slice(m - p, m - p + s)
            for m, p, s in zip(m_off[1:], p_off[1:], m_shape[1:], strict=True)
        )
        inner_target = tuple(
            slice(m - r, m - r + s)
            for m, r, s in zip(m_off[1:], r_off[1:], m_shape[1:], strict=True)
        )
        for start in range(first, last, step):
            stop = min(start + step, last)
            chunks = (start * row_bytes // chunk, -(-stop * row_bytes // chunk))
            at = start + p_off[0] - r_off[0]
            reads.append(
                Read(
                    index,
                    (start, stop),
                    chunks,
                    (slice(0, stop - start), *inner_source),
                    (slice(at, at + stop - start), *inner_target),
                )
            )
    return reads
