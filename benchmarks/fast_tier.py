"""The fast tier: what a checkpoint in host memory every step costs the training thread,
against checkpoints on disk, all measured in one run.

Run it from a source checkout (``pip install -e .``, or ``PYTHONPATH=src``)::

    python benchmarks/fast_tier.py [--mb 64] [--steps 60] [--every 20] [--fast /dev/shm/x]
                                   [--device cpu|cuda]

One process, one rank, an MLP of ``--mb`` MiB of fp32 weights trained with AdamW (state
about 3x that), every save asynchronous with ``async_save="overlap"`` (the fast tier's
saves always are). Four loops of ``--steps`` steps each, in one process:

* ``none``: no checkpoint (the reference step time);
* ``durable/N``: ``Checkpointer(disk)`` saving every ``--every`` steps (durable only);
* ``durable+fast``: the same, plus ``fast_tier=`` a tmpfs saving every step;
* ``durable/1``: ``Checkpointer(disk)`` saving every step (the same cadence, on disk).

For each: the median and mean step time (a step: forward, backward, optimizer step and
``should_save``/``save``) and their ratio to ``none``; the training thread's time inside
``save()`` per save, by tier; and the steps a crash at a step boundary would lose (the
steps completed since the newest committed checkpoint of the tier that would serve,
read from the directories at every step), mean and worst. The disk directory is under
``--disk`` (default: a temporary directory next to this file, on the checkout's disk).

With ``--device cuda`` the model, its batch and the optimizer state live on the GPU, and
each step ends with ``torch.cuda.synchronize()`` so that its time includes the GPU's work
(and whatever a save made it wait for), not only the kernel launches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ddpckpt

_MiB = 1 << 20


def _model(mib: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, mib // 4)  # 4 MiB of fp32 per 1024x1024 layer
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def _committed(directory: str) -> int | None:
    """The newest committed step of a run directory (committed: renamed to ``step-N``)."""
    steps = [int(n[5:]) for n in os.listdir(directory) if n.startswith("step-") and "." not in n]
    return max(steps, default=None)


def _loop(mode: str, args: argparse.Namespace, disk: str, fast: str) -> dict[str, Any]:
    model = _model(args.mb).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, 1024, device=args.device)
    cuda = args.device == "cuda"
    every = 1 if mode == "durable/1" else args.every
    run = os.path.join(disk, mode.replace("/", "-").replace("+", "-"))
    fast_dir = os.path.join(fast, "tier") if mode == "durable+fast" else None
    ckpt = None
    if mode != "none":
        ckpt = ddpckpt.Checkpointer(
            run, model=model, optimizer=optimizer, every_steps=every, keep_last=2,
            async_save="overlap", fast_tier=fast_dir,
        )  # fmt: skip
        ckpt.resume()
    steps, stalls, lost = [], {"fast": [], "durable": []}, []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if ckpt is not None and ckpt.should_save(step):
            durable_due = step % every == 0
            before = time.perf_counter()
            ckpt.save(step)
            stalls["durable" if durable_due else "fast"].append(time.perf_counter() - before)
        if cuda:
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
        if ckpt is not None:  # a crash now: the steps done since what a resume would find
            found = [_committed(d) for d in (run, fast_dir) if d and os.path.isdir(d)]
            newest = max((s for s in found if s is not None), default=0)
            lost.append(step - newest)
    if ckpt is not None:
        ckpt.close()
    warm = steps[2:]  # the first steps size buffers and warm the allocator
    result: dict[str, Any] = {"median_s": statistics.median(warm), "mean_s": statistics.mean(warm)}
    for tier, times in stalls.items():
        if times:
            result[f"save_call_{tier}_s"] = statistics.median(times)
            result[f"saves_{tier}"] = len(times)
    if lost:
        result["lost_mean"], result["lost_max"] = statistics.mean(lost), max(lost)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MiB of fp32 weights")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="durable save interval")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--fast", default="/dev/shm", help="a tmpfs for the fast tier")
    parser.add_argument("--disk", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    disk = tempfile.mkdtemp(prefix=".fast-tier-bench-", dir=args.disk)
    fast = tempfile.mkdtemp(prefix="ddpckpt-fast-bench-", dir=args.fast)
    results = {}
    try:
        for mode in ("none", f"durable/{args.every}", "durable+fast", "durable/1"):
            key = "durable/N" if mode == f"durable/{args.every}" else mode
            results[mode] = _loop(key, args, disk, fast)
            print(f"{mode}: {json.dumps(results[mode])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    state = sum(p.numel() for p in _model(args.mb).parameters()) * 4 * 3 / _MiB
    print(f"\nfast tier benchmark: 1 rank on {args.device}, {state:.0f} MiB of state (weights + AdamW), "
          f"{args.steps} steps per loop, durable every {args.every}, async_save='overlap'")  # fmt: skip
    base = results["none"]["median_s"]
    print(f"{'loop':<14} {'median step':>12} {'x none':>7} {'mean step':>10} {'x none':>7} "
          f"{'save() call':>20} {'lost at a crash':>18}")  # fmt: skip
    for mode, r in results.items():
        calls = ", ".join(
            f"{tier} {r[f'save_call_{tier}_s'] * 1e3:.1f} ms"
            for tier in ("fast", "durable")
            if f"save_call_{tier}_s" in r
        )
        lost = f"{r['lost_mean']:.1f} mean, {r['lost_max']} max" if "lost_mean" in r else ""
        print(f"{mode:<14} {r['median_s'] * 1e3:>10.1f}ms {r['median_s'] / base:>7.2f} "
              f"{r['mean_s'] * 1e3:>8.1f}ms {r['mean_s'] / results['none']['mean_s']:>7.2f} "
              f"{calls:>20} {lost:>18}")  # fmt: skip
    fast_call = results["durable+fast"].get("save_call_fast_s")
    disk_call = results["durable/1"].get("save_call_durable_s")
    if fast_call and disk_call:
        print(f"save() stall, in-memory / disk, same cadence: {fast_call / disk_call:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
