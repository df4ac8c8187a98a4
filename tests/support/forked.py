"""Ranks started as torchrun's agent starts its workers, without the agent (or torchrun's
import of torch): for tests where the launcher is incidental to what they check.

A launch hosts its own store on a port the system picks (no port is picked and then bound
by someone else), gives each rank the environment torchrun gives its workers
(``TORCHELASTIC_USE_AGENT_STORE=True``: the ranks connect to the launcher's store, as to
torchrun's), runs ``python -u WORKER ARGS`` in each, and, like torchrun's agent with
``--max-restarts=0``, stops the others (SIGTERM, then SIGKILL) once one rank fails. The
ranks are plain ``python`` processes, warm-started from the test worker's server like every
other process the suite starts (warm_start.py). The tests about torchrun itself (restarts,
its signals, several nodes, the documentation's commands) launch the real one (launch.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

# torchrun's agent waits this long for the others to end after SIGTERM before SIGKILL.
_STOP_GRACE = 30.0


def _stop(procs: Sequence[subprocess.Popen[bytes]], how: signal.Signals) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, how)


def run_ranks(
    worker: Path, argv: Sequence[str], *, nproc: int, env: Mapping[str, str], timeout: float,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """Run ``nproc`` ranks of ``worker``; return torchrun's exit status (0, or 1 once a rank
    failed) and every rank's output. A launch that outlives ``timeout`` is killed and raises."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))  # fmt: skip
    envs = [
        {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
         "ROLE_RANK": str(rank), "ROLE_NAME": "default",
         "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
         "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
         "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
         "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1"}
        for rank in range(nproc)
    ]  # fmt: skip
    return _run([sys.executable, "-u", str(worker), *argv], envs, timeout, cwd)


def run_python(
    script: Path, argv: Sequence[str], *, env: Mapping[str, str], timeout: float,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """``python SCRIPT ARGS`` with exactly ``env`` (no launcher's variables): its exit status
    and output. A run that outlives ``timeout`` is killed and raises."""
    return _run([sys.executable, str(script), *argv], [dict(env)], timeout, cwd, exit_code=True)


def _run(
    cmd: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float,
    cwd: str | os.PathLike[str] | None, exit_code: bool = False,
) -> tuple[int, str]:  # fmt: skip
    """One process per environment of ``envs``, each its own process group, watched as
    torchrun's agent watches its workers (:func:`_watch`); the exit status (torchrun's 0 or
    1; the one process's own with ``exit_code``) and every process's output."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryFile() as log:
        try:
            for env in envs:
                procs.append(
                    subprocess.Popen(
                        list(cmd),
                        env=dict(env),
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            code = _watch(procs, timeout)
            if exit_code and code == 1:  # one process: its own exit status, as python's
                code = procs[0].returncode if (procs[0].returncode or 0) > 0 else 1
            log.seek(0)
            output = log.read().decode(errors="replace")
            if code is None:
                raise AssertionError(
                    f"launch hung for {timeout} s and was killed:\n{output[-6000:]}"
                )
            return code, output
        finally:
            _stop(procs, signal.SIGKILL)
            for proc in procs:
                proc.wait(5)


def _watch(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> int | None:
    """Wait as torchrun's agent does: all ranks succeed (0), or one fails and the others are
    stopped (1). ``None`` when the deadline passed first (every rank is then killed)."""
    deadline = time.monotonic() + timeout
    stopping_since: float | None = None  # when a rank was first seen failed
    ends = {os.pidfd_open(p.pid): p for p in procs}  # readable once the process has ended
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            if not running:
                return 1 if any(p.returncode != 0 for p in procs) else 0
            if stopping_since is None and any(p.returncode not in (None, 0) for p in procs):
                stopping_since = time.monotonic()
                _stop(running, signal.SIGTERM)
            if stopping_since is not None and time.monotonic() - stopping_since > _STOP_GRACE:
                _stop(running, signal.SIGKILL)
            left = deadline - time.monotonic()
            if left <= 0:
                _stop(procs, signal.SIGKILL)
                return None
            waiting = [fd for fd, p in ends.items() if p.returncode is None]
            select.select(waiting, [], [], min(left, 1.0))
    finally:
        for fd in ends:
            os.close(fd)
