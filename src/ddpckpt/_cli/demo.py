"""``ddpckpt demo``: ``ddpckpt check-resume`` on the training script that ships with ddpckpt.

The script, ``examples/demo_train.py`` inside the installed package (:data:`SCRIPT`), is an
ordinary DDP training script; the demo starts it under ``torchrun --max-restarts 1``, once
uninterrupted and once while SIGKILLing rank 1 after a chosen step (torchrun restarts the
job, the workers resume on their own), and :mod:`ddpckpt._resumecheck` compares both runs
at every step on every rank and writes the report and the plots. Exactly what

    ddpckpt check-resume --kill-at K --rank 1 -- torchrun ... demo_train.py --dir DIR

does, plus the ``ddpckpt ls`` listing of the killed run's checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ddpckpt._resumecheck.check import CheckReport, check_resume
from ddpckpt._resumecheck.records import read_records
from ddpckpt._resumecheck.report import write_outputs
from ddpckpt._resumecheck.runner import KillPoint

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "demo_train.py"


def default_every(steps: int) -> int:
    """The checkpoint interval when none is given: 20, or a quarter of a shorter run."""
    return min(20, max(1, steps // 4))


def default_kill_at(steps: int, every: int) -> int:
    """A step a little past the middle of the run, between two checkpoints."""
    return (steps * 11) // 20 + every // 3


def check_options(*, nproc: int, steps: int, every: int, kill_at: int) -> None:
    """Raise :class:`ValueError` saying which option is wrong, before anything starts."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: the demo needs at least 1 rank (default 2)")
    if every < 1 or steps <= every:
        raise ValueError(
            f"--steps {steps} --every {every}: need 0 < every < steps, so that a checkpoint "
            "exists before the crash"
        )
    if not every < kill_at < steps:
        raise ValueError(
            f"--kill-at {kill_at}: the crash must come after the first checkpoint (step "
            f"{every}) and before the last step ({steps})"
        )


def demo_command(*, nproc: int, steps: int, every: int) -> list[str]:
    """The launch command: torchrun restarts the job once, on a c10d rendezvous whose store
    listens on a loopback port the system picks as it binds (static rendezvous cannot
    restart; a port found free beforehand could be taken first). The script's ``--dir
    runs/demo`` is mapped into the check's directory, as every path of a checked script:
    nothing is written next to it."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=demo",
        "--local-addr=127.0.0.1", "--max-restarts=1", "--monitor-interval=0.2",
        str(SCRIPT), "--dir", "runs/demo", f"--steps={steps}", f"--every={every}",
    ]  # fmt: skip


def run_demo(
    out: str = "demo-output", *, nproc: int = 2, steps: int = 200, every: int = 20,
    kill_at: int | None = None, timeout: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> CheckReport:  # fmt: skip
    """Run the demo and write its outputs under ``out``; returns the check's report."""
    kill_at = default_kill_at(steps, every) if kill_at is None else kill_at
    check_options(nproc=nproc, steps=steps, every=every, kill_at=kill_at)
    out = os.path.abspath(out)
    report = check_resume(
        demo_command(nproc=nproc, steps=steps, every=every), out,
        kill_at=[KillPoint(kill_at)], rank=min(1, nproc - 1), timeout=timeout, progress=progress,
    )  # fmt: skip
    write_outputs(report)
    return report


def listing(report: CheckReport) -> str:
    """``ddpckpt ls`` of the killed run's checkpoints, also written to ``checkpoints.txt``."""
    records = read_records(report.killed_runs[0]).get(0, [])
    found = [e["directory"] for events in records for e in events if e["event"] == "attach"]
    if not found or not os.path.isdir(found[-1]):
        return "no checkpoints were written"
    from ddpckpt._cli.rundir_cmds import LS

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        LS.run(argparse.Namespace(directory=found[-1], quick=False, json=False))
    text = printed.getvalue().rstrip()
    with open(os.path.join(report.out, "checkpoints.txt"), "w") as f:
        f.write(text + "\n")
    return text
