"""Every rank of a DDP job whose newest checkpoint is damaged on one rank's copy only.

    python partial_worker.py partial --out DIR

``memory://`` storage is per process, and each rank is told it is a node of its own, so
each rank keeps and reads its own copy of a checkpoint:
rank 1's copy of the optimizer's file of step 2 has a flipped byte, rank 0's is sound.
Rank 0 restores step 2 completely, rank 1 partly; every rank must treat the load as
partial (and refuse to save) all the same, and ``load_latest`` must restore step 1 exactly
on every rank. Each rank writes what it saw to ``DIR/rank-N.json`` (see launch.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from exiting import exit_now
from io_helpers import flip_byte

RUN = "memory://partial"


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()


def _same(a: Any, b: Any) -> bool:
    """Equal state dicts, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _outcome(call: Any) -> str:
    try:
        call()
    except ddpckpt.CheckpointError as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "none"
        return f"{type(exc).__name__} from {cause}: {exc}"
    return "ok"


def scenario_partial(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt)
    ddpckpt.save(f"{RUN}/step-1", model=model, optimizer=opt, step=1, timeout=60)
    at_1 = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt)
    ddpckpt.save(f"{RUN}/step-2", model=model, optimizer=opt, step=2, timeout=60)
    _train(model, opt)
    store = ddpckpt.storage.storage_for(RUN)
    result: dict[str, Any] = {"files": sorted(store.list(f"{RUN}/step-2"))}
    if rank == 1:  # this rank's own copy only: the optimizer's last tensor
        state_file = max(n for n in result["files"] if n.startswith("state-"))
        damaged = f"{RUN}/step-2/{state_file}"
        flip_byte(damaged, store.size(damaged) - 3)
    result["load"] = _outcome(
        lambda: ddpckpt.load(f"{RUN}/step-2", model=model, optimizer=opt, timeout=60)
    )
    result["save"] = _outcome(
        lambda: ddpckpt.save(f"{RUN}/step-3", model=model, optimizer=opt, step=3, timeout=60)
    )
    info = ddpckpt.load_latest(RUN, model=model, optimizer=opt, timeout=60)
    result["latest_step"] = info.step if info is not None else None
    result["exact"] = _same(model.state_dict(), at_1[0]) and _same(opt.state_dict(), at_1[1])
    result["save_after"] = _outcome(
        lambda: ddpckpt.save(f"{RUN}/step-3", model=model, optimizer=opt, step=3, timeout=60)
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["partial"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Each rank a node of its own (as torchrun --node-rank tells them apart, see node_id),
    # whose memory:// storage no other rank sees: a checkpoint is kept once per rank.
    os.environ["GROUP_RANK"] = os.environ["RANK"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    result = scenario_partial(rank)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
