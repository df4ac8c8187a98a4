"""``ddpckpt check-resume``: the options and the launcher of :mod:`ddpckpt._resumecheck`."""

from __future__ import annotations

import argparse
import shlex
import sys

from ddpckpt._cli.command import Command

DESCRIPTION = """\
Prove that your own DDP training script resumes exactly. It runs the command after '--'
once uninterrupted, then again while SIGKILLing one rank at a step (by default once inside
an epoch and once right after an epoch-end save), restarts it with the same command, and
compares every rank's state at every step after the restart with the run it must repeat
(the killed run's own steps after its checkpoint, then the uninterrupted run): model
parameters and buffers, optimizers, schedulers and learning rates, GradScaler, every random
generator, the DataLoader's position and the sample indices of each batch, the models'
inputs, and the loss if the script calls ckpt.log_step(loss). The script needs no change:
a ddpckpt.Checkpointer loop calling should_save(step) every step, or a loop of
ddpckpt.save / ddpckpt.latest + ddpckpt.load, under torchrun, torch.multiprocessing.spawn or
python. Every path it gives ddpckpt is mapped into OUT/runs/*/checkpoints: the user's own
checkpoints are never read for resuming nor written (what the script writes itself, not
through ddpckpt, is written for real, and named in the report). Exit status 0 only when the resume is
exact at every step compared on every rank; 1 when it is not, or when two uninterrupted runs
differ so that it cannot be judged; 2 when the check cannot be done: the script failed
(any exit with an error code; only a process killed by a signal in the interpreter's
teardown after every rank's script ended is let go, with a note), or the records it reads
(its runs', those of --reference) are damaged."""


def _progress(line: str) -> None:
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    """Run ``check-resume``; the exit status (0: exact, 1: not exact or cannot judge; a
    failed script or damaged records raise, which the command reports with status 2)."""
    from ddpckpt._resumecheck.check import check_resume
    from ddpckpt._resumecheck.report import format_report, write_outputs
    from ddpckpt._resumecheck.runner import parse_kill

    command = list(args.launch)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError(
            "give the launch command after '--', e.g. "
            "ddpckpt check-resume -- torchrun --nproc-per-node 2 train.py"
        )
    points = [parse_kill(text) for text in args.kill_at]
    report = check_resume(
        command,
        args.out,
        kill_at=points,
        rank=args.rank,
        resume_args=shlex.split(args.resume_args),
        reference=args.reference,
        timeout=args.timeout,
        progress=_progress,
    )
    write_outputs(report)
    sys.stdout.write(format_report(report) + "\n")
    return 0 if report.identical else 1  # not exact, or cannot judge: report.json says which


HELP = "prove that your training script resumes exactly (exit 1 if not, naming the cause)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``check-resume``."""
    p.usage = "ddpckpt check-resume [options] -- LAUNCH COMMAND ..."
    p.add_argument(
        "--kill-at",
        action="append",
        default=[],
        metavar="K[:after-save]",
        help="kill at step K (when it calls should_save(K)), or right after save(K) returns "
        "with K:after-save; repeatable (default: one step inside an epoch and right after "
        "the first epoch-end save, chosen from the uninterrupted run)",
    )
    p.add_argument("--rank", type=int, default=None, help="the rank to kill (default: the last)")
    p.add_argument(
        "--resume-args",
        default="",
        metavar="'ARGS'",
        help="arguments added to the command when it is restarted (one quoted string, "
        "e.g. --resume-args='--resume')",
    )
    p.add_argument("--out", default="resume-check", help="output directory (default resume-check)")
    p.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="reuse the uninterrupted run of an earlier check of the same command (its --out) "
        "instead of running it again; every step before the kill is still compared with it",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds each launch may take (default 1800)"
    )
    p.add_argument("launch", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


CHECK_RESUME = Command("check-resume", HELP, add_arguments, run, description=DESCRIPTION)
