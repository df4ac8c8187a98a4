"""The one way tests start several real processes: torchrun, plain env processes, spawn.

Every launch runs ``tests/support/dist_worker.py SCENARIO`` under a hard wall-clock timeout; on
timeout the whole process group is killed and the test fails with the output so far, so a
hang can never stall the suite. Each rank writes its result as JSON to ``OUT/rank-N.json``.
All addresses are loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("dist_worker.py")
RUN_SCRIPT = Path(__file__).with_name("run_script.py")  # python RUN_SCRIPT SCRIPT: see there
_BIN = Path(sys.executable).parent


# torchrun on one node hosts its rendezvous store on a port the system picks and hands it to its
# workers: nothing picks a port that another process can bind first, while the store is shared
# (under TORCH_DISABLE_SHARE_RDZV_TCP_STORE, which check-resume sets, torchrun picks the
# workers' port free and rank 0 binds it later: tiny_check.py runs such a check again). (No
# --rdzv-id: torchrun's default run id, as users' jobs have it.)
ONE_NODE = ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0")
_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")


def free_port() -> int:
    """A port free now, for launches whose processes must agree on one before any starts
    (several nodes, plain processes): run them through :func:`on_a_free_port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Start = tuple[Sequence[str], Mapping[str, str], "str | os.PathLike[str] | None"]


def lost_port(code: int | None, output: str) -> bool:
    return code not in (None, 0) and any(m in output for m in _IN_USE)


def on_a_free_port(
    starts: Callable[[int], Sequence[Start]], timeout: float, tries: int = 3
) -> list[tuple[int, str]]:
    """Run the processes ``starts(port)`` gives (command, environment, directory) together,
    on a port free when picked, and return each one's exit status and output. If one of them
    cannot bind the port (someone bound it in between), the others, which would wait for its
    store to the timeout, are killed and all start again on another port (a job that cannot
    bind its port has done nothing yet)."""
    outs: list[tuple[int, str]] = []
    for _ in range(tries):
        outs = _together(starts(free_port()), timeout)
        if not any(lost_port(code, out) for code, out in outs):
            break
    return outs


def _together(starts: Sequence[Start], timeout: float) -> list[tuple[int, str]]:
    """Start every process, wait for all, each writing its output to a file of its own; stop
    early once one of them lost its port; kill all and raise once ``timeout`` passed."""
    logs = [tempfile.TemporaryFile("w+") for _ in starts]  # noqa: SIM115 (closed below)
    procs = [
        subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
        for (cmd, env, cwd), log in zip(starts, logs, strict=True)
    ]  # fmt: skip

    def output(i: int) -> str:
        logs[i].seek(0)
        return logs[i].read()

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()

    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                kill_all()
                said = "\n".join(output(i)[-3000:] for i in range(len(procs)))
                raise AssertionError(f"launch hung for {timeout} s and was killed:\n{said}")
            if any(lost_port(p.returncode, output(i)) for i, p in enumerate(procs) if p.returncode):
                kill_all()
                break
            time.sleep(0.1)
        return [(p.returncode, output(i)) for i, p in enumerate(procs)]
    finally:
        for log in logs:
            log.close()


@dataclass
class Launch:
    returncode: int
    output: str
    results: dict[int, dict[str, Any]] = field(default_factory=dict)

    def ok(self) -> Launch:
        assert self.returncode == 0, f"launch failed ({self.returncode}):\n{self.output[-6000:]}"
        return self

    def result(self, rank: int) -> dict[str, Any]:
        assert rank in self.results, f"rank {rank} left no result:\n{self.output[-6000:]}"
        return self.results[rank]


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1"})  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _start(
    cmd: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str] | None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(cmd), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def _finish(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rest = "".join(p.communicate()[0] or "" for p in procs if p is not proc)
            raise AssertionError(
                f"launch hung for {timeout} s and was killed:\n{out[-6000:]}\n{rest[-3000:]}"
            ) from None
        outs.append((proc.returncode, out))
    return outs


def _collect(out_dir: Path) -> dict[int, dict[str, Any]]:
    results = {}
    for path in out_dir.glob("rank-*.json"):
        results[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return results


def _worker_args(
    scenario: str, out_dir: Path, args: Sequence[str], worker: Path = WORKER
) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [str(worker), scenario, "--out", str(out_dir), *args]


def torchrun(
    scenario: str, out_dir: Path, *, nproc: int = 2, args: Sequence[str] = (), timeout: float = 120,
    env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    launcher_args: Sequence[str] = (), worker: Path = WORKER,
) -> Launch:  # fmt: skip
    """One node: ``torchrun --nproc-per-node N`` (its rendezvous store on port 0, see ONE_NODE), running
    ``worker`` (another script of tests/support with the same interface, or dist_worker.py)."""
    cmd = [str(_BIN / "torchrun"), f"--nproc-per-node={nproc}", *ONE_NODE, "--max-restarts=0", *launcher_args,
           *_worker_args(scenario, out_dir, args, worker)]  # fmt: skip
    ((code, out),) = _finish([_start(cmd, _env(env), cwd)], timeout)
    return Launch(code, out, _collect(out_dir))


def forked_ranks(
    scenario: str, out_dir: Path, *, nproc: int = 2, args: Sequence[str] = (), timeout: float = 120,
    env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    worker: Path = WORKER,
) -> Launch:  # fmt: skip
    """As :func:`torchrun`, with the ranks forked from a process that has imported torch
    already (forked.py): the launch for tests where the launcher is incidental."""
    from forked import run_ranks

    argv = _worker_args(scenario, out_dir, args, worker)
    code, out = run_ranks(
        Path(argv[0]), argv[1:], nproc=nproc, env=_env(env), timeout=timeout, cwd=cwd
    )
    return Launch(code, out, _collect(out_dir))


def torchrun_nodes(
    scenario: str, out_dir: Path, *, nnodes: int = 2, nproc: int = 2, args: Sequence[str] = (),
    timeout: float = 150, cwds: Sequence[str | os.PathLike[str] | None] | None = None,
    env: Mapping[str, str] | None = None, worker: Path = WORKER,
) -> Launch:  # fmt: skip
    """A simulated cluster: ``nnodes`` torchrun launches with ``--node-rank`` on 127.0.0.1
    (``worker`` replaces dist_worker.py)."""

    def starts(port: int) -> list[Start]:
        return [
            ([str(_BIN / "torchrun"), f"--nnodes={nnodes}", f"--node-rank={node}",
              f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
              "--local-addr=127.0.0.1", "--max-restarts=0",
              *_worker_args(scenario, out_dir, args, worker)],
             _env(env), cwds[node] if cwds else None)
            for node in range(nnodes)
        ]  # fmt: skip

    outs = on_a_free_port(starts, timeout)
    code = max(c for c, _ in outs)
    return Launch(code, "\n".join(o for _, o in outs), _collect(out_dir))


def torchrun_restarting_nodes(
    worker: Path, scenario: str, out_dir: Path, *, cwds: Sequence[str | os.PathLike[str]],
    nproc: int = 2, args: Sequence[str] = (), max_restarts: int = 3, timeout: float = 240,
) -> Launch:  # fmt: skip
    """Simulated nodes (one torchrun per directory of ``cwds``) that restart their workers
    after a failure, up to ``max_restarts`` times: c10d rendezvous on loopback hosted by node
    0's launcher (static rendezvous cannot restart), restarted workers on fresh stores."""
    env = _env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # pytorch/pytorch#135712

    def starts(port: int) -> list[Start]:
        return [
            ([str(_BIN / "torchrun"), f"--nnodes={len(cwds)}", f"--nproc-per-node={nproc}",
              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              f"--rdzv-id=restarting-{port}", f"--rdzv-conf=is_host={int(node == 0)}",
              "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
              "--monitor-interval=0.2", *_worker_args(scenario, out_dir, args, worker)],
             env, cwd)
            for node, cwd in enumerate(cwds)
        ]  # fmt: skip

    outs = on_a_free_port(starts, timeout)
    code = max(c for c, _ in outs)
    return Launch(code, "\n".join(o for _, o in outs), _collect(out_dir))


def processes(
    scenario: str, out_dir: Path, *, world: int = 2,
    args: Sequence[str] | Callable[[], Sequence[str]] = (), timeout: float = 120,
    env: Mapping[str, str] | None = None, launcher: str = "env", worker: Path = WORKER,
) -> Launch:  # fmt: skip
    """Plain processes, as a cluster scheduler starts them (RANK, WORLD_SIZE, LOCAL_RANK ...).

    ``launcher="distributed.launch"`` uses the deprecated ``python -m torch.distributed.launch``.
    No agent watches them, so survivors of a killed rank run on and report what they saw.
    ``worker`` replaces dist_worker.py (the framework workers, see killed_run.py). ``args``
    may be a function, called again for each attempt :func:`on_a_free_port` makes (new
    ports of the worker's own, say).
    """
    if callable(args) and launcher == "distributed.launch":
        raise ValueError("distributed.launch makes one attempt: pass the arguments themselves")
    if launcher == "distributed.launch":
        cmd = [sys.executable, "-m", "torch.distributed.launch", f"--nproc-per-node={world}",
               *ONE_NODE, *_worker_args(scenario, out_dir, args)]  # fmt: skip
        ((code, out),) = _finish([_start(cmd, _env(env), None)], timeout)
        return Launch(code, out, _collect(out_dir))

    def starts(port: int) -> list[Start]:
        given = args() if callable(args) else args
        cmd = [sys.executable, *_worker_args(scenario, out_dir, given, worker)]
        return [
            (cmd, _env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world), "MASTER_PORT": str(port), **(env or {})}),
             None)
            for rank in range(world)
        ]  # fmt: skip

    outs = on_a_free_port(starts, timeout)
    return Launch(max(abs(c) for c, _ in outs), "\n".join(o for _, o in outs), _collect(out_dir))


def spawn(
    scenario: str, out_dir: Path, *, world: int = 2, args: Sequence[str] = (), timeout: float = 120
) -> Launch:
    """``torch.multiprocessing.spawn`` with an explicit ``init_process_group`` (the seeds' style)."""
    cmd = [sys.executable, *_worker_args(scenario, out_dir, ["--spawn", str(world), *args])]
    ((code, out),) = on_a_free_port(
        lambda port: [(cmd, _env({"MASTER_PORT": str(port)}), None)], timeout
    )
    return Launch(code, out, _collect(out_dir))
