"""The ``ddpckpt`` command line: demo, bench, ls, inspect, verify, export, import, diff, clean.

Exit status (the same for every command, see ``_EXIT_STATUS``): 0 when it did its job and
found nothing wrong; 1 when it did its job and found problems or differences (``verify``,
``ls``: a corrupt or incomplete checkpoint; ``diff``: the checkpoints differ; ``demo``: the
resume was not exact); 2 when it cannot do its job (a wrong or missing input, an unreadable
or corrupt input to ``inspect``/``export``/``diff``, a missing optional dependency, a refused
pickle, a run directory locked by a live job). A closed output pipe (``| head``) ends it
quietly with status 141, as it does other Unix tools.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .errors import CheckpointError, CheckpointExistsError, CheckpointLockedError

__all__ = ["main"]

_EXIT_STATUS = """exit status:
  0  done, nothing wrong found
  1  done, and found problems or differences (verify, ls: a bad checkpoint; diff: they
     differ; demo, check-resume: the resume was not exact)
  2  cannot do its job (wrong or missing input, corrupt input to inspect/export/diff,
     missing optional dependency, run locked by a live job)
  141  the output pipe was closed early (`| head`); nothing is printed about it"""
_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a tool killed by the signal reports


class _CannotRun(Exception):
    """The command cannot do its job; the message says why, in command-line terms."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


# --------------------------------------------------------------------------- commands


def _inspect(args: argparse.Namespace) -> int:
    from .tools import summary

    info = summary(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    metrics = ", ".join(f"{k}={v}" for k, v in info["metrics"].items()) or "-"
    print(f"checkpoint  {info['path']}")
    print(f"step        {info['step']}    epoch {info['epoch']}    metrics {metrics}")
    print(f"created     {_when(info['created'])} on {info['host']}")
    print(
        f"written by  ddpckpt {info['library_version']} (format {info['format_version']}), "
        f"torch {info['torch_version']}, {info['world_size']} rank(s)"
    )
    copy = info["copy"]
    if copy.get("count", 1) > 1:
        print(f"copy        {copy['index'] + 1} of {copy['count']} (node-local storage)")
    print(
        f"size        {_size(info['bytes'])} in {info['files']} files, {len(info['tensors'])} tensors"
    )
    for name, kind in info["sections"].items():
        if name == "optimizer_groups":
            for i, group in enumerate(kind):
                hyper = ", ".join(f"{k}={v}" for k, v in group.items())
                print(f"  param group {i}: {hyper}")
        elif name == "extra":
            print(f"  extra: {', '.join(f'{k} ({v})' for k, v in kind.items())}")
        else:
            print(f"  {name}: {kind}")
    if not args.no_tensors:
        print()
        rows = [
            (t["name"], t["dtype"], list(t["shape"]), _size(t["bytes"]), t["file"])
            for t in info["tensors"]
        ]
        print(_table(("tensor", "dtype", "shape", "size", "file"), rows))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .checkpoint import find_problems
    from .errors import CheckpointNotFoundError
    from .tools import open_manifest

    status = 0
    for path in args.checkpoints:
        try:
            open_manifest(path)
        except CheckpointNotFoundError as exc:  # not a checkpoint at all: nothing to verify
            status = 2
            print(f"ERROR {path}\n      {exc}")
            continue
        except CheckpointError:
            pass  # incomplete or corrupt: find_problems says how
        problems = find_problems(path)
        if problems:
            status = max(status, 1)
            print(f"BAD   {path}")
            for problem in problems:
                print(f"      {problem}")
        else:
            print(f"OK    {path}")
    return status


def _export(args: argparse.Namespace) -> int:
    from .tools import export

    try:
        out = export(args.checkpoint, args.out, overwrite=args.overwrite)
    except FileExistsError:
        raise _CannotRun(f"{args.out} exists; pass --overwrite to replace it") from None
    print(f"wrote {out}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .legacy import import_checkpoint

    try:
        path, dropped = import_checkpoint(
            args.legacy,
            args.outdir,
            model_key=args.model_key,
            trusted_globals=args.trust_global,
            trusted_source=args.trusted_source,
            overwrite=args.overwrite,
        )
    except CheckpointExistsError:
        raise _CannotRun(
            f"{args.outdir}: a checkpoint already exists here; pass --overwrite to replace it, "
            "or name another output directory"
        ) from None
    print(f"imported {args.legacy} -> {path}")
    for item in dropped:
        print(f"  left out: {item}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .tools import diff

    ignore = [name for value in args.ignore for name in value.split(",") if name]
    report = diff(args.a, args.b, ignore=ignore, verify=not args.quick)
    for name, a, b in report.header:
        print(f"{name}: {a!r} -> {b!r}")
    for where, a, b in report.state[: args.limit]:
        print(f"{where}: {a!r} -> {b!r}")
    if len(report.state) > args.limit:
        print(f"... and {len(report.state) - args.limit} more state differences")
    if report.tensors:
        rows = [(t.name, t.status, t.detail) for t in report.tensors[: args.limit]]
        print(_table(("tensor", "difference", "detail"), rows))
        if len(report.tensors) > args.limit:
            print(f"... and {len(report.tensors) - args.limit} more tensors differ")
    how = "every byte verified" if report.verified else "by recorded checksum; data not read"
    print(
        f"{report.identical_tensors} tensors identical ({how}), {len(report.tensors)} differ, "
        f"{len(report.state) + len(report.header)} other differences"
    )
    sections = report.by_section()
    if sections:
        print("differences by section: " + ", ".join(f"{k} {v}" for k, v in sections.items()))
    if report.ignored:
        print("ignored: " + ", ".join(f"{k} ({v} differences)" for k, v in report.ignored.items()))
    if "rng" in sections:
        print(
            "(rng: random generator states differ, e.g. of unseeded Python/numpy generators; "
            "--ignore rng compares the rest)"
        )
    return 0 if report.same else 1


def _not_a_run_directory(directory: str) -> str | None:
    """Why ``directory`` cannot be listed as a run directory, or ``None`` if it can."""
    from .manifest import MANIFEST_NAME

    if not os.path.exists(directory):
        return f"{directory}: no such directory"
    if not os.path.isdir(directory):
        return f"{directory}: a file, not a run directory"
    if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        parent = os.path.dirname(os.path.abspath(directory))
        return (
            f"{directory}: a checkpoint, not a run directory: try `ddpckpt inspect {directory}`, "
            f"or `ddpckpt ls {parent}` for the run it belongs to"
        )
    return None


def _ls_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from .checkpoint import find_problems
    from .policies import KeepBest, Record, Union, retention_from
    from .rundir import read_latest, read_run_file, scan, size_problems

    entries = scan(args.directory)
    latest = read_latest(args.directory)
    policy = retention_from(read_run_file(args.directory).get("retention", {}))
    keepers = [policy] if isinstance(policy, KeepBest) else []
    if isinstance(policy, Union):
        keepers = [p for p in policy.policies if isinstance(p, KeepBest)]
    committed = [e for e in entries if e.status == "committed"]
    ranked: dict[int, str] = {}
    for keeper in keepers:
        best = keeper.best([Record(e.step, e.metrics) for e in committed])
        ranked.update({step: f"best #{i + 1} by {keeper.monitor}" for i, step in enumerate(best)})
    rows = []
    for entry in entries:
        manifest = entry.manifest
        if manifest is None:
            status, problems = entry.status, [entry.problem]
        elif args.quick:
            problems = size_problems(entry.path, manifest)
            status = "incomplete" if problems else "not verified"
        else:
            problems = find_problems(entry.path)
            status = "corrupt" if problems else "verified"
        notes = []
        if os.path.basename(entry.path) == latest:
            notes.append("latest")
        if entry.step in ranked:
            notes.append(ranked[entry.step])
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


def _ls(args: argparse.Namespace) -> int:
    from .rundir import find_leftovers

    wrong = _not_a_run_directory(args.directory)
    if wrong:
        raise _CannotRun(wrong)
    rows = _ls_rows(args)
    leftovers = find_leftovers(args.directory)
    if not rows and not leftovers and _looks_unrelated(args.directory):
        raise _CannotRun(
            f"{args.directory}: not a run directory: it has no step-N checkpoints, no `latest` "
            "and no run.json (a Checkpointer's directory has them)"
        )
    bad = any(row["status"] in ("corrupt", "incomplete") for row in rows)
    if args.json:
        doc = {
            "directory": args.directory,
            "verified": not args.quick,
            "checkpoints": rows,
            "leftovers": [{"name": x.name, "kind": x.kind, "bytes": x.nbytes} for x in leftovers],
        }
        print(json.dumps(doc, indent=1))
        return 1 if bad else 0
    table = []
    for row in rows:
        status = row["status"]
        if row["problems"]:
            status = f"{status.upper()}: {row['problems'][0]}"
        metrics = ", ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row["metrics"].items()
        )
        created, nbytes = row["created"], row["bytes"]
        table.append(
            (
                row["step"],
                _when(created) if created is not None else "-",
                _size(nbytes) if nbytes is not None else "-",
                status,
                metrics or "-",
                ", ".join(row["notes"]),
            )
        )
    if table:
        print(_table(("step", "created", "size", "status", "metrics", "notes"), table))
        if args.quick:
            print(
                "not verified: --quick checked manifests and file sizes only, not the data; "
                f"`ddpckpt ls {args.directory}` checks every byte"
            )
    else:
        print(f"no checkpoints in {args.directory}")
    if leftovers:
        _print_leftovers(args.directory, leftovers)
    return 1 if bad else 0


def _looks_unrelated(directory: str) -> bool:
    from .rundir import LATEST, RUN_FILE
    from .runlock import LOCK_NAME

    names = set(os.listdir(directory))
    return bool(names) and not names & {LATEST, RUN_FILE, LOCK_NAME}


def _print_leftovers(directory: str, leftovers: Sequence[Any]) -> None:
    what = {
        "temporary": "temporary: a save in progress, or left by a crash",
        "corrupt": "moved aside as corrupt by resume(); never loaded",
    }
    total = sum(x.nbytes for x in leftovers)
    print(f"\nleftovers, not checkpoints ({_size(total)}):")
    print(
        _table(
            ("name", "size", "what"), [(x.name, _size(x.nbytes), what[x.kind]) for x in leftovers]
        )
    )
    hint = f"`ddpckpt clean {directory}` removes the temporaries once no job writes here"
    if any(x.kind == "corrupt" for x in leftovers):
        hint += "; add --corrupt to remove the moved-aside checkpoints too"
    print(hint)


def _clean(args: argparse.Namespace) -> int:
    from .rundir import clean_leftovers, find_leftovers

    wrong = _not_a_run_directory(args.directory)
    if wrong:
        raise _CannotRun(wrong)
    if args.dry_run:
        doomed = [
            x for x in find_leftovers(args.directory) if x.kind == "temporary" or args.corrupt
        ]
    else:
        try:
            doomed = clean_leftovers(args.directory, corrupt=args.corrupt)
        except CheckpointLockedError as exc:
            raise _CannotRun(
                f"{exc}. Its temporaries may be saves in progress: run `ddpckpt clean` after "
                "that job has ended"
            ) from None
    verb = "would remove" if args.dry_run else "removed"
    for leftover in doomed:
        print(f"{verb} {leftover.name} ({_size(leftover.nbytes)})")
    kept = [x for x in find_leftovers(args.directory) if x.kind == "corrupt" and not args.corrupt]
    if not doomed:
        print(f"nothing to clean in {args.directory}")
    else:
        print(f"{verb} {len(doomed)} leftover(s), {_size(sum(x.nbytes for x in doomed))}")
    if kept:
        print(f"left {len(kept)} checkpoint(s) moved aside as corrupt; --corrupt removes them")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import check_options, default_every, format_report, run_demo

    every = args.every if args.every is not None else default_every(args.steps)
    try:
        check_options(nproc=args.nproc, steps=args.steps, every=every, kill_at=args.kill_at)
    except ValueError as exc:
        raise _CannotRun(str(exc)) from None
    print(
        f"running the demo in {args.out} (two DDP trainings under torchrun; about a minute) ...",
        flush=True,
    )
    report = run_demo(
        args.out, nproc=args.nproc, steps=args.steps, every=every, kill_at=args.kill_at
    )
    print(format_report(report))
    return 0 if report.identical else 1


_BENCH_NEEDS = {"safetensors": "to compare against it", "matplotlib": "for results.png"}


def _bench(args: argparse.Namespace) -> int:
    missing = [name for name in _BENCH_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        needs = " and ".join(f"{name} ({_BENCH_NEEDS[name]})" for name in missing)
        raise _CannotRun(f"the benchmark needs {needs}: pip install 'ddpckpt[bench]'")
    nprocs = None
    if args.nproc:
        try:
            nprocs = tuple(int(n) for n in args.nproc.split(","))
        except ValueError:
            raise _CannotRun(f"--nproc {args.nproc}: give world sizes like 1,2") from None
    sizes = {"--nproc": min(nprocs or (1,)), "--params": args.params, "--every": args.every,
             "--steps": args.steps, "--repeat": args.repeat}  # fmt: skip
    too_small = [flag for flag, value in sizes.items() if value is not None and value < 1]
    if too_small:
        raise _CannotRun(f"{', '.join(too_small)} must be at least 1")
    if args.every is not None and args.steps is not None and args.every > args.steps:
        raise _CannotRun(f"--every {args.every} is more than --steps {args.steps}")
    from .bench import format_markdown, run_bench

    print(f"benchmarking in {args.out}; this takes minutes ...", flush=True)
    report = run_bench(
        args.out, directory=args.dir, nprocs=nprocs, params=args.params, every=args.every,
        steps=args.steps, compute=args.compute, repeat=args.repeat, device=args.device,
    )  # fmt: skip
    print(format_markdown(report))
    print(f"results: {os.path.join(os.path.abspath(args.out), 'results.md')} (.json, .png)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpckpt",
        description="Inspect, verify, export, import, compare and clean checkpoints.",
        epilog=_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddpckpt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("inspect", help="show a checkpoint's metadata and tensors")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-tensors", action="store_true", help="omit the tensor table")
    p.set_defaults(run=_inspect)

    p = commands.add_parser(
        "demo", help="crash a DDP run, resume it, prove the resume bit-identical"
    )
    p.add_argument("--out", default="demo-output", help="output directory (default demo-output)")
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks (default 2; gloo on CPU, NCCL with GPUs)"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument(
        "--every", type=int, default=None, help="checkpoint every N steps (default 20, or steps/4)"
    )
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step")
    p.set_defaults(run=_demo)

    from .resumecheck.command import add_parser as add_check_resume

    add_check_resume(commands)

    p = commands.add_parser(
        "bench", help="measure checkpointing against torch.save, DCP and the hardware"
    )
    p.add_argument("--out", default="bench-output", help="output directory (default bench-output)")
    p.add_argument(
        "--dir", default=None, help="where checkpoints are written (default OUT/checkpoints)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the training state lives (default cuda when a GPU is present)",
    )
    p.add_argument(
        "--nproc",
        default=None,
        help="world sizes to run, comma-separated (default 1,2; on one GPU 1)",
    )
    p.add_argument(
        "--params",
        type=int,
        default=None,
        help="fp32 parameters (default CPU 100M: 1.2 GB with AdamW; GPU 335M: 4.03 GB)",
    )
    p.add_argument(
        "--every",
        type=int,
        default=None,
        help="checkpoint interval of the training loop (default CPU 20, GPU 50)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="steps of the training loop (default 60, GPU 150)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="saves and loads per method; medians reported"
    )
    p.add_argument(
        "--compute",
        type=float,
        default=None,
        help="seconds of compute per training step (default CPU 0.2, GPU 0.12)",
    )
    p.set_defaults(run=_bench)

    p = commands.add_parser(
        "ls", help="list a run directory's checkpoints and leftovers (exit 1 if any is bad)"
    )
    p.add_argument("directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="check manifests and file sizes only: the data is not verified",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (numbers)")
    p.set_defaults(run=_ls)

    p = commands.add_parser(
        "clean", help="remove a run's leftover temporaries (refused while a job holds its lock)"
    )
    p.add_argument("directory")
    p.add_argument(
        "--corrupt", action="store_true", help="also remove checkpoints moved aside as corrupt"
    )
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(run=_clean)

    p = commands.add_parser("verify", help="check every file against its checksums (exit 1 if bad)")
    p.add_argument("checkpoints", nargs="+")
    p.set_defaults(run=_verify)

    p = commands.add_parser("export", help="write the model weights to OUT.safetensors or OUT.pt")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(run=_export)

    p = commands.add_parser(
        "import", help="convert a torch.save / Lightning file (no pickle code runs)"
    )
    p.add_argument("legacy")
    p.add_argument("outdir")
    p.add_argument("--model-key", help="the entry holding the model weights, if not detected")
    p.add_argument(
        "--trust-global",
        action="append",
        default=[],
        metavar="MODULE.NAME",
        help="allow unpickling this plain data class (repeatable); never a function",
    )
    p.add_argument(
        "--trusted-source",
        action="store_true",
        help="allow importing with a torch whose weights_only loader has known bypasses",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(run=_import)

    p = commands.add_parser(
        "diff",
        help="which tensors and values differ (exit 1 if any)",
        description="Compare two checkpoints: header (step, epoch, metrics, world size), "
        "non-tensor state and every tensor. Both are verified first (a corrupt one is an "
        "error, exit 2). Everything is compared by default, RNG states included: two runs "
        "that did not seed Python's or numpy's generators differ there; --ignore rng "
        "compares the rest.",
    )
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="SECTION",
        help="only count differences in SECTION (repeatable or comma-separated): rng, step, "
        "epoch, metrics, world_size, model, optimizer, scheduler, scaler, extra, extra/NAME",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="trust the recorded checksums instead of verifying both (reads less; a file "
        "damaged since it was written can compare as identical)",
    )
    p.add_argument("--limit", type=int, default=50, help="rows to show per kind (default 50)")
    p.set_defaults(run=_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see ``_EXIT_STATUS``)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # so the flush at exit cannot fail again
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"ddpckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except (_CannotRun, CheckpointError, OSError, ValueError, RuntimeError, ImportError) as exc:
        print(f"ddpckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
