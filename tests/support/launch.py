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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("dist_worker.py")
RUN_SCRIPT = Path(__file__).with_name("run_script.py")  # python RUN_SCRIPT SCRIPT: see there
_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """One node: ``torchrun --nproc-per-node N`` (static rendezvous on loopback), running
    ``worker`` (another script of tests/support with the same interface, or dist_worker.py)."""
    cmd = [str(_BIN / "torchrun"), f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", *launcher_args,
           *_worker_args(scenario, out_dir, args, worker)]  # fmt: skip
    ((code, out),) = _finish([_start(cmd, _env(env), cwd)], timeout)
    return Launch(code, out, _collect(out_dir))


def torchrun_nodes(
    scenario: str, out_dir: Path, *, nnodes: int = 2, nproc: int = 2, args: Sequence[str] = (),
    timeout: float = 150, cwds: Sequence[str | os.PathLike[str] | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> Launch:  # fmt: skip
    """A simulated cluster: ``nnodes`` torchrun launches with ``--node-rank`` on 127.0.0.1."""
    port = free_port()
    procs = []
    for node in range(nnodes):
        cmd = [str(_BIN / "torchrun"), f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "--local-addr=127.0.0.1", "--max-restarts=0",
               *_worker_args(scenario, out_dir, args)]  # fmt: skip
        procs.append(_start(cmd, _env(env), cwds[node] if cwds else None))
    outs = _finish(procs, timeout)
    code = max(c for c, _ in outs)
    return Launch(code, "\n".join(o for _, o in outs), _collect(out_dir))


def torchrun_restarting_nodes(
    worker: Path, scenario: str, out_dir: Path, *, cwds: Sequence[str | os.PathLike[str]],
    nproc: int = 2, args: Sequence[str] = (), max_restarts: int = 3, timeout: float = 240,
) -> Launch:  # fmt: skip
    """Simulated nodes (one torchrun per directory of ``cwds``) that restart their workers
    after a failure, up to ``max_restarts`` times: c10d rendezvous on loopback hosted by node
    0's launcher (static rendezvous cannot restart), restarted workers on fresh stores."""
    port = free_port()
    env = _env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # pytorch/pytorch#135712
    procs = []
    for node, cwd in enumerate(cwds):
        cmd = [str(_BIN / "torchrun"), f"--nnodes={len(cwds)}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=restarting-{port}", f"--rdzv-conf=is_host={int(node == 0)}",
               "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.2", *_worker_args(scenario, out_dir, args, worker)]  # fmt: skip
        procs.append(_start(cmd, env, cwd))
    outs = _finish(procs, timeout)
    code = max(c for c, _ in outs)
    return Launch(code, "\n".join(o for _, o in outs), _collect(out_dir))


def processes(
    scenario: str, out_dir: Path, *, world: int = 2, args: Sequence[str] = (), timeout: float = 120,
    env: Mapping[str, str] | None = None, launcher: str = "env", worker: Path = WORKER,
) -> Launch:  # fmt: skip
    """Plain processes, as a cluster scheduler starts them (RANK, WORLD_SIZE, LOCAL_RANK ...).

    ``launcher="distributed.launch"`` uses the deprecated ``python -m torch.distributed.launch``.
    No agent watches them, so survivors of a killed rank run on and report what they saw.
    ``worker`` replaces dist_worker.py (the framework workers, see killed_run.py).
    """
    port = str(free_port())
    if launcher == "distributed.launch":
        cmd = [sys.executable, "-m", "torch.distributed.launch", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={port}",
               *_worker_args(scenario, out_dir, args)]  # fmt: skip
        ((code, out),) = _finish([_start(cmd, _env(env), None)], timeout)
        return Launch(code, out, _collect(out_dir))
    procs = []
    for rank in range(world):
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_PORT": port, **(env or {})}  # fmt: skip
        cmd = [sys.executable, *_worker_args(scenario, out_dir, args, worker)]
        procs.append(_start(cmd, _env(rank_env), None))
    outs = _finish(procs, timeout)
    return Launch(max(abs(c) for c, _ in outs), "\n".join(o for _, o in outs), _collect(out_dir))


def spawn(
    scenario: str, out_dir: Path, *, world: int = 2, args: Sequence[str] = (), timeout: float = 120
) -> Launch:
    """``torch.multiprocessing.spawn`` with an explicit ``init_process_group`` (the seeds' style)."""
    cmd = [sys.executable, *_worker_args(scenario, out_dir, ["--spawn", str(world), *args])]
    ((code, out),) = _finish([_start(cmd, _env({"MASTER_PORT": str(free_port())}), None)], timeout)
    return Launch(code, out, _collect(out_dir))
