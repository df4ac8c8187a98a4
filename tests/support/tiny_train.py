"""A tiny DDP training script that resumes exactly, and the classic ways to break that.

    torchrun --nproc-per-node 2 tiny_train.py --dir DIR

``PLANTED_BUG`` (environment) plants one bug; ``numpy``, ``scheduler``, ``broadcast`` and
``epoch`` act only after a resume, so an uninterrupted run is the same with or without them:

* ``numpy``: numpy is seeded after ``resume()``;
* ``scheduler``: the scheduler is stepped once more after ``resume()``;
* ``broadcast``: rank 0's model state is broadcast to every rank after ``resume()``, which
  overwrites the other ranks' own BatchNorm statistics (``broadcast_buffers=False``);
* ``optimizer``: the optimizer is created after ``resume()`` and not passed to it;
* ``loader``: the DataLoader (a torch ``DistributedSampler``) is not given to the
  Checkpointer, so a resumed epoch starts over;
* ``augment``: loader workers add noise from their own global RNG (no ``SeededDataset``);
* ``epoch``: the loop restarts at ``info.epoch + 1`` (the ImageNet example's habit), which
  skips the rest of an epoch a checkpoint was saved in;
* ``unseeded``: neither torch nor numpy is ever seeded (two runs differ from the start);
* ``teardown``: rank 1 aborts after its script ended, as torch 2.13's gloo threads make
  finished processes do at random (see exiting.py); ``exit-3``: rank 1 ends with
  ``sys.exit(3)`` after its last step.

``SHARDED`` (environment) trains the same model with sharded state instead: ``zero`` (DDP
with a ``ZeroRedundancyOptimizer``) or ``fsdp`` (FSDP2 ``fully_shard`` per linear layer).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpckpt
from exiting import exit_now

BUG = os.environ.get("PLANTED_BUG", "")
SHARDED = os.environ.get("SHARDED", "")


class Noisy(Dataset):
    """Fixed samples; each access adds fresh random noise (an augmentation)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.05 * torch.randn(6), self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if BUG != "unseeded":
        torch.manual_seed(0)
        np.random.seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 1))  # fmt: skip
    if SHARDED == "fsdp":
        for layer in (model[0], model[4], model):
            fully_shard(layer)
        ddp = model
    else:
        ddp = DDP(model, broadcast_buffers=False)
    if SHARDED == "zero":
        # imported only here: its functional optimizers compile TorchScript at import (half
        # a second of CPU in every rank of every run the other checks start)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=1e-2)  # fmt: skip
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    if BUG == "optimizer":  # made below, after resume(); a constant learning rate
        optimizer = scheduler = None

    dataset = Noisy(24 * dist.get_world_size())  # 6 steps an epoch at any world size
    if BUG == "loader":
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, sampler=sampler, batch_size=4)
    else:
        sampler = ddpckpt.data.ResumableDistributedSampler(dataset, shuffle=True, seed=0)
        data = dataset if BUG == "augment" else ddpckpt.data.SeededDataset(dataset, seed=0)
        workers = 2 if BUG == "augment" else 0
        loader = DataLoader(data, sampler=sampler, batch_size=4, num_workers=workers)
    if BUG != "unseeded":
        torch.manual_seed(100 + rank)  # each rank's own dropout

    ckpt = ddpckpt.Checkpointer(
        os.path.join(args.dir, "ckpt"),
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        extra={} if BUG == "loader" else {"loader": loader},
        every_steps=4,
    )
    info = ckpt.resume()
    if info is not None and BUG == "numpy":
        np.random.seed(0)
    if info is not None and BUG == "scheduler":
        scheduler.step()
    if info is not None and BUG == "broadcast":
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, 0)
    if BUG == "optimizer":
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    step, start_epoch = (info.step, info.epoch) if info else (0, 0)
    if info is not None and BUG == "epoch":
        start_epoch += 1
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            scale = 1.0 + float(np.random.uniform(-0.01, 0.01))  # numpy in the step
            loss = nn.functional.mse_loss(ddp(x) * scale, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            step += 1
            ckpt.log_step(loss)
            if ckpt.should_save(step):
                ckpt.save(step, epoch=epoch)
        ckpt.save(step, epoch=epoch + 1)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if BUG == "exit-3" and os.environ["RANK"] == "1":
        sys.exit(3)
    if BUG == "teardown" and os.environ["RANK"] == "1":
        atexit._run_exitfuncs()
        os.abort()
    exit_now()  # not through the interpreter's teardown: see exiting.py
