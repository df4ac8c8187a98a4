"""Sharded state: ddpckpt against DCP on FSDP2 and on ZeRO-1, in one run.

Run it from a source checkout (``pip install -e '.[bench]'``, or ``PYTHONPATH=src``)::

    python benchmarks/sharded.py [--nproc 2] [--mib 256] [--repeat 3] [--json out.json]

It starts itself under torchrun (gloo on CPU, ``--nproc`` ranks). Every rank builds the same
model, ``--mib`` MiB of fp32 weights in 1024 x 1024 layers, trains it one step with AdamW
(12 bytes of state per parameter in all), then measures each method on that state with the
main benchmark's harness (``_bench_worker.measure_method``): the training stall and the time
until durable (medians of ``--repeat`` saves), the peak extra resident memory of a rank while
saving, and a cold load (best of ``--repeat``) with the most resident memory it added over
what the rank held before it (model and optimizer included in that baseline, mapped file
pages included in the peak); the slowest (or largest) rank counts. The cases (``--cases``):

* **FSDP2**: ``fully_shard`` on every layer and on the model. ddpckpt ``save`` and
  ``save(async_save=True)`` against DCP ``save`` and ``async_save`` (``get_state_dict``;
  loads: ``dcp.load`` then ``set_state_dict``).
* **ZeRO-1**: DDP with ``ZeroRedundancyOptimizer(AdamW)``. DCP cannot save it (its
  ``state_dict()`` asks for ``consolidate_state_dict()`` first; the error is printed), so the
  reference is what torch's error advises and frameworks do: ``consolidate_state_dict(to=0)``,
  then ``torch.save`` on rank 0.
* **DDP** (``--cases DDP``, for comparison): a replicated model with AdamW; DCP ``save``,
  ``torch.save`` on rank 0 and ddpckpt ``save``.

The report gives each method's times and load peak as ratios to the reference's (DCP ``save``
for FSDP2 and DDP, the consolidating save for ZeRO-1), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_worker as harness

_MiB = 1 << 20


class ZeroConsolidated(harness.Method):
    """torch's advice for a ZeroRedundancyOptimizer: gather its state onto rank 0, save there."""

    name = "consolidate_state_dict + torch.save rank 0"

    def start(self, path: str) -> Callable[[], None]:
        self.optimizer.consolidate_state_dict(to=0)

        def write() -> None:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, path)

        return harness.on_rank0(write, path)

    def load(self, path: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


CASES: dict[str, list[type[harness.Method]]] = {
    "FSDP2": [harness.DCP, harness.DCPAsync, harness.Ddpckpt, harness.DdpckptAsync],
    "ZeRO-1": [ZeroConsolidated, harness.Ddpckpt, harness.DdpckptAsync],
    "DDP": [harness.DCP, harness.TorchSaveRank0, harness.Ddpckpt],  # replicated, for comparison
}


def _layers(mib: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(max(1, mib // 4))))


def build(case: str, mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of ``case``, trained one step (the optimizer state exists)."""
    model = _layers(mib)
    if case == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        wrapped: nn.Module = model
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
    wrapped(torch.randn(4, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return wrapped, optimizer


def _dcp_refusal(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """What DCP's ``get_state_dict`` (the state ``dcp.save`` is given) says of a
    ZeroRedundancyOptimizer, on every rank (its first line)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    try:
        get_state_dict(model, optimizer)
        said = "no error (DCP no longer refuses ZeroRedundancyOptimizer)"
    except Exception as exc:
        said = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, said)
    return "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(everyone))


def worker(args: argparse.Namespace) -> None:
    """Every rank: measure each case's methods; rank 0 writes the results to ``args.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, Any] = {"world_size": dist.get_world_size(), "mib": args.mib,
                               "cases": args.cases}  # fmt: skip
    for case in args.cases:
        methods = CASES[case]
        model, optimizer = build(case, args.mib)
        if case == "ZeRO-1":  # before any method consolidates
            results["dcp_on_zero"] = _dcp_refusal(model, optimizer)
        found: dict[str, Any] = {}
        for kind in methods:
            method = kind(model, optimizer)
            found[kind.name] = harness.measure_method(method, None, args.dir, 0.0, args.repeat)
            harness.release_memory()
        results[case] = found
        del model, optimizer
        harness.release_memory()
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def report(results: dict[str, Any]) -> str:
    """A markdown table per case: seconds, MiB, and ratios to the case's first method."""
    lines = [f"{results['world_size']} ranks, {results['mib']} MiB of fp32 weights + AdamW"]
    for case in results.get("cases", ["FSDP2", "ZeRO-1"]):
        found = results[case]
        reference = found[next(iter(found))]
        lines += ["", f"### {case} (ratios: against {next(iter(found))}, same run)", "",
                  "| method | stall s | durable s | load s | peak extra MiB/rank: save "
                  "| load | stall / ref | durable / ref | load / ref | load peak / ref |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for name, m in found.items():
            lines.append(
                f"| {name} | {m['stall']:.2f} | {m['durable']:.2f} | {m['load']:.2f} "
                f"| {m['peak_extra_rss'] / _MiB:.0f} | {m['load_peak_extra_rss'] / _MiB:.0f} "
                f"| {m['stall'] / reference['stall']:.2f} "
                f"| {m['durable'] / reference['durable']:.2f} "
                f"| {m['load'] / reference['load']:.2f} "
                f"| {_ratio(m['load_peak_extra_rss'], reference['load_peak_extra_rss'])} |"
            )
    if "dcp_on_zero" in results:
        lines += ["", f"DCP on ZeRO-1 (get_state_dict): {results['dcp_on_zero']}"]
    return "\n".join(lines)


def _ratio(value: float, reference: float) -> str:
    """``value / reference``, or what it is when the reference added nothing measurable."""
    if reference >= _MiB:
        return f"{value / reference:.2f}"
    return "-" if value < _MiB else "(ref ~0)"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256, help="fp32 weights in all")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["FSDP2", "ZeRO-1"],
                        help="DDP: a replicated model with AdamW, for comparison")  # fmt: skip
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        out = args.json or os.path.join(root, "results.json")
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                    "--master-addr=127.0.0.1", f"--master-port={_free_port()}"]  # fmt: skip
        options = [f"--mib={args.mib}", f"--repeat={args.repeat}", f"--dir={root}", f"--json={out}",
                   "--cases", *args.cases]  # fmt: skip
        subprocess.run([*torchrun, __file__, "--worker", *options], check=True)
        print(report(json.loads(Path(out).read_text())))


if __name__ == "__main__":
    main()
