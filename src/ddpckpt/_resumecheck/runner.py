"""Run the user's launch command: once uninterrupted, then once per kill point.

Each run gets its own directory ``OUT/runs/NAME`` (records, the checkpoints of the paths
the script writes, mapped by :mod:`.isolate`, the launch logs) and the environment variable
of :mod:`.record`. A call the check refused (reading the user's run for resuming) stops the
check with its message. A killed run whose launcher
gave up (``torchrun --max-restarts 0``, a plain ``python``) is started again with the same
command plus ``resume_args``; a launcher that restarts by itself needs nothing more. A launch
that exits non-zero is a failure unless :mod:`.ending` finds a death by a signal in the
interpreter's teardown after every rank's script ended. Records are read through
:mod:`.records` (the trust boundary).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._resumecheck.ending import judge, reached_end_everywhere
from ddpckpt._resumecheck.record import ENV
from ddpckpt._resumecheck.records import (
    Records,
    by_process,
    read_marker,
    read_records,
    read_run,
)

_LOG_END = 1 << 20  # of a launch's log, read for its launcher's report of failed processes


@dataclass(frozen=True)
class KillPoint:
    """Where a rank dies: at ``should_save(step)`` or right after the last save of ``step``."""

    step: int
    after_save: bool = False
    saves: int = 1  # with after_save: the save of the step after which it dies

    def label(self) -> str:
        return f"{self.step}:after-save" if self.after_save else str(self.step)

    def describe(self) -> str:
        return (
            f"right after the save of step {self.step}"
            if self.after_save
            else f"at step {self.step} (before any save of it)"
        )


def parse_kill(text: str) -> KillPoint:
    """``K`` or ``K:after-save``; raises :class:`ValueError` naming the accepted forms."""
    step, _, where = text.partition(":")
    if not step.isdigit() or where not in ("", "after-save"):
        raise ValueError(
            f"--kill-at {text}: give a step number K (killed when it calls should_save(K)) "
            "or K:after-save (killed right after save(K) returns)"
        )
    return KillPoint(int(step), after_save=bool(where))


@dataclass
class Run:
    name: str
    dir: str
    seconds: float = 0.0
    launches: list[dict[str, Any]] = field(default_factory=list)
    killed: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    records: Records = field(default_factory=dict)  # as read once the launches ended
    digests: dict[str, str] = field(default_factory=dict)  # of each rank's file, by name


def _launch(
    command: Sequence[str], env: Mapping[str, str], log: str, timeout: float
) -> dict[str, Any]:
    started = time.perf_counter()
    with open(log, "wb") as out:
        try:
            process = subprocess.Popen(
                list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except (FileNotFoundError, PermissionError) as exc:  # "train.py" given as the command
            raise type(exc)(
                f"cannot start {command[0]!r} ({exc.strerror}): give the whole launch command "
                "after --, e.g. ddpckpt check-resume -- torchrun --nproc-per-node 2 train.py"
            ) from exc
        try:
            code = process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):  # what the launcher left behind
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return {
        "command": list(command),
        "pid": process.pid,
        "exit": code,
        "timed_out": timed_out,
        "seconds": time.perf_counter() - started,
        "log": log,
    }


def _log_end(path: str) -> str:
    """The end of a launch's log (where launchers report the processes that failed)."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - _LOG_END))
        return f.read(_LOG_END).decode(errors="replace")


def _tail(path: str, lines: int = 25) -> str:
    return "".join(_log_end(path).splitlines(keepends=True)[-lines:])


# A line of the script's own error output; not the launcher's (its log lines, its own
# traceback of ChildFailedError and its summary of the failed processes).
_ERROR = re.compile(
    r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception|Interrupt)(:|$)|.*can't open file|.*\[Errno \d+\])"
)
_LAUNCHER = re.compile(
    r"^[IWEF]\d{4} |torch[/.]distributed[/.](elastic|run|launcher)|ChildFailedError"
)


def _failure(path: str, shown: int = 3) -> str:
    """What a failed launch's log shows the user: the first lines of the script's own errors
    (torchrun prints them first, then 20 lines of its own traceback and summary, which
    were all the message showed: a mistyped script's "can't open file" was not among them),
    then the log's end."""
    with open(path, "rb") as f:
        start = f.read(_LOG_END).decode(errors="replace")
    errors = list(
        dict.fromkeys(
            line.strip()
            for line in start.splitlines()
            if _ERROR.search(line) and not _LAUNCHER.search(line)
        )
    )[:shown]
    said = "".join(f"  {line}\n" for line in errors)
    return (f"the script's first errors in the log:\n{said}the log's end:\n" if said else "") + (
        _tail(path)
    )


def run(
    name: str,
    command: Sequence[str],
    out: str,
    *,
    kill: KillPoint | None = None,
    rank: int = 0,
    resume_args: Sequence[str] = (),
    timeout: float = 1800.0,
    world: int | None = None,
) -> Run:
    """Run ``command`` as check run ``name`` (killing ``rank`` at ``kill``); raises
    :class:`RuntimeError` (naming the log) when the script fails other than by the kill, or
    runs on another number of ranks than ``world`` (the uninterrupted run's)."""
    run_dir = os.path.join(os.path.abspath(out), "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    spec: dict[str, Any] = {"dir": run_dir, "kill": None}
    if kill is not None:
        spec["kill"] = {
            "rank": rank,
            "step": kill.step,
            "event": "save" if kill.after_save else "step",
            "saves": kill.saves,
        }
    env = {
        **os.environ,
        ENV: json.dumps(spec),
        "PYTHONUNBUFFERED": "1",
        # torchrun restarting workers by itself otherwise hands them the dead workers'
        # store addresses (pytorch/pytorch#135712)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    result = Run(name, run_dir)
    started = time.perf_counter()
    launch = _launch(command, env, os.path.join(run_dir, "launch-1.log"), timeout)
    result.launches.append(launch)
    marker = os.path.join(run_dir, "killed")
    result.killed = read_marker(marker) if kill is not None else None
    if result.killed is not None and launch["exit"] != 0 and not _finished_everywhere(run_dir):
        # the launcher gave up: start it again, as a user would
        again = [*command, *resume_args]
        launch = _launch(again, env, os.path.join(run_dir, "launch-2.log"), timeout)
        result.launches.append(launch)
    result.seconds = time.perf_counter() - started
    records, result.digests = read_run(run_dir)
    result.records = records
    refused = _refusal(records)
    if refused is not None:
        raise RuntimeError(f"{name}: {refused}; log: {launch['log']}")
    if launch["timed_out"]:
        raise RuntimeError(
            f"{name}: the script did not finish within {timeout:.0f} s (--timeout); "
            f"log: {launch['log']}\n{_tail(launch['log'])}"
        )
    if launch["exit"] != 0:
        ending = judge(by_process(records), launch["pid"], launch["exit"], _log_end(launch["log"]))
        if ending.failed:
            why = f": {ending.why}" if ending.why else ""
            raise RuntimeError(
                f"{name}: the script failed (exit {launch['exit']}){why}; log: {launch['log']}\n"
                f"{_failure(launch['log'])}"
            )
        died = ", ".join(f"rank {rank} by {sig}" for rank, sig in ending.teardown.items())
        result.notes.append(
            f"{name}: every rank's script ran to its end, then the launcher exited with "
            f"{launch['exit']}: a process died in the interpreter's teardown ({died}), after "
            "its last record "
            "(torch 2.13's gloo threads abort finished processes there at random, "
            "pytorch/pytorch#190489; see the FAQ). The run's records are complete, so the "
            f"check goes on; log: {launch['log']}"
        )
    ran = {e["world"] for processes in records.values() for events in processes
           for e in events if e["event"] == "start"}  # fmt: skip
    if world is not None and ran and ran != {world}:
        sizes = " and ".join(f"{n} rank{'s' if n > 1 else ''}" for n in sorted(ran))
        raise RuntimeError(
            f"{name}: the script ran on {sizes}, the uninterrupted run on {world}: the runs of "
            "one check must be of one command on one number of ranks; log: "
            f"{launch['log']}"
        )
    if kill is not None and result.killed is None:
        raise RuntimeError(
            f"{name}: rank {rank} never reached the kill point ({kill.describe()}); the run "
            "ended without it. Choose a --kill-at inside the run"
        )
    if not records:
        raise RuntimeError(
            f"{name}: the script recorded nothing: check-resume needs a script started by the "
            "command after '--' that checkpoints with ddpckpt: a ddpckpt.Checkpointer whose "
            "should_save(step) it calls every step, or ddpckpt.save / ddpckpt.latest + "
            f"ddpckpt.load around an optimizer's steps; log: {launch['log']}"
        )
    return result


def _finished_everywhere(run_dir: str) -> bool:
    """Whether the last process of every rank recorded that its script ended without failing
    (the ``exit`` event, written before the interpreter's teardown)."""
    return reached_end_everywhere(by_process(read_records(run_dir)))


def _refusal(records: Records) -> str | None:
    """The message of the first call the check refused in this run, if any."""
    for processes in records.values():
        for events in processes:
            for event in events:
                if event["event"] == "refused":
                    return event["why"]
    return None
