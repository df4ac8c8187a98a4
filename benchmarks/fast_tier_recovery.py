"""The fast tier: the time from a worker's SIGKILL to the first step after torchrun restarts
the job, and the steps that kill loses, against durable saves alone, measured in one run.

Run it from a source checkout (``pip install -e .``, or ``PYTHONPATH=src``)::

    python benchmarks/fast_tier_recovery.py [--mb 32] [--nproc 2] [--every 10] [--kill-at 17]

It starts ``torchrun --nproc-per-node N --max-restarts 1`` (gloo on CPU, loopback) on itself,
``--repeat`` times for each of two jobs: ``durable`` (``Checkpointer(disk, every_steps=
--every)``) and ``fast`` (the same plus ``fast_tier=`` a tmpfs, a save every step); every
save ``async_save="overlap"``. An MLP of ``--mb`` MiB of fp32 weights with AdamW. The last
rank SIGKILLs itself inside step ``--kill-at`` (after its forward and backward, without
waiting for any save); torchrun restarts every worker, which resume and train to the end.

Per job: the recovery time, from the kill to the end of the first step after the restart
(the slowest rank), split into torchrun noticing the failure and starting new workers, the
new workers importing torch and joining the process group, ``resume()``, and that first
step; and the steps lost (completed before the kill, not restored). The ratios fast /
durable are of medians measured in this run.
"""

from __future__ import annotations

import time

STARTED = time.time()  # a restarted worker's start: before importing torch

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

PHASES = ("restart", "start-up", "resume", "first step")
_WORKER = "DDPCKPT_RECOVERY_BENCH_WORKER"  # the worker's settings, as JSON


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ddpckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    joined = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    torch.manual_seed(0)
    layers = max(1, args.mb // 4)  # 4 MiB of fp32 per 1024x1024 layer
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, 1024)
    fast = args.fast if args.job == "fast" else None
    with ddpckpt.Checkpointer(
        args.run, model=model, optimizer=optimizer, every_steps=args.every, keep_last=2,
        async_save="overlap", fast_tier=fast, timeout=120,
    ) as ckpt:  # fmt: skip
        info = ckpt.resume()
        resumed = time.time()
        for step in range((info.step + 1) if info else 1, args.steps + 1):
            model(batch).square().mean().backward()
            if step == args.kill_at and not restarted and rank == world - 1:
                Path(args.out, "killed").write_text(json.dumps({"at": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            optimizer.zero_grad()
            if restarted and step == (info.step + 1 if info else 1):
                record = {"started": STARTED, "joined": joined, "resumed": resumed,
                          "first_step": time.time(), "from": info.step if info else 0}  # fmt: skip
                Path(args.out, f"restart-rank{rank}.json").write_text(json.dumps(record))
            if ckpt.should_save(step):
                ckpt.save(step)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trial(job: str, args: argparse.Namespace, base: str) -> dict[str, float]:
    """One torchrun launch with one kill; its phases (seconds) and the steps lost."""
    out = tempfile.mkdtemp(prefix=f"{job}-", dir=base)
    fast = tempfile.mkdtemp(prefix="ddpckpt-recovery-", dir=args.fast)
    torchrun = Path(sys.executable).with_name("torchrun")
    port = _free_port()  # a static rendezvous cannot restart: c10d, on loopback
    cmd = [str(torchrun), f"--nproc-per-node={args.nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=recovery-{port}",
           "--local-addr=127.0.0.1", "--max-restarts=1", "--monitor-interval=0.1",
           __file__]  # fmt: skip
    worker = {**vars(args), "job": job, "out": out, "run": os.path.join(out, "run"),
              "fast": os.path.join(fast, "tier")}  # fmt: skip
    env = {**os.environ, _WORKER: json.dumps(worker), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip  # pytorch/pytorch#135712
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        try:
            output, _ = launcher.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # torchrun and its workers
            raise
        records = [json.loads(p.read_text()) for p in Path(out).glob("restart-rank*.json")]
        if len(records) != args.nproc:
            raise RuntimeError(f"{job}: the restarted job left no record:\n{output[-3000:]}")
        killed = json.loads(Path(out, "killed").read_text())["at"]
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    last = {k: max(r[k] for r in records) for k in ("started", "joined", "resumed", "first_step")}
    return {
        "restart": last["started"] - killed,
        "start-up": last["joined"] - last["started"],
        "resume": last["resumed"] - last["joined"],
        "first step": last["first_step"] - last["resumed"],
        "recovery": last["first_step"] - killed,
        "lost": args.kill_at - 1 - records[0]["from"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=32, help="MiB of fp32 weights")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="durable save interval")
    parser.add_argument("--kill-at", type=int, default=17)
    parser.add_argument("--steps", type=int, default=19)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--fast", default="/dev/shm", help="a tmpfs for the fast tier")
    parser.add_argument("--json", help="write the results here too")
    if _WORKER in os.environ:  # a worker under torchrun
        _worker(argparse.Namespace(**json.loads(os.environ[_WORKER])))
        return
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix=".fast-recovery-bench-", dir=Path(__file__).resolve().parent)
    trials: dict[str, list[dict[str, float]]] = {"durable": [], "fast": []}
    try:
        for _ in range(args.repeat):  # alternated, so that the machine's load hits both
            for job in trials:
                trials[job].append(_trial(job, args, base))
                print(f"{job}: {json.dumps(trials[job][-1])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    median = {
        job: {k: statistics.median(t[k] for t in runs) for k in runs[0]}
        for job, runs in trials.items()
    }
    print(f"\nrecovery benchmark: {args.nproc} ranks, {args.mb} MiB of weights (+ AdamW), "
          f"durable every {args.every} steps, SIGKILL inside step {args.kill_at}, "
          f"medians of {args.repeat}")  # fmt: skip
    print(f"{'job':<8} {'kill -> first step':>19} " + " ".join(f"{p:>11}" for p in PHASES)
          + f" {'steps lost':>11}")  # fmt: skip
    for job, m in median.items():
        phases = " ".join(f"{m[p]:>10.2f}s" for p in PHASES)
        print(f"{job:<8} {m['recovery']:>18.2f}s {phases} {m['lost']:>11.0f}")
    d, f = median["durable"], median["fast"]
    print(f"fast / durable: recovery {f['recovery'] / d['recovery']:.2f}x, "
          f"resume {f['resume'] / d['resume']:.2f}x, steps lost {f['lost']:.0f} vs {d['lost']:.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "trials": trials, "median": median}, indent=1)
        )


if __name__ == "__main__":
    main()
