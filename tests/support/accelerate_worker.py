"""An Accelerate DDP run killed inside an epoch and resumed (see killed_run.py).

    accelerate_worker.py ddpckpt --out DIR --ports A,B,C   # ddpckpt's save_state/load_state
    accelerate_worker.py own --out DIR --ports A,B,C       # accelerator.save_state/load_state
                                                           # + skip_first_batches, as documented

Two epochs of 8 steps per process (a shuffled DataLoader, dropout whose random stream
differs per process, a scheduler), a checkpoint every 3 steps; process 1 is killed after
step 11, so the run resumes from step 9, inside the second epoch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpckpt
from ddpckpt.integrations.accelerate import load_state, save_state, training_state
from exiting import exit_now
from killed_run import batch_digest, kill_if_due, main, rank, weights_digest, width

EPOCHS, EVERY, KILL_AT, BATCHES = 2, 3, 11, 8


class Tracker:
    """An Accelerate tracker that keeps what it is given (checkpoint events among it)."""

    name, requires_logging_directory, main_process_only = "memory", False, True

    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def tracker(self) -> Tracker:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        pass


def fit(mode: str, directory: Path, kill_at: int | None, resume: bool) -> dict[str, Any]:
    """One training run (in a forked child); what to compare, and what it logged."""
    from accelerate.tracking import GeneralTracker

    tracker = type("MemoryTracker", (Tracker, GeneralTracker), {})()
    set_seed(0)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("run")
    torch.manual_seed(100 + rank())  # dropout: each process its own stream
    w = width()
    model = nn.Sequential(
        nn.Linear(8, w), nn.Dropout(0.3), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ours = mode == "ddpckpt"
    if ours:
        training_state(accelerator)  # before the loop: the loader's position from its first batch
    step, start_epoch, saves = 0, 0, []
    if resume:
        if ours:
            info = load_state(accelerator, ddpckpt.latest(directory))
            step, start_epoch = info.step, info.epoch
        else:
            newest = max(directory.iterdir(), key=lambda p: int(p.name.split("-")[1]))
            accelerator.load_state(newest)
            step = int(newest.name.split("-")[1])
            start_epoch = step // BATCHES
    losses, batches_seen = {}, {}
    for epoch in range(start_epoch, EPOCHS):
        batches = loader
        if resume and not ours and epoch == step // BATCHES:
            batches = accelerator.skip_first_batches(loader, step % BATCHES)
        for inputs, targets in batches:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            losses[step] = loss.item()
            batches_seen[step] = batch_digest(inputs, targets)
            if step % EVERY == 0:
                started = time.monotonic()
                path = directory / f"step-{step}"
                if ours:
                    save_state(accelerator, path, step=step, epoch=epoch)
                else:
                    accelerator.save_state(path)
                saves.append(time.monotonic() - started)
            kill_if_due(step, kill_at)
    accelerator.end_training()
    logged = [(s, v) for s, v in tracker.logged if any(k.startswith("checkpoint/") for k in v)]
    return {"losses": losses, "batches": batches_seen, "weights": weights_digest(model.module), "saves": saves,
            "logged": logged, "files": sorted(os.listdir(path))}  # fmt: skip


if __name__ == "__main__":
    main(fit, ["ddpckpt", "own"], KILL_AT)
    exit_now()  # not through the interpreter's teardown: see exiting.py
