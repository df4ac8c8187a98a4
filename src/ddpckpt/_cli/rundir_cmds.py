"""Commands on a run directory (a ``Checkpointer``'s): ``ls`` and ``clean``; ``ls`` also
lists any directory of checkpoints (:mod:`ddpckpt._cli.saves_ls`)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ddpckpt._cli._format import leftovers_table, size, table, when
from ddpckpt._cli.command import CannotRun, Command
from ddpckpt.errors import CheckpointLockedError
from ddpckpt.storage._location import Location, locate


def _not_a_run_directory(where: Location) -> str | None:
    """Why ``where`` cannot be listed as a run directory, or ``None`` if it can."""
    from ddpckpt._format.manifest import MANIFEST_NAME

    storage, directory = where.storage, where.path
    if not storage.exists(directory):
        return f"{directory}: no such directory"
    if not storage.is_dir(directory):
        return f"{directory}: a file, not a run directory"
    if storage.exists(os.path.join(directory, MANIFEST_NAME)):
        parent = storage.parent(directory)
        return (
            f"{directory}: a checkpoint, not a run directory: try `ddpckpt inspect {directory}`, "
            f"or `ddpckpt ls {parent}` for the run it belongs to"
        )
    return None


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "directory",
        help="a run directory (a Checkpointer's) or any directory of checkpoints (ckpt/ of "
        "ddpckpt.save, Lightning's checkpoints/, a Trainer's output_dir), local or s3://",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="check manifests and file sizes only: the data is not verified",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (numbers)")


def _ls_rows(where: Location, quick: bool) -> list[dict[str, Any]]:
    from ddpckpt._io.reader import find_problems
    from ddpckpt._run import query
    from ddpckpt._run.rundir import size_problems

    latest = query.latest_name(where)
    why_kept = query.why_kept(where)
    rows = []
    for entry in query.entries(where):
        manifest = entry.manifest
        if manifest is None and not where.storage.exists(entry.path):
            # Not a checkpoint: gone since the listing, or a prefix holding only objects
            # skipped for their names (each warned about by the storage, and left alone).
            continue
        if manifest is None:
            status, problems = entry.status, [entry.problem]
        elif quick:
            problems = size_problems(entry.location, manifest)
            status = "incomplete" if problems else "not verified"
        else:
            problems = find_problems(entry.location)
            status = "corrupt" if problems else "verified"
        notes = []
        if os.path.basename(entry.path) == latest:
            notes.append("latest")
        if entry.step in why_kept:
            notes.append(why_kept[entry.step])
        rows.append(
            {
                "step": entry.step,
                "path": entry.path,
                "created": manifest.created if manifest else None,
                "bytes": manifest.nbytes if manifest else None,
                "status": status,
                "problems": problems,
                "metrics": entry.metrics,
                "notes": notes,
            }
        )
    return rows


def _fast_tier(where: Location) -> tuple[bool, str | None]:
    """Whether the run in ``directory`` has a fast tier (its identity file), and, if
    ``directory`` is a fast tier, the run directory it belongs to (as its marker says,
    read through the same parser as the Checkpointer's)."""
    from ddpckpt._format.runfiles import RUN_DIR_IDENTITY, read_fast_tier_marker
    from ddpckpt.errors import CorruptCheckpointError

    has_tier = where.storage.exists(where.join(RUN_DIR_IDENTITY).path)
    try:
        marker = read_fast_tier_marker(where)
    except CorruptCheckpointError as exc:
        return has_tier, f"(unreadable: {exc})"
    except OSError as exc:
        return has_tier, f"(unreadable: {exc.strerror or exc})"
    if marker is None:
        return has_tier, None
    run = marker.run_directory  # "<run directory>#<random token>"
    return has_tier, run if run.isprintable() else ascii(run)


def _fast_tier_notes(where: Location, has_tier: bool, tier_of: str | None) -> list[str]:
    """What to tell about the fast tier of the run listed, or that it is one."""
    directory = where.path
    notes = []
    if tier_of is not None:
        notes.append(
            f"{directory} is a fast tier (one node's copy, in memory) of the run directory "
            f"{tier_of}: resume() restores its newest step when newer than the run's; "
            f"`ddpckpt ls {tier_of}` lists the durable checkpoints"
        )
    if has_tier:
        auto = _auto_directory(where)
        notes.append(
            "this run also has a fast tier, in each node's memory, whose steps may be newer "
            "than those listed: `ddpckpt ls <fast_tier directory>` on a node lists them"
            + (f" (with fast_tier='auto', {auto}, this user's)" if auto else "")
            + "; resume() restores the newest of either"
        )
    return notes


def _auto_directory(directory: Location) -> str | None:
    """Where ``fast_tier="auto"`` keeps the fast tier of the run ``directory`` for this
    user (from the run's identity), or ``None`` if that cannot be read."""
    from ddpckpt._format.runfiles import read_run_identity
    from ddpckpt._run.options import auto_directory
    from ddpckpt.errors import CorruptCheckpointError

    try:
        identity = read_run_identity(directory)
    except (CorruptCheckpointError, OSError):  # said by the fast tier itself when it is used
        return None
    return auto_directory(identity) if identity is not None else None


def _ls(args: argparse.Namespace) -> int:
    from ddpckpt._run.rundir import find_leftovers, restore_unless_locked
    from ddpckpt._run.savesdir import holds_saves, is_run_layout

    where = locate(args.directory)
    wrong = _not_a_run_directory(where)
    if wrong:
        raise CannotRun(wrong)
    names = where.storage.list(where.path)
    if not is_run_layout(names) and holds_saves(where, names):
        from ddpckpt._cli.saves_ls import ls_saves

        return ls_saves(where, quick=args.quick, as_json=args.json)
    restore_unless_locked(where, names)
    rows = _ls_rows(where, args.quick)
    leftovers = find_leftovers(where)
    has_tier, tier_of = _fast_tier(where)
    if not rows and not leftovers and _looks_unrelated(names):
        raise CannotRun(
            f"{args.directory}: not a run directory: it has no step-N checkpoints, no `latest` "
            "and no run.json (a Checkpointer's directory has them), and no checkpoint saved "
            "with ddpckpt.save directly inside it"
        )
    bad = any(row["status"] in ("corrupt", "incomplete") for row in rows)
    if args.json:
        doc = {
            "directory": args.directory,
            "kind": "run",
            "verified": not args.quick,
            "checkpoints": rows,
            "leftovers": [{"name": x.name, "kind": x.kind, "bytes": x.nbytes} for x in leftovers],
            "has_fast_tier": has_tier,
            "fast_tier_of": tier_of,
        }
        print(json.dumps(doc, indent=1))
        return 1 if bad else 0
    lines = []
    for row in rows:
        status = row["status"]
        if row["problems"]:
            status = f"{status.upper()}: {row['problems'][0]}"
        metrics = ", ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row["metrics"].items()
        )
        created, nbytes = row["created"], row["bytes"]
        lines.append(
            (
                row["step"],
                when(created) if created is not None else "-",
                size(nbytes) if nbytes is not None else "-",
                status,
                metrics or "-",
                ", ".join(row["notes"]),
            )
        )
    if lines:
        print(table(("step", "created", "size", "status", "metrics", "notes"), lines))
        if args.quick:
            print(
                "not verified: --quick checked manifests and file sizes only, not the data; "
                f"`ddpckpt ls {args.directory}` checks every byte"
            )
    else:
        print(f"no checkpoints in {args.directory}")
    for note in _fast_tier_notes(where, has_tier, tier_of):
        print(note)
    if leftovers:
        print(leftovers_table(args.directory, leftovers))
    return 1 if bad else 0


def _looks_unrelated(names: list[str]) -> bool:
    """Whether a directory listed as ``names`` holds files, none of them a run's."""
    from ddpckpt._format.runfiles import RUN_MARKS

    return bool(names) and not set(names) & RUN_MARKS


def _clean_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a run directory (a Checkpointer's), local or s3://")
    p.add_argument(
        "--corrupt", action="store_true", help="also remove checkpoints moved aside as corrupt"
    )
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")


def _clean(args: argparse.Namespace) -> int:
    from ddpckpt._run.rundir import clean_leftovers, find_leftovers

    where = locate(args.directory)
    wrong = _not_a_run_directory(where)
    if wrong:
        raise CannotRun(wrong)
    if args.dry_run:
        doomed = [x for x in find_leftovers(where) if x.kind == "temporary" or args.corrupt]
    else:
        try:
            doomed = clean_leftovers(where, corrupt=args.corrupt)
        except CheckpointLockedError as exc:
            raise CannotRun(
                f"{exc}. Its temporaries may be saves in progress: run `ddpckpt clean` after "
                "that job has ended"
            ) from None
    verb = "would remove" if args.dry_run else "removed"
    for leftover in doomed:
        print(f"{verb} {leftover.name} ({size(leftover.nbytes)})")
    kept = [x for x in find_leftovers(where) if x.kind == "corrupt" and not args.corrupt]
    if not doomed:
        print(f"nothing to clean in {args.directory}")
    else:
        print(f"{verb} {len(doomed)} leftover(s), {size(sum(x.nbytes for x in doomed))}")
    if kept:
        print(f"left {len(kept)} checkpoint(s) moved aside as corrupt; --corrupt removes them")
    return 0


LS = Command(
    "ls",
    "list a directory's checkpoints and leftovers (exit 1 if any is bad)",
    _ls_arguments,
    _ls,
    description="List a run directory's checkpoints: step, time, size, metrics, whether "
    "each verifies (corrupt, incomplete), which one 'latest' names and which are kept as "
    "best; then leftovers of interrupted saves and checkpoints moved aside, with sizes. "
    "A directory of checkpoints saved with ddpckpt.save (or Lightning's or a Trainer's) "
    "is listed by saved step, with the one ddpckpt.load_latest would load.",
)
CLEAN = Command(
    "clean",
    "remove a run's leftover temporaries (refused while a job holds its lock)",
    _clean_arguments,
    _clean,
    description="Remove what interrupted saves left in a run directory (temporaries). "
    "Refused while a live job holds the run's lock. Committed checkpoints are never "
    "touched; --corrupt also removes the ones resume() moved aside as damaged.",
)
