"""``ddpckpt ls`` of a directory of checkpoints that is no Checkpointer's run directory: a
save loop's ``ckpt/step-{step}``, Lightning's ``checkpoints/``, a Trainer's ``output_dir``
(read by :mod:`ddpckpt._run.savesdir`), with the checkpoint ``ddpckpt.load_latest`` loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ddpckpt._cli._format import leftovers_table, size, table, when
from ddpckpt.storage._location import Location

_PICK_NOTE = "load_latest"


@dataclass(frozen=True)
class _Row:
    """One checkpoint as listed: its status after the check asked for, its problems."""

    name: str
    path: str
    step: int | None
    created: float | None
    nbytes: int | None
    status: str
    problems: list[str]
    metrics: dict[str, Any]

    def as_dict(self, picked: bool) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "path": self.path,
            "created": self.created,
            "bytes": self.nbytes,
            "status": self.status,
            "problems": self.problems,
            "metrics": self.metrics,
            "notes": [_PICK_NOTE] if picked else [],
        }


def ls_saves(where: Location, *, quick: bool, as_json: bool) -> int:
    """Print the checkpoints in ``directory`` oldest first (by saved step, as
    ``load_latest`` ranks them), each verified unless ``quick``, and which one
    ``ddpckpt.load_latest(directory)`` would load; 1 if any is damaged, else 0."""
    from ddpckpt._run.rundir import find_leftovers
    from ddpckpt._run.savesdir import list_saves

    directory = where.path
    listing = list_saves(where)
    rows = [_row(entry, quick) for entry in listing.checkpoints]
    by_name = {row.name: row for row in rows}
    usable = ("not verified",) if quick else ("verified",)
    picked = next((n for n in listing.newest_first if by_name[n].status in usable), None)
    leftovers = find_leftovers(where)
    bad = any(row.status in ("corrupt", "incomplete") for row in rows)
    if as_json:
        doc = {
            "directory": directory,
            "kind": "checkpoints",
            "verified": not quick,
            "checkpoints": [row.as_dict(row.name == picked) for row in rows],
            "load_latest": by_name[picked].path if picked else None,
            "others": listing.others,
            "leftovers": [{"name": x.name, "kind": x.kind, "bytes": x.nbytes} for x in leftovers],
        }
        print(json.dumps(doc, indent=1))
        return 1 if bad else 0
    print(
        f"{directory}: checkpoints saved with ddpckpt.save (not a Checkpointer's run "
        "directory), by the step each was saved with"
    )
    print(table(("checkpoint", "step", "created", "size", "status", "metrics", "notes"),
                [_line(row, row.name == picked) for row in rows]))  # fmt: skip
    if quick:
        print(
            "not verified: --quick checked manifests and file sizes only, not the data; "
            f"`ddpckpt ls {directory}` checks every byte"
        )
    print(_pick_sentence(directory, listing.newest_first, by_name, picked, quick))
    if listing.others:
        print(f"also here, not checkpoints (nothing loads them): {', '.join(listing.others)}")
    if leftovers:
        print(leftovers_table(directory, leftovers))
    return 1 if bad else 0


def _row(entry: Any, quick: bool) -> _Row:
    """``entry`` (a :class:`~ddpckpt._run.savesdir.SavedCheckpoint`) checked: every byte,
    or with ``quick`` only what ``load_latest``'s listing already checked (sizes)."""
    from ddpckpt._io.reader import find_problems

    manifest = entry.manifest
    problems = [entry.problem] if entry.problem else []
    status = entry.status
    if status == "committed":
        problems = [] if quick else find_problems(entry.location)
        status = "not verified" if quick else ("corrupt" if problems else "verified")
    return _Row(
        entry.name,
        entry.path,
        entry.step,
        manifest.created if manifest else None,
        manifest.nbytes if manifest else None,
        status,
        problems,
        entry.metrics,
    )


def _line(row: _Row, picked: bool) -> tuple[Any, ...]:
    status = f"{row.status.upper()}: {row.problems[0]}" if row.problems else row.status
    metrics = ", ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.metrics.items()
    )
    return (
        row.name,
        row.step if row.step is not None else "-",
        when(row.created) if row.created is not None else "-",
        size(row.nbytes) if row.nbytes is not None else "-",
        status,
        metrics or "-",
        _PICK_NOTE if picked else "",
    )


def _pick_sentence(
    directory: str, order: list[str], rows: dict[str, _Row], picked: str | None, quick: bool
) -> str:
    """What ``ddpckpt.load_latest(directory)`` does with what was listed."""
    call = f"ddpckpt.load_latest({directory!r})"
    if picked is None and not order:
        return f"{call} finds no committed checkpoint here: it returns None (a fresh start)"
    if picked is None:
        return (
            f"{call} raises CorruptCheckpointError: none of the checkpoints it would try "
            f"({', '.join(order)}) verifies"
        )
    row = rows[picked]
    step = f" (step {row.step})" if row.step is not None else " (saved without a step)"
    skipped = order[: order.index(picked)]
    after = f", after skipping the damaged {', '.join(skipped)}" if skipped else ""
    if quick:
        return (
            f"{call} loads {row.path}{step}: the newest by saved step{after}, if its data "
            "verifies (--quick did not read it; the next newest otherwise)"
        )
    return f"{call} loads {row.path}{step}: the newest by saved step that verifies{after}"
