"""DCP checkpoints written by torch's own ``dcp.save``, for the import tests (see launch.py;
same interface as dist_worker.py):

    python dcp_worker.py {ddp,fsdp2} --out DIR --ckpt ROOT
    python dcp_worker.py resume --out DIR --ckpt ROOT --imported PATH

Each rank trains a small MLP with AdamW for two steps (DDP, or FSDP2 with one ``fully_shard``
per layer and uneven shards), then saves ``get_state_dict``'s model and optimizer as the DCP
tutorial does, inside one ``{"app": ...}`` entry, to ``ROOT/dcp``. Rank 0 also writes
``ROOT/reference.pt``: the whole model and optimizer state, gathered by torch's own
``get_state_dict(full_state_dict=True)``.

``resume`` (at any number of ranks): an FSDP2 model and AdamW loaded from ``ROOT/dcp`` by
``dcp.load``, and another from ``PATH`` (its import) by ``ddpckpt.load``; both train two more
steps on the same batches, and each rank reports whether the two agree, whole, before and
after.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from exiting import exit_now


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 13), nn.ReLU(), nn.Linear(13, 5), nn.LayerNorm(5))


def fsdp2() -> tuple[nn.Module, torch.optim.Optimizer]:
    module = model()
    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(module)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2)


def whole(module: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_state, optim_state = get_state_dict(module, opt, options=full)
    moments = [
        v
        for name in sorted(optim_state["state"])
        for _, v in sorted(optim_state["state"][name].items())
    ]
    return [*model_state.values(), *moments]


def resume(args: argparse.Namespace, rank: int) -> dict[str, bool]:
    by_dcp, by_dcp_opt = fsdp2()
    model_state, optim_state = get_state_dict(by_dcp, by_dcp_opt)
    state = {"app": {"model": model_state, "optim": optim_state}}
    dcp.load(state, checkpoint_id=str(Path(args.ckpt) / "dcp"))
    set_state_dict(by_dcp, by_dcp_opt, model_state_dict=state["app"]["model"],
                   optim_state_dict=state["app"]["optim"])  # fmt: skip
    by_us, by_us_opt = fsdp2()
    ddpckpt.load(args.imported, model=by_us, optimizer=by_us_opt, rng=False)
    same = {
        "loaded": all(
            torch.equal(a, b)
            for a, b in zip(whole(by_dcp, by_dcp_opt), whole(by_us, by_us_opt), strict=True)
        )
    }
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        batch = torch.randn(4, 6)
        for module, opt in ((by_dcp, by_dcp_opt), (by_us, by_us_opt)):
            module(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    same["trained"] = all(
        torch.equal(a, b)
        for a, b in zip(whole(by_dcp, by_dcp_opt), whole(by_us, by_us_opt), strict=True)
    )
    return same


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["ddp", "fsdp2", "resume"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--imported")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if args.scenario == "resume":
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(resume(args, rank)))
        dist.barrier()
        dist.destroy_process_group()
        return
    module = model()
    if args.scenario == "ddp":
        trained: nn.Module = DDP(module)
    else:
        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        trained = fully_shard(module)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        trained(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model_state, optim_state = get_state_dict(trained, opt)
    dcp.save({"app": {"model": model_state, "optim": optim_state}},
             checkpoint_id=str(Path(args.ckpt) / "dcp"))  # fmt: skip
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full, optim_full = get_state_dict(trained, opt, options=full)
    if rank == 0:
        torch.save({"model": model_full, "optim": optim_full}, Path(args.ckpt) / "reference.pt")
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps({"saved": True}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
