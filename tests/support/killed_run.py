"""What the framework workers share: one launch that trains uninterrupted, trains again until
one rank is SIGKILLed inside an epoch, and resumes that training; bit for bit or not.

``launch.processes`` starts one process per rank, which imports the framework once and
forks a child per phase (the framework's import is most of the cost, and a SIGKILLed
process cannot resume itself): ``uninterrupted`` (a fresh checkpoint directory),
``killed`` (rank ``KILLED_RANK``'s child kills itself after step ``kill_at``; the other
ranks' children are killed when their parents see it, as torchrun would), ``resumed``
(from the killed run's newest checkpoint). Each phase's children form their own process
group, on their own port. Each rank writes ``OUT/rank-R.json``: the resumed run's losses
and final weights, and the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

KILLED_RANK = 1
Phase = Callable[[Path, "int | None", bool], dict[str, Any]]  # (directory, kill_at, resume)
Fit = Callable[[str, Path, "int | None", bool], dict[str, Any]]  # (mode, ...)


def main(fit: Fit, modes: list[str], kill_at: int) -> None:
    """A worker's command line: ``SCRIPT MODE --out DIR --ports A,B,C``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=modes)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ports", required=True)
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    run_phases(args.out, ports, kill_at, lambda *a: fit(args.mode, *a), args.mode)


def launch_killed_run(script: Path, out: Path, mode: str = "ddpckpt") -> Any:
    """Run ``script``'s three phases on 2 ranks (from a test); the launch, checked.

    Each phase binds its own port, minutes after the test picked it: if another process
    took one meanwhile, the phase's rank 0 fails with EADDRINUSE, and the launch is made
    again from nothing on new ports (``launch.on_a_free_port``)."""
    from launch import free_port, processes

    def attempt() -> list[str]:
        for left in (*out.glob("uninterrupted-*"), *out.glob("checkpoints-*"),
                     *out.glob("phase-*"), *out.glob("rank-*.json"), *out.glob("killed-*"),
                     *out.glob("failed")):  # fmt: skip
            shutil.rmtree(left) if left.is_dir() else left.unlink()
        return ["--ports", ",".join(str(free_port()) for _ in range(3))]

    return processes(mode, out, args=attempt, worker=script, timeout=240).ok()


def assert_resumed_exactly(run: Any, resumed_from: int, steps: int) -> None:
    """Every rank resumed from ``resumed_from`` and its ``steps`` steps after it trained on
    the same batches with the same losses as the uninterrupted run, to the same weights."""
    for rank in (0, 1):
        result, reference = run.result(rank), run.result(rank)["reference"]
        assert result["resumed_from"] == resumed_from, rank
        for what in ("batches", "losses"):
            after = {s: v for s, v in reference[what].items() if int(s) > resumed_from}
            assert result[what] == after, (rank, what)
        assert len(result["losses"]) == steps
        assert result["weights"] == reference["weights"], rank


def width() -> int:
    """The models' hidden width: tiny for the tests, larger for benchmarks/integrations.py."""
    return int(os.environ.get("KILLED_RUN_WIDTH", "16"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def weights_digest(module: torch.nn.Module) -> str:
    hasher = xxhash.xxh3_64()
    for name, value in sorted(module.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def batch_digest(*tensors: torch.Tensor) -> str:
    """Which samples a step trained on (and in which order)."""
    hasher = xxhash.xxh3_64()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def kill_if_due(step: int, kill_at: int | None) -> None:
    """SIGKILL this rank after ``step`` if it is the killed rank (nothing is cleaned up)."""
    if kill_at is not None and step == kill_at and rank() == KILLED_RANK:
        os.kill(os.getpid(), signal.SIGKILL)


def run_phases(out: Path, ports: list[int], kill_at: int, phase: Phase, tag: str) -> None:
    """The three phases of one rank; ``phase(directory, kill_at, resume)`` trains once in a
    forked child and returns what to compare (``losses`` by step, ``weights``)."""
    reference = _in_child(out, ports[0], lambda: phase(out / f"uninterrupted-{tag}", None, False))
    killed = _in_child(
        out, ports[1], lambda: phase(out / f"checkpoints-{tag}", kill_at, False), killed=True
    )
    assert killed is None, f"rank {rank()}: the killed run finished"
    resumed = _in_child(out, ports[2], lambda: phase(out / f"checkpoints-{tag}", None, True))
    assert resumed is not None
    doc = {**resumed, "resumed_from": min(int(s) for s in resumed["losses"]) - 1,
           "reference": reference}  # fmt: skip
    (out / f"rank-{rank()}.json").write_text(json.dumps(doc))


def _in_child(
    out: Path, port: int, train: Callable[[], dict[str, Any]], *, killed: bool = False
) -> dict[str, Any] | None:
    """``train()`` in a forked child on its own port; its result. ``killed``: the phase in
    which a rank is killed; its other ranks end when they see it (``None``)."""
    result = out / f"phase-{port}-rank-{rank()}.json"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: train, write the result, leave without running the parent's exit
        code = 0
        try:
            os.environ["MASTER_PORT"] = str(port)
            result.write_text(json.dumps(train()))  # floats round-trip exactly (repr)
        except BaseException:
            told = traceback.format_exc()
            if not killed or "EADDRINUSE" in told:  # the peer's death is expected noise here
                print(told, file=sys.stderr)  # a lost port: launch_killed_run tries again
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    ended, failed = out / f"killed-{port}", out / "failed"
    while True:  # as torchrun: when one rank dies, the others are ended
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if (killed and ended.exists()) or failed.exists():
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if failed.exists():
        raise SystemExit(f"rank {rank()}: another rank failed")
    if killed and os.waitstatus_to_exitcode(status) != 0:
        ended.touch()  # a rank died (this one, or its peer, which this one saw first)
        return None
    if os.waitstatus_to_exitcode(status) != 0:
        failed.touch()
        raise SystemExit(f"rank {rank()}: the child on port {port} failed")
    return json.loads(result.read_text())
