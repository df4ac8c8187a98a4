"""A DDP training loop that survives being killed at any moment and resumes exactly.

    torchrun --nproc-per-node 2 examples/train_ddp.py --out demo-output

Kill it (even with SIGKILL, even during a save) and start the same command again: it
continues from the newest complete checkpoint and takes the very same steps an
uninterrupted run would have taken, down to the last bit of the final weights.

The recipe: a plain DataLoader (any num_workers) over a SeededDataset, ordered by a
ResumableDistributedSampler, saved as the loader (``extra={"loader": loader}``); the
Checkpointer saves every few steps and once after each epoch's loop; ``resume()`` restores
everything, random generators included, so nothing is seeded after it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ddpckpt


class NoisyRegression(Dataset):
    """Fixed inputs and targets; every access adds fresh random noise (an augmentation)."""

    def __init__(self, size: int = 512) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.05 * torch.randn(16), self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--every", type=int, default=5, help="save every N optimizer steps")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)).to(
        device
    )
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)

    dataset = NoisyRegression()
    sampler = ddpckpt.data.ResumableDistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(ddpckpt.data.SeededDataset(dataset, seed=0), sampler=sampler, batch_size=16,
                        num_workers=args.workers)  # fmt: skip

    torch.manual_seed(1000 + rank)  # each rank's own dropout; a resume restores it
    ckpt = ddpckpt.Checkpointer(
        os.path.join(args.out, "checkpoints"), model=ddp, optimizer=optimizer,
        scheduler=scheduler, extra={"loader": loader}, every_steps=args.every, keep_last=2,
    )  # fmt: skip
    info = ckpt.resume()  # every rank; None on a fresh start; skips a save a kill cut short
    step, start_epoch = (info.step, info.epoch) if info else (0, 0)
    if rank == 0 and info:
        print(f"resumed from step {step} (epoch {start_epoch})", flush=True)

    saved, loss = step, None
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # the restored epoch continues where it stopped
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if ckpt.should_save(step):  # every rank calls save; each writes its share
                ckpt.save(step, epoch=epoch, metrics={"loss": loss.item()})
                saved = step
        if step != saved:  # after the epoch's loop; a restart begins at the next epoch
            ckpt.save(step, epoch=epoch + 1)
            saved = step
        if rank == 0 and loss is not None:
            print(f"epoch {epoch}: step {step}, loss {loss.item():.4f}", flush=True)
    ckpt.close()
    if rank == 0:
        weights = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
        with open(os.path.join(args.out, "final-weights.json"), "w") as f:
            json.dump({"step": step, "weights": weights.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
