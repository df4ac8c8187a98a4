"""A transformers Trainer DDP run killed inside an epoch and resumed (see killed_run.py).

    transformers_worker.py ddpckpt --out DIR --ports A,B,C   # DdpckptTrainer
    transformers_worker.py own --out DIR --ports A,B,C       # the Trainer's own checkpoints

A tiny GPT-2 (dropout, tied embeddings), two epochs of 8 steps per process (the Trainer's
shuffled sampler), a checkpoint every 3 steps, the loss logged every 2 (so a resume from
step 9 must restore the loss accumulated since step 8); process 1 is killed after step 11,
and step 9's checkpoint lost its trainer_state.json (written after the commit).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ddpckpt.integrations.transformers import DdpckptTrainer, export_pretrained
from exiting import exit_now
from killed_run import batch_digest, kill_if_due, main, rank, weights_digest, width

KILL_AT, RESUMED_FROM = 11, 9
hf_logging.set_verbosity_error()
logging.getLogger("ddpckpt").setLevel(logging.WARNING)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Kill(TrainerCallback):
    """Kills process 1 after step ``kill_at``; before, takes away the trainer_state.json of
    the checkpoint the run will resume from (as a kill right after its commit would)."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.kill_at is not None and state.global_step == RESUMED_FROM and rank() == 0:
            Path(args.output_dir, f"checkpoint-{RESUMED_FROM}", "trainer_state.json").unlink()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kill_if_due(state.global_step, self.kill_at)


def recording(base: type[Trainer]) -> type[Trainer]:
    class Recording(base):  # type: ignore[misc, valid-type]
        """Each step's loss on this process, at full precision; the time of each save."""

        losses: dict[int, float]
        batches: dict[int, str]
        saves: list[float]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            first = loss[0] if isinstance(loss, tuple) else loss
            self.losses[self.state.global_step + 1] = first.item()
            self.batches[self.state.global_step + 1] = batch_digest(inputs["input_ids"])
            return loss

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            started = time.monotonic()
            super()._save_checkpoint(model, trial)
            self.saves.append(time.monotonic() - started)

    return Recording


def fit(mode: str, directory: Path, kill_at: int | None, resume: bool) -> dict[str, Any]:
    """One training run (in a forked child); what to compare, and what it logged."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=width(), n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(directory), per_device_train_batch_size=4, num_train_epochs=2,
        save_strategy="steps", save_steps=3, logging_steps=2, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, save_total_limit=2, dataloader_num_workers=0,
        ddp_backend="gloo", ddp_find_unused_parameters=False,
    )  # fmt: skip
    cls = recording(DdpckptTrainer if mode == "ddpckpt" else Trainer)
    trainer = cls(model=model, args=args, train_dataset=Tokens(), callbacks=[Kill(kill_at)])
    trainer.losses, trainer.batches, trainer.saves = {}, {}, []
    torch.manual_seed(100 + rank())  # dropout: each process its own stream
    trainer.train(resume_from_checkpoint=True if resume else None)
    logged = trainer.state.log_history
    exported = None
    if resume and mode == "ddpckpt" and rank() == 0:  # the last checkpoint, for from_pretrained
        release = export_pretrained(directory / "checkpoint-16", directory.parent / "release")
        exported = weights_digest(GPT2LMHeadModel.from_pretrained(release))
    return {
        "exported": exported,
        "losses": trainer.losses,
        "batches": trainer.batches,
        "weights": weights_digest(model),
        "saves": trainer.saves,
        "logged_losses": {e["step"]: e["loss"] for e in logged if "loss" in e},
        "checkpoint_events": [e for e in logged if "checkpoint/stall_s" in e],
        "checkpoints": sorted(os.listdir(directory)),
    }


if __name__ == "__main__":
    main(fit, ["ddpckpt", "own"], KILL_AT)
    exit_now()  # not through the interpreter's teardown: see exiting.py
