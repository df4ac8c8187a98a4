"""A small DDP job saving onto a tiny file system that then fills up; see test_save.py.

    (under torchrun) python full_disk_worker.py full --out OUT --dir DIR

Every rank saves a tiny model (about 50 KiB) to DIR/first, writes its result to
OUT/rank-N.json, then rank 0 fills DIR's file system and every rank saves again to
DIR/second, leaving the error to propagate out of the script as in a user's job.
"""

from __future__ import annotations

import argparse
import errno
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import ddpckpt


def fill(directory: str) -> None:
    """Write one file until the file system refuses more."""
    try:
        with open(os.path.join(directory, "filler"), "wb", buffering=0) as out:
            while True:
                out.write(b"\0" * 4096)
    except OSError as exc:  # raised by a write or by the close
        if exc.errno != errno.ENOSPC:
            raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["full"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(100, 120))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = ddpckpt.save(os.path.join(args.dir, "first"), model=model, optimizer=opt, step=1)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as out:
        json.dump({"first": first}, out)
    dist.barrier()
    if rank == 0:
        fill(args.dir)
    dist.barrier()
    ddpckpt.save(os.path.join(args.dir, "second"), model=model, optimizer=opt, step=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
