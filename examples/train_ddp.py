"""A DDP training loop that checkpoints with ddpckpt and resumes where it stopped.

    torchrun --nproc-per-node 2 examples/train_ddp.py --out demo-output

Run it twice: the second run resumes from the last checkpoint of the first.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    # Resume: every rank calls load; it restores model, optimizer, scheduler and RNG.
    start = 0
    checkpoints = os.path.join(args.out, "checkpoints")
    done = (
        sorted(int(d.split("-")[1]) for d in os.listdir(checkpoints))
        if os.path.isdir(checkpoints)
        else []
    )
    if done:
        info = ddpckpt.load(
            f"{checkpoints}/step-{done[-1]}", model=ddp, optimizer=optimizer, scheduler=scheduler
        )
        start = info.step
    torch.manual_seed(1000 + rank)  # different data on each rank

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, 16, device=device)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % args.every == 0:  # every rank calls save; each writes its share
            path = ddpckpt.save(f"{checkpoints}/step-{step}", model=ddp, optimizer=optimizer,
                                scheduler=scheduler, step=step, metrics={"loss": loss.item()})  # fmt: skip
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saved {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
