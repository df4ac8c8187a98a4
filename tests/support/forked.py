"""Ranks forked from a process that has already imported torch: what torchrun's agent does for
its workers, without paying torch's import (about 2.5 s of CPU) once per rank and once more
for the agent.

A launch hosts its own store on a port the system picks (no port is picked and then bound
by someone else), gives each rank the environment torchrun gives its workers
(``TORCHELASTIC_USE_AGENT_STORE=True``: the ranks connect to the launcher's store, as to
torchrun's), runs ``python WORKER ARGS`` in each as ``__main__``, and, like torchrun's agent
with ``--max-restarts=0``, stops the others (SIGTERM, then SIGKILL) once one rank fails.
Used where the launcher is incidental to what a test checks; the tests about torchrun itself
(restarts, its signals, several nodes, the documentation's commands) launch the real one
(launch.py). What a forked rank shares with the fork server rather than having its own, as a
fresh interpreter would: ``PYTHONHASHSEED`` (string hashing, so the order of a set of strings
is the same on every rank), ``OMP_NUM_THREADS`` (1, read once when torch loads), and anything
else torch reads from the environment at import.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

# What every worker imports first; the fork server imports these once. ddpckpt is not among
# them: it reads its environment at import, and each rank has its own.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    "numpy",
    "xxhash",
]
# torchrun's agent waits this long for the others to end after SIGTERM before SIGKILL.
_STOP_GRACE = 30.0
_context: multiprocessing.context.ForkServerContext | None = None
_starting = threading.Lock()  # two launches from two threads of one test


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The fork server, started on first use with torch imported (and OMP_NUM_THREADS=1,
    which libgomp reads when torch loads it, as torchrun's workers read it at their start)."""
    global _context
    with _starting:
        if _context is not None:
            return _context
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if previous is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = previous
        _context = context
        return context


def _rank_main(
    worker: str, argv: list[str], env: dict[str, str], log: str, cwd: str | None,
    path: list[str] | None = None,
) -> None:  # fmt: skip
    """In the forked rank: its own process group, output to the launch's log, the rank's
    environment, then ``python WORKER ARGS`` up to the end a normal exit has (exiting.py)."""
    os.setsid()
    # A forked child takes its parent's start method (forkserver); a process started as
    # `python WORKER` has the platform's default (fork on Linux), which DataLoader workers use.
    multiprocessing.set_start_method(None, force=True)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Unbuffered, as torchrun runs its workers (python -u): a rank SIGKILLed mid-line loses nothing.
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True
    )
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    sys.argv = [worker, *argv]
    if path is not None:  # exactly a fresh interpreter's (none of the test process's)
        sys.path[:] = [os.path.dirname(worker), *path]
    else:
        sys.path[0:0] = [os.path.dirname(worker)] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
        ]
    from run_script import run_as_main

    run_as_main(worker)


def _stop(procs: Sequence[multiprocessing.process.BaseProcess], how: signal.Signals) -> None:
    for proc in procs:
        if proc.exitcode is None and proc.pid is not None:
            # The forkserver, not this process, reaps a rank: its exitcode can still read None
            # after it is gone, so "no such process" here means it has already stopped.
            with contextlib.suppress(ProcessLookupError):
                try:
                    os.killpg(proc.pid, how)
                except ProcessLookupError:  # not yet its own group leader
                    os.kill(proc.pid, how)


def run_ranks(
    worker: Path, argv: Sequence[str], *, nproc: int, env: Mapping[str, str], timeout: float,
    cwd: str | os.PathLike[str] | None = None, path: list[str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """Run ``nproc`` ranks of ``worker``; return torchrun's exit status (0, or 1 once a rank
    failed) and every rank's output. A launch that outlives ``timeout`` is killed and raises.
    ``path``: the ranks' module search path after the worker's directory (:func:`fresh_path`
    for exactly a fresh interpreter's; default: the server's, PYTHONPATH first)."""
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
    return _run_forked(worker, argv, envs, timeout, cwd, path)


def run_python(
    script: Path, argv: Sequence[str], *, env: Mapping[str, str], timeout: float,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """``python SCRIPT ARGS`` with exactly ``env`` (no launcher's variables) and the module
    search path a fresh interpreter has with it, forked from the server: its exit status
    (its own, as python's) and output. A run that outlives ``timeout`` is killed and raises."""
    return _run_forked(script, argv, [dict(env)], timeout, cwd, fresh_path(env), exit_code=True)


def fresh_path(env: Mapping[str, str]) -> list[str]:
    """``sys.path[1:]`` of ``python SCRIPT`` run with ``env``: PYTHONPATH and the
    installation's directories, never the test process's own entries (tests/support ...)."""
    key = tuple(sorted(env.items()))
    if key not in _FRESH_PATHS:
        import json
        import subprocess

        probe = "import json, sys; print(json.dumps(sys.path[1:]))"
        out = subprocess.run([sys.executable, "-c", probe], env=dict(env), capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        _FRESH_PATHS[key] = json.loads(out)
    return list(_FRESH_PATHS[key])


_FRESH_PATHS: dict[tuple[tuple[str, str], ...], list[str]] = {}


def _run_forked(
    worker: Path, argv: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float,
    cwd: str | os.PathLike[str] | None, path: list[str] | None = None, exit_code: bool = False,
) -> tuple[int, str]:  # fmt: skip
    """One process per environment of ``envs``, watched as torchrun's agent watches its
    workers (:func:`_watch`); the exit status (torchrun's 0 or 1; the one process's own with
    ``exit_code``) and every process's output. ``path``: the processes' module search path
    after the worker's directory (default: the server's, PYTHONPATH first)."""
    context = _forkserver()
    log = Path(tempfile.gettempdir()) / f"ranks-{uuid.uuid4().hex}.log"
    procs = []
    try:
        for env in envs:
            proc = context.Process(
                target=_rank_main,
                args=(
                    str(worker),
                    list(argv),
                    dict(env),
                    str(log),
                    None if cwd is None else str(cwd),
                    path,
                ),
                daemon=False,
            )
            proc.start()
            procs.append(proc)
        code = _watch(procs, timeout)
        if exit_code and code == 1:  # one process: its own exit status, as python's
            code = procs[0].exitcode if (procs[0].exitcode or 0) > 0 else 1
        output = log.read_text(errors="replace") if log.exists() else ""
        if code is None:
            raise AssertionError(f"launch hung for {timeout} s and was killed:\n{output[-6000:]}")
        return code, output
    finally:
        _stop(procs, signal.SIGKILL)
        for proc in procs:
            proc.join(5)
        log.unlink(missing_ok=True)


def _watch(procs: Sequence[multiprocessing.process.BaseProcess], timeout: float) -> int | None:
    """Wait as torchrun's agent does: all ranks succeed (0), or one fails and the others are
    stopped (1). ``None`` when the deadline passed first (every rank is then killed)."""
    deadline = time.monotonic() + timeout
    stopping_since: float | None = None  # when a rank was first seen failed
    while True:
        running = [p for p in procs if p.exitcode is None]
        if not running:
            return 1 if any(p.exitcode != 0 for p in procs) else 0
        if stopping_since is None and any(p.exitcode not in (None, 0) for p in procs):
            stopping_since = time.monotonic()
            _stop(running, signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > _STOP_GRACE:
            _stop(running, signal.SIGKILL)
        left = deadline - time.monotonic()
        if left <= 0:
            _stop(procs, signal.SIGKILL)
            return None
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=min(left, 0.5))
