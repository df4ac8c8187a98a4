"""``ddpckpt demo``: crash a DDP run, let torchrun restart it, prove the resume exact.

1. A reference run trains uninterrupted under ``torchrun``.
2. The same training runs again with ``torchrun --max-restarts 1``; once rank 1 has passed
   the kill step, this process SIGKILLs it. torchrun tears the job down and starts it
   again; the workers resume from the newest checkpoint on their own.
3. Every rank's per-step losses and final state (model, optimizer, EMA, scaler, learning
   rate) are compared; a plot of both loss curves and the checkpoint listing are written.

The training job is :mod:`ddpckpt.cli._demo_train`. Everything lands under one directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DemoReport", "check_options", "default_every", "run_demo"]

_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: (\w*(?:Error|Exception)\b.*)$", re.MULTILINE)


@dataclass
class DemoReport:
    out: str
    nproc: int
    steps: int
    every: int
    killed_at: int = 0
    resumed_from: int = 0
    identical: bool = False
    differences: list[str] = field(default_factory=list)
    checkpoints_written: int = 0
    save_seconds: float = 0.0
    train_seconds: float = 0.0
    crash_run_seconds: float = 0.0
    plot: str = ""
    listing: str = ""


def _torchrun(
    nproc: int, run: str, steps: int, every: int, restarts: int, port: int
) -> subprocess.Popen[bytes]:
    os.makedirs(run, exist_ok=True)
    log = open(os.path.join(run, "torchrun.log"), "wb")  # noqa: SIM115 - closed with the process
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        # c10d rendezvous: each restart is a new round (static rendezvous cannot restart)
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=demo-{port}",
        "--local-addr=127.0.0.1", f"--max-restarts={restarts}",
        "--monitor-interval=0.2", "-m", "ddpckpt.cli._demo_train", "--dir", run,
        f"--steps={steps}", f"--every={every}",
    ]  # fmt: skip
    # torchrun shares its rendezvous store with init_process_group by default, and restarted
    # workers then read the dead workers' addresses (pytorch/pytorch#135712, #167288).
    env = {
        **_child_env(),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _child_env() -> dict[str, str]:
    """This environment, minus torch's warning at import that numpy is absent (a plain
    install has no numpy, and the demo never needs it)."""
    quiet = "ignore:Failed to initialize NumPy"
    return {
        **os.environ,
        "PYTHONWARNINGS": ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), quiet))),
    }


def _wait(process: subprocess.Popen[bytes], run: str, timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise TimeoutError(f"the training in {run} did not finish within {timeout:.0f} s") from None
    if process.returncode != 0:
        log = os.path.join(run, "torchrun.log")
        with open(log, errors="replace") as f:
            text = f.read()
        errors = _RANK_ERROR.findall(text)
        if errors:  # one line: what the first failing rank raised; the log has the traceback
            rank, error = errors[0]
            kind = (
                ImportError
                if error.startswith(("ImportError", "ModuleNotFoundError"))
                else RuntimeError
            )
            raise kind(f"the training in {run} failed: rank {rank}: {error} (log: {log})")
        raise RuntimeError(
            f"the training in {run} failed (exit {process.returncode}):\n{text[-3000:]}"
        )


def _records(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_step(path: str) -> int:
    records = _records(path)
    return records[-1]["step"] if records else 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_every(steps: int) -> int:
    """The checkpoint interval when none is given: 20, or a quarter of a shorter run."""
    return min(20, max(1, steps // 4))


def _kill_step(steps: int, every: int) -> int:
    return (steps * 11) // 20 + every // 3


def check_options(*, nproc: int, steps: int, every: int, kill_at: int | None) -> None:
    """Raise :class:`ValueError` saying which option is wrong, before anything starts."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: the demo needs at least 1 rank (default 2)")
    if every < 1 or steps <= every:
        raise ValueError(
            f"--steps {steps} --every {every}: need 0 < every < steps, so that a checkpoint "
            "exists before the crash"
        )
    kill_at = kill_at if kill_at is not None else _kill_step(steps, every)
    if not every < kill_at < steps:
        raise ValueError(
            f"--kill-at {kill_at}: the crash must come after the first checkpoint (step "
            f"{every}) and before the last step ({steps})"
        )


def run_demo(
    out: str = "demo-output", *, nproc: int = 2, steps: int = 200, every: int = 20,
    kill_at: int | None = None, timeout: float = 600.0,
) -> DemoReport:  # fmt: skip
    """Run the demo; returns the report (see the module docstring)."""
    check_options(nproc=nproc, steps=steps, every=every, kill_at=kill_at)
    kill_at = kill_at if kill_at is not None else _kill_step(steps, every)
    out = os.path.abspath(out)
    reference, crash = os.path.join(out, "reference"), os.path.join(out, "crash")
    for run in (reference, crash):
        shutil.rmtree(run, ignore_errors=True)
    report = DemoReport(out=out, nproc=nproc, steps=steps, every=every)

    started = time.perf_counter()
    _wait(_torchrun(nproc, reference, steps, every, 0, _free_port()), reference, timeout)
    report.train_seconds = time.perf_counter() - started

    started = time.perf_counter()
    job = _torchrun(nproc, crash, steps, every, 1, _free_port())
    victim_log = os.path.join(crash, f"losses-rank{min(1, nproc - 1)}.jsonl")
    while _last_step(victim_log) < kill_at:
        if job.poll() is not None:
            raise RuntimeError(
                f"the crash run ended before step {kill_at}; see {crash}/torchrun.log"
            )
        time.sleep(0.005)
    with open(os.path.join(crash, f"pid-rank{min(1, nproc - 1)}")) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    report.killed_at = _last_step(victim_log)
    _wait(job, crash, timeout)
    report.crash_run_seconds = time.perf_counter() - started

    _compare(report, reference, crash)
    report.plot = _plot(report, reference, crash)
    report.listing = _listing(os.path.join(crash, "checkpoints"))
    with open(os.path.join(out, "checkpoints.txt"), "w") as f:
        f.write(report.listing + "\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report.__dict__, f, indent=1)
    return report


def _compare(report: DemoReport, reference: str, crash: str) -> None:
    saves = _records(os.path.join(crash, "saves-rank0.jsonl"))
    report.checkpoints_written = len(saves)
    report.save_seconds = sum(
        s["seconds"] for s in _records(os.path.join(reference, "saves-rank0.jsonl"))
    )
    for rank in range(report.nproc):
        expected = {
            r["step"]: r for r in _records(os.path.join(reference, f"losses-rank{rank}.jsonl"))
        }
        seen: dict[int, dict[str, Any]] = {}
        for record in _records(os.path.join(crash, f"losses-rank{rank}.jsonl")):
            if record["restart"] and not report.resumed_from:
                report.resumed_from = record["step"] - 1
            previous = seen.get(record["step"])
            if previous is not None and (previous["loss"], previous["lr"]) != (
                record["loss"],
                record["lr"],
            ):
                report.differences.append(
                    f"rank {rank} step {record['step']}: redone differently after the restart"
                )
            seen[record["step"]] = record
        for step, record in expected.items():
            got = seen.get(step)
            if got is None or (got["loss"], got["lr"]) != (record["loss"], record["lr"]):
                report.differences.append(
                    f"rank {rank} step {step}: loss {got and got['loss']} vs {record['loss']}"
                )
        with open(os.path.join(reference, f"final-rank{rank}.json")) as f:
            final_reference = json.load(f)
        with open(os.path.join(crash, f"final-rank{rank}.json")) as f:
            final_crash = json.load(f)
        for key in final_reference:
            if final_reference[key] != final_crash[key]:
                report.differences.append(f"rank {rank}: final {key} differs")
    report.identical = not report.differences and report.resumed_from > 0


def _plot(report: DemoReport, reference: str, crash: str) -> str:
    """Draw ``loss.png``; without matplotlib (an optional extra) return a one-line note."""
    try:
        import matplotlib
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install 'ddpckpt[demo]')"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(report.out, "loss.png")
    ref = _records(os.path.join(reference, "losses-rank0.jsonl"))
    crashed = _records(os.path.join(crash, "losses-rank0.jsonl"))
    curves = [
        (ref, {"color": "0.6", "lw": 4, "label": "uninterrupted run"}),
        ([r for r in crashed if not r["restart"]], {"color": "tab:blue", "lw": 1.3, "label": "crashed run"}),
        ([r for r in crashed if r["restart"]], {"color": "tab:orange", "lw": 1.3, "ls": "--",
                                                "label": "after automatic resume"}),
    ]  # fmt: skip
    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=110)
    for records, style in curves:
        axis.plot([r["step"] for r in records], [r["loss"] for r in records], **style)
    axis.axvline(report.killed_at, color="tab:red", lw=1)
    axis.axvline(report.resumed_from, color="tab:green", lw=1)
    at_top = axis.get_xaxis_transform()  # x in data, y in axes coordinates
    axis.text(report.killed_at, 0.03, f" SIGKILL rank 1 (step {report.killed_at})", color="tab:red",
              transform=at_top, fontsize=8)  # fmt: skip
    axis.text(report.resumed_from, 0.09, f"resumed from step {report.resumed_from} ", color="tab:green",
              transform=at_top, ha="right", fontsize=8)  # fmt: skip
    axis.set_yscale("log")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("training loss (rank 0)")
    verdict = "bit-identical" if report.identical else "DIFFERENT"
    axis.set_title(f"ddpckpt demo: {report.nproc} ranks, crash and resume: {verdict}")
    axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _listing(directory: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ddpckpt", "ls", directory],
        capture_output=True,
        text=True,
        check=False,
        env=_child_env(),
    )
    return (result.stdout + result.stderr).rstrip()


def format_report(report: DemoReport) -> str:
    """The human-readable summary ``ddpckpt demo`` prints."""
    share = 100 * report.save_seconds / report.train_seconds if report.train_seconds else 0.0
    lines = [
        f"ddpckpt demo: {report.nproc} ranks, {report.steps} optimizer steps, a checkpoint every {report.every}",
        f"  uninterrupted run           {report.train_seconds:6.1f} s (of which {report.save_seconds:.2f} s "
        f"in {report.steps // report.every} saves on rank 0: {share:.1f}%)",
        f"  crashed run                 {report.crash_run_seconds:6.1f} s: rank 1 SIGKILLed at step "
        f"{report.killed_at}, torchrun restarted the job, resumed from step {report.resumed_from}",
        f"  checkpoints written         {report.checkpoints_written} (kept: the last 3 and the best by loss)",
        f"  bit-identical to reference  {'yes' if report.identical else 'NO'}"
        " (every rank's loss and LR at every step; final model, optimizer, EMA, GradScaler)",
    ]
    lines += [f"    {d}" for d in report.differences[:10]]
    lines += ["", report.listing, "", f"plot: {report.plot}", f"output: {report.out}"]
    return "\n".join(lines)
