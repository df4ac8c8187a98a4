"""``ddpckpt diff``: which tensors and values differ between two checkpoints."""

from __future__ import annotations

import argparse

from ddpckpt._cli._format import table
from ddpckpt._cli.command import Command


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="a checkpoint directory")
    p.add_argument("b", help="another checkpoint directory")
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="SECTION",
        help="leave SECTION out of the comparison (repeatable or comma-separated): rng, step, "
        "epoch, metrics, world_size, model, optimizer, scheduler, scaler, extra, extra/NAME",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="trust the recorded checksums instead of verifying both (reads no data, checks "
        "file sizes: a file altered in place since it was written can compare as identical)",
    )
    p.add_argument("--limit", type=int, default=50, help="rows to show per kind (default 50)")


def _diff(args: argparse.Namespace) -> int:
    from ddpckpt._cli.tools import diff

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
        print(table(("tensor", "difference", "detail"), rows))
        if len(report.tensors) > args.limit:
            print(f"... and {len(report.tensors) - args.limit} more tensors differ")
    how = (
        "every byte verified"
        if report.verified
        else "by recorded checksum; data not read, so damage since the save is not detected: "
        "drop --quick to verify"
    )
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
        steps = next(((a, b) for name, a, b in report.header if name == "step"), None)
        why = (
            f"the checkpoints are at steps {steps[0]} and {steps[1]}, and training draws from "
            "them at every step"
            if steps is not None
            else "at the same step, the runs seeded their generators differently or not at all"
        )
        print(f"(rng: random generator states differ: {why}; --ignore rng compares the rest)")
    return 0 if report.same else 1


DIFF = Command(
    "diff",
    "which tensors and values differ (exit 1 if any)",
    _arguments,
    _diff,
    description="Compare two checkpoints: header (step, epoch, metrics, world size), "
    "non-tensor state and every tensor. Both are verified first (a corrupt one is an "
    "error, exit 2). Everything is compared by default, RNG states included: two runs "
    "that did not seed Python's or numpy's generators differ there; --ignore rng "
    "compares the rest.",
)
