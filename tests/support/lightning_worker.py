"""A Lightning DDP run killed inside an epoch and resumed (see killed_run.py).

    lightning_worker.py ddpckpt --out DIR --ports A,B,C  # DdpckptCheckpointIO + ExactResume
    lightning_worker.py own --out DIR --ports A,B,C      # Lightning's own checkpointing
    (io: DdpckptCheckpointIO alone; callback: ExactResume with Lightning's own CheckpointIO;
    onecycle: ddpckpt's, with a OneCycleLR sized by trainer.estimated_stepping_batches;
    reload: ddpckpt's, with reload_dataloaders_every_n_epochs=1; the train data's targets
    are drawn from the global random stream, so each build depends on it)

Two epochs of 8 steps per rank (a shuffling DistributedSampler, a loader worker, dropout
whose random stream differs per rank), a checkpoint every 3 steps, a validation after every
step (the resumed run does not repeat the one after its checkpoint); rank 1 is killed after
step 11, so the run resumes from step 9, inside the second epoch.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpckpt.integrations.lightning import DdpckptCheckpointIO, ExactResume
from exiting import exit_now
from killed_run import batch_digest, kill_if_due, main, rank, weights_digest, width

EPOCHS, EVERY, KILL_AT = 2, 3, 11
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        w = width()
        self.net = nn.Sequential(
            nn.Linear(8, w), nn.Dropout(0.3), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.net(inputs), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(inputs), targets))

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2)
        data = TensorDataset(torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,)))
        return DataLoader(data, batch_size=4)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 2, (64,)))
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=1)


class OneCycleNet(Net):
    """As Lightning's documentation sizes a OneCycleLR: reading
    ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, which sets the train
    loaders up before the loops' progress is restored."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Record(pl.Callback):
    """Each step's loss on this rank; kills rank 1 after step ``kill_at``."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.losses: dict[int, float] = {}
        self.batches: dict[int, str] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()
        self.batches[trainer.global_step] = batch_digest(*batch)
        kill_if_due(trainer.global_step, self.kill_at)


class Metrics(Logger):
    """What the run logged (checkpoint events among it)."""

    name, version = "memory", 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def fit(mode: str, directory: Path, kill_at: int | None, resume: bool) -> dict[str, Any]:
    """One training run (in a forked child); what to compare, and what it logged."""
    pl.seed_everything(0, verbose=False)  # the sampler's seed, the same on every rank
    torch.manual_seed(100 + rank())  # dropout: each rank its own stream
    module = OneCycleNet() if mode == "onecycle" else Net()
    record, metrics = Record(kill_at), Metrics()
    checkpoints = ModelCheckpoint(
        directory, every_n_train_steps=EVERY, save_top_k=-1, save_last=True
    )
    ours = ("ddpckpt", "onecycle", "reload")
    io, callback = mode in (*ours, "io"), mode in (*ours, "callback")
    trainer = pl.Trainer(
        accelerator="cpu", strategy="ddp", devices=2, max_epochs=EPOCHS, logger=metrics,
        callbacks=[record, checkpoints, *([ExactResume()] if callback else [])],
        plugins=[DdpckptCheckpointIO()] if io else None, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        val_check_interval=1, limit_val_batches=1,  # after every step: the resumed run skips one
        reload_dataloaders_every_n_epochs=1 if mode == "reload" else 0,
    )  # fmt: skip
    saves: list[float] = []
    save = trainer.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> None:
        started = time.monotonic()
        save(*args, **kwargs)
        saves.append(time.monotonic() - started)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    started = time.monotonic()
    trainer.fit(module, ckpt_path="last" if resume else None)
    return {
        "losses": record.losses,
        "batches": record.batches,
        "weights": weights_digest(module),
        "seconds": time.monotonic() - started,
        "saves": saves,
        "logged": [
            (s, m) for s, m in metrics.logged if any(k.startswith("checkpoint/") for k in m)
        ],
    }


if __name__ == "__main__":
    main(fit, ["ddpckpt", "own", "io", "callback", "onecycle", "reload"], KILL_AT)
    exit_now()  # not through the interpreter's teardown: see exiting.py
