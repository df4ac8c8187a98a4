"""Plain-text formatting shared by the commands: sizes, times, tables, and the leftovers
of a directory ``ddpckpt ls`` lists."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], first_at_most: int = 60) -> str:
    """Rows under their headers, columns aligned. A first cell longer than
    ``first_at_most`` (a deeply nested tensor name) gets a line of its own, the row's
    other cells under it, so that one long name does not widen every row."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    widths[0] = max(len(row[0]) for row in cells if len(row[0]) <= first_at_most or row is cells[0])
    lines = []
    for row in cells:
        if len(row[0]) > widths[0]:
            lines.append(row[0])
            row = ["", *row[1:]]
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def leftovers_table(directory: str, leftovers: Sequence[Any]) -> str:
    """The leftovers table of ``ddpckpt ls`` (``leftovers``: the
    :class:`~ddpckpt._run.rundir.Leftover` of ``directory``) and what ``ddpckpt clean``
    would do with them."""
    what = {
        "temporary": "temporary: a save in progress, or left by a crash",
        "corrupt": "moved aside as corrupt by resume(); never loaded",
    }
    rows = [(x.name, size(x.nbytes), what[x.kind]) for x in leftovers]
    hint = f"`ddpckpt clean {directory}` removes the temporaries once no job writes here"
    if any(x.kind == "corrupt" for x in leftovers):
        hint += "; add --corrupt to remove the moved-aside checkpoints too"
    total = size(sum(x.nbytes for x in leftovers))
    return (
        f"\nleftovers, not checkpoints ({total}):\n{table(('name', 'size', 'what'), rows)}\n{hint}"
    )
