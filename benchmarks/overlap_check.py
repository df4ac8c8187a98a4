"""What checking overlap saves costs: the per-step time with ``async_save="overlap"`` when
every deferred copy is checked once it lands (version counters, and a compare of each CPU
tensor with its copy), against the same saves with the check turned off, in one run.

Run it from a source checkout (``pip install -e .``, or ``PYTHONPATH=src``)::

    python benchmarks/overlap_check.py [--mb 64] [--steps 40] [--rounds 3]

One process, one rank, on the CPU: an MLP of ``--mb`` MiB of fp32 weights trained with
AdamW (state about 3x that), ``ddpckpt.save(..., async_save="overlap")`` at every step into
a temporary directory in ``/dev/shm`` (so that writing costs little), so every step's forward and backward run while the copy of the
previous save is taken and checked on the copy thread. The two variants alternate for
``--rounds`` rounds (one warm-up step each, not counted); for each, the median step time,
the median ``save()`` stall and the median wait of ``optimizer.step()`` for the copy (its
pre-hook), and the ratio of the checked variant to the unchecked one. The reference (no
check) is the code path before the check existed; on a GPU the check is a reduction per
tensor on the copy's stream instead of a CPU compare, which this CPU run does not measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

import ddpckpt
import ddpckpt._io.staging as staging


def _model(mb: int) -> torch.nn.Module:
    width = int((mb * 2**20 / 4 / 4) ** 0.5)  # four square layers of fp32
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))


def _loop(
    model: torch.nn.Module, opt: torch.optim.Optimizer, where: str, steps: int
) -> dict[str, Any]:
    width = model[0].in_features
    step_times, stalls, fence_waits = [], [], []
    pending = None
    for step in range(steps + 1):
        began = time.perf_counter()
        model(torch.randn(64, width)).square().mean().backward()
        before_step = time.perf_counter()
        opt.step()  # its pre-hook waits for the previous save's copy
        after_step = time.perf_counter()
        opt.zero_grad()
        saved = time.perf_counter()
        pending = ddpckpt.save(
            where, model=model, optimizer=opt, async_save="overlap", overwrite=True
        )
        ended = time.perf_counter()
        if step:  # the first step warms up
            step_times.append(ended - began)
            stalls.append(ended - saved)
            fence_waits.append(after_step - before_step)
    if pending is not None:
        pending.wait()
    return {
        "step_s": statistics.median(step_times),
        "stall_s": statistics.median(stalls),
        "step_wait_s": statistics.median(fence_waits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    model = _model(args.mb)
    opt = torch.optim.AdamW(model.parameters())
    checking = staging.written_since_staged
    results: dict[str, list[dict[str, Any]]] = {"checked": [], "unchecked": []}
    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the writes cost little there
    with tempfile.TemporaryDirectory(prefix="ddpckpt-overlap-", dir=memory) as root:
        for _ in range(args.rounds):
            for variant in ("unchecked", "checked"):
                staging.written_since_staged = checking if variant == "checked" else (lambda d: [])
                try:
                    results[variant].append(_loop(model, opt, f"{root}/ckpt", args.steps))
                finally:
                    staging.written_since_staged = checking
    summary = {
        variant: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for variant, runs in results.items()
    }
    print(f"overlap saves every step, {args.mb} MiB of weights + AdamW, {args.steps} steps x "
          f"{args.rounds} rounds, alternating; medians of the rounds' medians")  # fmt: skip
    print(f"{'':>10}  {'step s':>8}  {'save() stall s':>14}  {'step() waits s':>14}")
    for variant, row in summary.items():
        print(
            f"{variant:>10}  {row['step_s']:8.4f}  {row['stall_s']:14.4f}  {row['step_wait_s']:14.4f}"
        )
    ratio = summary["checked"]["step_s"] / summary["unchecked"]["step_s"]
    print(f"step time, checked / unchecked: {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rounds": results, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
