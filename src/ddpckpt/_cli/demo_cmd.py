"""``ddpckpt demo``: crash a DDP run, resume it, prove the resume bit-identical."""

from __future__ import annotations

import argparse
import sys

from ddpckpt._cli.command import CannotRun, Command


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-output", help="output directory (default demo-output)")
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks (default 2; gloo on CPU, NCCL with GPUs)"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument(
        "--every", type=int, default=None, help="checkpoint every N steps (default 20, or steps/4)"
    )
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step")


def _progress(line: str) -> None:
    sys.stderr.write(f"  {line}\n")
    sys.stderr.flush()


def _demo(args: argparse.Namespace) -> int:
    from ddpckpt._cli.demo import (
        SCRIPT,
        check_options,
        default_every,
        default_kill_at,
        listing,
        run_demo,
    )
    from ddpckpt._resumecheck.report import format_report

    every = args.every if args.every is not None else default_every(args.steps)
    kill_at = args.kill_at if args.kill_at is not None else default_kill_at(args.steps, every)
    try:
        check_options(nproc=args.nproc, steps=args.steps, every=every, kill_at=kill_at)
    except ValueError as exc:
        raise CannotRun(str(exc)) from None
    print(
        f"running the demo in {args.out}: ddpckpt check-resume on {SCRIPT.name} (two DDP "
        "trainings under torchrun; about a minute on two CPU cores) ...",
        flush=True,
    )
    report = run_demo(
        args.out, nproc=args.nproc, steps=args.steps, every=every, kill_at=kill_at,
        progress=_progress,
    )  # fmt: skip
    ranks = f"{args.nproc} rank{'s' if args.nproc != 1 else ''}"
    title = (
        f"ddpckpt demo: {ranks}, {args.steps} optimizer steps, a checkpoint every {every}\n"
        f"training script: {SCRIPT}"
    )
    print(format_report(report, title=title))
    print(
        f"\ncheckpoints of the killed run (kept: the last 3 and the best by loss):\n{listing(report)}"
    )
    return 0 if report.identical else 1


DEMO = Command(
    "demo",
    "crash a DDP run, resume it, prove the resume bit-identical",
    _arguments,
    _demo,
    description="Train a small DDP model under torchrun (2 ranks, gloo on CPU; NCCL with "
    "GPUs), once straight and once with rank 1 SIGKILLed mid-run and resumed by the "
    "launcher from the newest checkpoint; then compare every rank's state at every step "
    "(it runs 'ddpckpt check-resume' on a script shipped with ddpckpt). Writes the report "
    "and plots to --out; exit 0 only when the resume is bit-identical.",
)
