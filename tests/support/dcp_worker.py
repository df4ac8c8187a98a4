"""DCP checkpoints written by torch's own ``dcp.save``, for the import tests (see launch.py;
same interface as dist_worker.py):

    python dcp_worker.py {ddp,fsdp2} --out DIR --ckpt ROOT

Each rank trains a small MLP with AdamW for two steps (DDP, or FSDP2 with one ``fully_shard``
per layer and uneven shards), then saves ``get_state_dict``'s model and optimizer as the DCP
tutorial does, inside one ``{"app": ...}`` entry, to ``ROOT/dcp``. Rank 0 also writes
``ROOT/reference.pt``: the whole model and optimizer state, gathered by torch's own
``get_state_dict(full_state_dict=True)``.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from exiting import exit_now


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 13), nn.ReLU(), nn.Linear(13, 5), nn.LayerNorm(5))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["ddp", "fsdp2"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
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
