"""A DDP script started the way the PyTorch tutorials start one: ``torch.multiprocessing.spawn``
and ``init_process_group`` with an explicit ``init_method``, rank and world size (no torchrun,
no ``WORLD_SIZE`` in the environment), training a GAN-like pair of models with two optimizers
in a plain ``ddpckpt.latest`` / ``ddpckpt.load`` / ``ddpckpt.save`` loop.

    python spawn_train.py --dir DIR [--init tcp|file|env] [--port PORT] [--world 2]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt

STEPS, EVERY = 12, 4


def worker(rank: int, args: argparse.Namespace) -> None:
    if args.init == "tcp":
        init = f"tcp://127.0.0.1:{args.port}"
    elif args.init == "file":
        init = f"file://{os.path.abspath(args.rendezvous)}"
    else:
        init = "env://"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    G = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
    D = DDP(nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)))
    opt_G = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_D = torch.optim.Adam(D.parameters(), lr=1e-3)
    state = ddpckpt.TrainingState(G=G, D=D, opt_G=opt_G, opt_D=opt_D)
    torch.manual_seed(100 + rank)  # each rank's own data

    start = 0
    path = ddpckpt.latest(args.dir)
    if path is not None:
        start = ddpckpt.load(path, state).step + 1
    for step in range(start, STEPS):
        real, noise = torch.randn(8, 4), torch.randn(8, 4)
        opt_D.zero_grad()
        (D(G(noise).detach()).mean() - D(real).mean()).backward()
        opt_D.step()
        opt_G.zero_grad()
        (-D(G(noise)).mean()).backward()
        opt_G.step()
        if step % EVERY == EVERY - 1:
            ddpckpt.save(os.path.join(args.dir, f"step-{step}"), state, step=step)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--init", choices=["tcp", "file", "env"], default="tcp")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rendezvous", default="rendezvous-file")
    args = parser.parse_args()
    if args.init == "file" and os.path.exists(args.rendezvous):
        os.remove(args.rendezvous)  # a killed run leaves it; init_process_group needs it new
    if args.init == "env":
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port)})
    mp.spawn(worker, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    main()
