"""``ddpckpt check-resume`` run as a user runs it: on any launch command, or on
``tiny_train.py`` (2 ranks unless told, under a torchrun that restarts a killed job itself, on loopback)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from launch import _IN_USE, ONE_NODE, _env, _finish, _start

SUPPORT = Path(__file__).parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# tiny_train.py: 6 steps an epoch at any world size, 2 epochs; saves at 4, 6 (epoch end), 8, 12 (and epoch end).
# Killed at step 10, the restarted run resumes from 8 and its first step is 9.
KILL, RESUMED, FIRST = "10", 8, 9


def check(
    tmp: Path,
    command: Sequence[str] | Callable[[], Sequence[str]],
    *options: str,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str, dict[str, Any]]:
    """``ddpckpt check-resume --out tmp/check OPTIONS -- COMMAND`` in ``tmp``: its exit
    status, output and report.json ({} if none was written). A command that names its own
    port is given as a function, called again for each attempt (a new port each time)."""
    out = tmp / "check"
    variables = _env({"PYTHONWARNINGS": "ignore::FutureWarning", **(env or {})})
    for _ in range(3):
        argv = [sys.executable, "-m", "ddpckpt", "check-resume", "--out", str(out),
                "--timeout=150", *options, "--",
                *(command() if callable(command) else command)]  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        ((code, output),) = _finish([_start(argv, variables, tmp)], 600)
        if not _lost_port(out):
            break
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return code, output, report


def check_tiny(
    tmp: Path, *options: str, bug: str = "", reference: Path | None = None, nproc: int = 2,
    sharded: str = "",
) -> tuple[int, str, dict[str, Any]]:  # fmt: skip
    """:func:`check` on tiny_train.py at ``nproc`` ranks with ``PLANTED_BUG=bug`` and
    ``SHARDED=sharded``, its ``--dir`` in ``tmp/user`` (given as ``user``, relative to ``tmp``,
    where the check runs: one command in every test, so that a check of it may reuse another
    test's uninterrupted run)."""
    command = [TORCHRUN, f"--nproc-per-node={nproc}", *ONE_NODE, "--max-restarts=1", "--monitor-interval=0.2",
               "--local-addr=127.0.0.1", str(SUPPORT / "tiny_train.py"), "--dir", "user"]  # fmt: skip
    more = ["--reference", str(reference)] if reference else []
    return check(tmp, command, *options, *more, env={"PLANTED_BUG": bug, "SHARDED": sharded})


def _lost_port(out: Path) -> bool:
    """Whether a worker of a run could not bind its store's port. The check sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE (torchrun's restarts need it in torch 2.13), so
    torchrun picks MASTER_PORT free and rank 0 binds it later: another test can take it in
    between, and that failed round spends the --max-restarts the planned kill needs. The
    check is run again, as from scratch."""
    logs = out.glob("runs/*/launch-*.log")
    return any(m in log.read_text(errors="replace") for log in logs for m in _IN_USE)
