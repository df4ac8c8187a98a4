"""One rank of tests/storage/test_location.py's launch: rank 1's node cannot resolve
``memory://`` URLs (as a node lacking a storage's client library cannot resolve its URLs);
each rank prints how ``save``, ``load`` and ``load_latest`` of such a URL ended."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import ddpckpt
from ddpckpt.storage import register
from exiting import exit_now

WAIT = 600  # seconds a rank would wait for a silent one: far beyond the launch's timeout


def unavailable(url: str):
    raise ImportError(f"{url}: this node has no client library for memory:// URLs")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=WAIT))
    rank = dist.get_rank()
    if rank == 1:
        register("memory", unavailable)
    model = torch.nn.Linear(2, 2)
    calls = {
        "save": lambda: ddpckpt.save("memory://t/run/ck", model=model, timeout=WAIT),
        "load": lambda: ddpckpt.load("memory://t/run/ck", model=model, timeout=WAIT),
        "load_latest": lambda: ddpckpt.load_latest("memory://t/run", model=model, timeout=WAIT),
    }
    for name, call in calls.items():
        try:
            call()
            outcome = "ok"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        print(f"rank {rank} {name}: {outcome}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
