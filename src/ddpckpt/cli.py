"""The ``ddpckpt`` command line: demo, bench, ls, inspect, verify, export, import, diff.

Exit status: 0 on success; ``verify`` and ``ls`` exit 1 when anything is bad; ``diff`` exits 1
when the checkpoints differ; any command exits 2 when it cannot do its job (a missing
checkpoint, an unreadable file, a refused pickle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .errors import CheckpointError

__all__ = ["main"]


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

    status = 0
    for path in args.checkpoints:
        problems = find_problems(path)
        if problems:
            status = 1
            print(f"BAD  {path}")
            for problem in problems:
                print(f"     {problem}")
        else:
            print(f"OK   {path}")
    return status


def _export(args: argparse.Namespace) -> int:
    from .tools import export

    out = export(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .legacy import import_checkpoint

    path, dropped = import_checkpoint(
        args.legacy,
        args.outdir,
        model_key=args.model_key,
        trusted_globals=args.trust_global,
        trusted_source=args.trusted_source,
        overwrite=args.overwrite,
    )
    print(f"imported {args.legacy} -> {path}")
    for item in dropped:
        print(f"  left out: {item}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .tools import diff

    report = diff(args.a, args.b)
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
    print(
        f"{report.identical_tensors} tensors identical, {len(report.tensors)} differ, "
        f"{len(report.state) + len(report.header)} other differences"
    )
    return 0 if report.same else 1


def _ls(args: argparse.Namespace) -> int:
    from .checkpoint import find_problems
    from .policies import KeepBest, Record, Union, retention_from
    from .rundir import read_latest, read_run_file, scan

    if not os.path.isdir(args.directory):
        raise FileNotFoundError(f"{args.directory}: no such directory")
    entries = scan(args.directory)
    latest = read_latest(args.directory)
    policy = retention_from(read_run_file(args.directory).get("retention", {}))
    keepers = [policy] if isinstance(policy, KeepBest) else []
    if isinstance(policy, Union):
        keepers = [p for p in policy.policies if isinstance(p, KeepBest)]
    committed = [e for e in entries if e.status == "committed"]
    ranked = {}
    for keeper in keepers:
        best = keeper.best([Record(e.step, e.metrics) for e in committed])
        ranked.update({step: f"best #{i + 1} by {keeper.monitor}" for i, step in enumerate(best)})
    rows = []
    for entry in entries:
        manifest = entry.manifest
        status = entry.status
        if status == "committed" and not args.quick:
            problems = find_problems(entry.path)
            status = "verified" if not problems else f"CORRUPT: {problems[0]}"
        notes = [
            n
            for n in (
                "latest" if os.path.basename(entry.path) == latest else "",
                ranked.get(entry.step, ""),
            )
            if n
        ]
        metrics = (
            ", ".join(
                f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in entry.metrics.items()
            )
            if manifest
            else ""
        )
        rows.append(
            (
                entry.step,
                _when(manifest.created) if manifest else "-",
                _size(manifest.nbytes) if manifest else "-",
                status if status != "committed" else "committed (not verified)",
                metrics or "-",
                ", ".join(notes),
            )
        )
    if args.json:
        keys = ("step", "created", "size", "status", "metrics", "notes")
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=1))
    elif rows:
        print(_table(("step", "created", "size", "status", "metrics", "notes"), rows))
    else:
        print(f"no checkpoints in {args.directory}")
    aside = sorted(n for n in os.listdir(args.directory) if ".corrupt-" in n)
    if aside and not args.json:
        print(f"moved aside as corrupt: {', '.join(aside)}")
    bad = any(not str(row[3]).startswith(("verified", "committed")) for row in rows)
    return 1 if bad else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import format_report, run_demo

    print(
        f"running the demo in {args.out} (two DDP trainings under torchrun; about a minute) ...",
        flush=True,
    )
    report = run_demo(
        args.out, nproc=args.nproc, steps=args.steps, every=args.every, kill_at=args.kill_at
    )
    print(format_report(report))
    return 0 if report.identical else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import format_markdown, run_bench

    nprocs = tuple(int(n) for n in args.nproc.split(",")) if args.nproc else None
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
        prog="ddpckpt", description="Inspect, verify, export, import and compare checkpoints."
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
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step")
    p.set_defaults(run=_demo)

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

    p = commands.add_parser("ls", help="list a run directory's checkpoints (exit 1 if any is bad)")
    p.add_argument("directory")
    p.add_argument("--quick", action="store_true", help="check manifests only, not every checksum")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_ls)

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

    p = commands.add_parser("diff", help="which tensors and values differ (exit 1 if any)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--limit", type=int, default=50, help="rows to show per kind (default 50)")
    p.set_defaults(run=_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except (CheckpointError, OSError, ValueError, RuntimeError, ImportError) as exc:
        print(f"ddpckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
