"""Every DDP set-up resumed in-process, compared with the run that never stopped (under torchrun).

    configs_worker.py configs --out DIR --ckpt ROOT [--only a,b] [--resized-from ROOT4]

For each set-up: build the model, its DDP and optimizer, train ``MICRO`` micro-steps with
every rank drawing its own fixed batches, and save after ``SAVE_AT`` of them; then build
everything anew (a new DDP starts from the layout a restarted process starts from), load that
checkpoint, train the rest, and compare the losses and the final parameters and optimizer
state bit for bit with the uninterrupted run. Set-ups: plain DDP, ``Checkpointer.resume()``,
``find_unused_parameters``, ``static_graph``, ``torch.compile(DDP(model))``,
``GradientAccumulation`` (``no_sync``; saved inside a window), ``gradient_as_bucket_view``
with ``zero_grad(set_to_none=False)``, a communication hook, and a load into the trained
objects themselves (going back to a checkpoint). ``--resized-from``: load the plain set-up's
checkpoint of a run with another world size (its layout is restored by parameter name; DDP
keeps it).

Each rank writes ``DIR/rank-<r>.json``: per set-up ``exact``, ``ulp`` (the largest
difference in units in the last place, for the report) and ddpckpt's warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from ddpckpt._format.manifest import read_manifest
from ddpckpt.storage._location import locate
from dist_worker import Warnings
from exiting import exit_now

MICRO, SAVE_AT = 8, 5  # micro-steps in all; the checkpoint after the 5th (inside a window of 2)


class Net(nn.Module):
    """Two gradient buckets once DDP rebuilds them (its first holds at most 1 MiB)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU())
        self.head = nn.Linear(1024, 1)
        self.spare = nn.Linear(4, 4) if unused else None  # find_unused_parameters finds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@dataclass
class Run:
    """One set-up's training objects and what it has done."""

    setup: str
    model: nn.Module
    ddp: DDP
    call: Callable[[torch.Tensor], torch.Tensor]  # the DDP, or torch.compile of it
    opt: torch.optim.Optimizer
    accumulation: ddpckpt.GradientAccumulation
    losses: list[float] = field(default_factory=list)

    def micro_steps(self, first: int, last: int, rank: int) -> None:
        window = self.setup == "accumulation"
        for micro in range(first, last):
            g = torch.Generator().manual_seed(1000 * micro + rank)
            x = torch.randn(8, 16, generator=g)
            context = self.accumulation.context() if window else contextlib.nullcontext()
            with context:
                loss = (self.call(x) - x.sum(1, keepdim=True)).square().mean()
                loss.backward()
            self.losses.append(loss.item())
            if window and not self.accumulation.step():
                continue
            self.opt.step()
            self.opt.zero_grad(set_to_none=self.setup != "bucket_view")

    def state(self) -> list[torch.Tensor]:
        tensors = [p.detach() for p in self.model.parameters()]
        for group in self.opt.param_groups:
            for p in group["params"]:
                tensors += [v for v in self.opt.state[p].values() if v.dim() > 0]
        return tensors


def build(setup: str) -> Run:
    torch.manual_seed(0)
    model = Net(unused=setup == "find_unused")
    ddp = DDP(
        model,
        find_unused_parameters=setup == "find_unused",
        static_graph=setup == "static_graph",
        gradient_as_bucket_view=setup == "bucket_view",
    )
    if setup == "comm_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    # aot_eager: inductor would compile C++ for minutes on the test machines' two cores.
    call = torch.compile(ddp, backend="aot_eager") if setup == "compile" else ddp
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    return Run(setup, model, ddp, call, opt, ddpckpt.GradientAccumulation(ddp, steps=2))


def ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def resume(setup: str, path: str, straight: Run, rank: int) -> Run:
    """The set-up built anew (or ``straight`` itself, going back), loaded from ``path`` and
    trained to the end."""
    run = straight if setup == "rollback" else build(setup)
    run.losses = straight.losses[:SAVE_AT]
    extra = {"accumulation": run.accumulation}
    if setup == "checkpointer":
        with ddpckpt.Checkpointer(path, model=run.ddp, optimizer=run.opt, extra=extra) as ckpt:
            assert ckpt.resume().step == SAVE_AT
    else:
        ddpckpt.load(path, model=run.ddp, optimizer=run.opt, extra=extra)
    run.micro_steps(SAVE_AT, MICRO, rank)
    return run


def check(setup: str, root: str, rank: int) -> dict[str, Any]:
    warnings = Warnings()
    straight = build(setup)
    straight.micro_steps(0, SAVE_AT, rank)
    path = os.path.join(root, setup)
    extra = {"accumulation": straight.accumulation}
    if setup == "checkpointer":
        with ddpckpt.Checkpointer(path, model=straight.ddp, optimizer=straight.opt,
                                  extra=extra) as ckpt:  # fmt: skip
            ckpt.save(SAVE_AT)
    else:
        ddpckpt.save(path, model=straight.ddp, optimizer=straight.opt, extra=extra, step=SAVE_AT)
    straight.micro_steps(SAVE_AT, MICRO, rank)
    losses, state = list(straight.losses), [t.clone() for t in straight.state()]
    again = resume(setup, path, straight, rank)
    pairs = list(zip(state, again.state(), strict=True))
    logging.getLogger("ddpckpt").removeHandler(warnings)
    return {
        "exact": again.losses == losses and all(torch.equal(a, b) for a, b in pairs),
        "ulp": max(ulp(a, b) for a, b in pairs),
        "warnings": warnings.messages,
    }


def resized(root: str, rank: int) -> dict[str, Any]:
    """Load the plain set-up's checkpoint of another world size: DDP gets its layout."""
    from ddpckpt._state.ddp_buckets import record_buckets  # the module under test

    warnings = Warnings()
    run = build("plain")
    path = os.path.join(root, "plain")
    ddpckpt.load(path, model=run.ddp, optimizer=run.opt, extra={"accumulation": run.accumulation})
    saved = read_manifest(locate(path)).state["model"]["ddp_buckets"]
    restored = record_buckets(run.ddp).to_json()
    run.micro_steps(SAVE_AT, MICRO, rank)  # DDP rebuilds its buckets: the same layout again
    kept = record_buckets(run.ddp).to_json()
    logging.getLogger("ddpckpt").removeHandler(warnings)
    return {"saved": saved, "restored": restored, "kept": kept, "warnings": warnings.messages}


SETUPS = ["plain", "checkpointer", "find_unused", "static_graph", "compile", "accumulation",
          "bucket_view", "comm_hook", "rollback"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["configs"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--only", default=",".join(SETUPS))
    parser.add_argument("--resized-from", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {setup: check(setup, args.ckpt, rank) for setup in args.only.split(",")}
    if args.resized_from:
        result["resized"] = resized(args.resized_from, rank)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
