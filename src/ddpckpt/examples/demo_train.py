"""The training script of ``ddpckpt demo``: an ordinary DDP script that resumes exactly.

    torchrun --nproc-per-node 2 demo_train.py --dir runs/demo --steps 200 --every 20

A small network with dropout and BatchNorm learns a synthetic regression with AdamW, a
warm-up + cosine schedule, a GradScaler, an EMA and gradient accumulation 2, reading
shuffled, randomly augmented data through two loader workers (a plain torch DataLoader over
``ddpckpt.data.SeededDataset``, whose position the Checkpointer tracks; no torchdata needed). It checkpoints to
``--dir`` with a Checkpointer and resumes from the newest checkpoint whenever it (re)starts;
run it again, or under ``torchrun --max-restarts``, and it goes on where it stopped.
``ckpt.log_step(loss)`` hands each step's loss to ``ddpckpt check-resume`` (and does
nothing outside a check). ``ddpckpt demo`` runs ``ddpckpt check-resume`` on this file.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt


class Synthetic(torch.utils.data.Dataset):
    """y = sin(2 x0) + x1 x2 + x3 / 2, fixed data, with random input noise on every access."""

    def __init__(self, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        x = self.x
        self.y = (torch.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3]).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.05 * torch.randn(16), self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ["LOCAL_WORLD_SIZE"]
    )
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(16, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 1),
    ).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=1e-2)
    warmup = max(1, args.steps // 10)

    def schedule(step: int) -> float:  # linear warm-up, then cosine decay
        return (
            min(1.0, (step + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    )
    accumulation = ddpckpt.GradientAccumulation(ddp, steps=2)
    data = Synthetic()
    sampler = ddpckpt.data.ResumableDistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(  # a plain DataLoader: the Checkpointer tracks it
        ddpckpt.data.SeededDataset(data, seed=0),  # augmentation as a function of the index
        sampler=sampler,
        batch_size=32,
        num_workers=args.workers,
    )
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream

    ckpt = ddpckpt.Checkpointer(
        args.dir, model=ddp, optimizer=optimizer, scheduler=scheduler,
        scaler=scaler, extra={"ema": ema, "loader": loader, "accumulation": accumulation},
        every_steps=args.every, keep_last=3, keep_best=1, monitor="loss",
    )  # fmt: skip
    info = ckpt.resume()
    # ints: every checkpoint in --dir is this script's, saved with its step and epoch
    step, start_epoch = cast("tuple[int, int]", (info.step, info.epoch)) if info else (0, 0)
    window = 0.0
    epoch = start_epoch
    while step < args.steps:  # a run that already finished does nothing more
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with accumulation.context():
                loss = nn.functional.mse_loss(ddp(x), y) / accumulation.steps
                scaler.scale(loss).backward()
            window += loss.item()
            if not accumulation.step():
                continue
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scheduler.step()
            ema.update_parameters(model)
            step += 1
            ckpt.log_step(window)
            if ckpt.should_save(step):
                ckpt.save(step, epoch=epoch, metrics={"loss": window})
            window = 0.0
            if step == args.steps:
                break
        epoch += 1
    ckpt.close()
    dist.destroy_process_group()


def _exit_before_teardown() -> None:
    """End the process once the run is complete, skipping the interpreter's teardown: there,
    torch 2.13's gloo threads can abort a finished process ("terminate called without an
    active exception", pytorch/pytorch#190489), which would make the demo fail at random."""
    import atexit
    import sys
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _exit_before_teardown()
