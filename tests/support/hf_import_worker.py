"""A Trainer checkpoint of a two-process run, resumed by the Trainer itself and, imported, by
DdpckptTrainer (see tests/convert/test_hf.py; same interface as dist_worker.py):

    python hf_import_worker.py train --out DIR --dir RUN   # Trainer, stopped after step 4
    python hf_import_worker.py own --out DIR --dir RUN     # Trainer, from RUN/hf/checkpoint-4
    python hf_import_worker.py ours --out DIR --dir RUN    # DdpckptTrainer, from RUN/ddp

A tiny GPT-2 with dropout, each process drawing from its own random stream, 8 steps, a
checkpoint every 2. Each process reports its losses after step 4 (its own batches, its own
dropout masks) and the final weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ddpckpt.integrations.transformers import DdpckptTrainer
from exiting import exit_now
from killed_run import rank, weights_digest
from transformers_worker import Tokens

STOP = 4
hf_logging.set_verbosity_error()


class Stop(TrainerCallback):
    def __init__(self, stop: bool) -> None:
        self.stop = stop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_training_stop = self.stop and state.global_step >= STOP


def recording(base: type[Trainer]) -> type[Trainer]:
    class Recording(base):  # type: ignore[misc, valid-type]
        losses: dict[int, float]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            first = loss[0] if isinstance(loss, tuple) else loss
            self.losses[self.state.global_step + 1] = first.item()
            return loss

    return Recording


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "own", "ours"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    run = Path(args.dir)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                       n_head=2))  # fmt: skip
    output = run / ("ddp" if args.scenario == "ours" else "hf")
    training = TrainingArguments(
        output_dir=str(output), per_device_train_batch_size=4, max_steps=8,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
        ddp_find_unused_parameters=False,
    )  # fmt: skip
    cls = recording(DdpckptTrainer if args.scenario == "ours" else Trainer)
    trainer = cls(model=model, args=training, train_dataset=Tokens(),
                  callbacks=[Stop(args.scenario == "train")])  # fmt: skip
    trainer.losses = {}
    torch.manual_seed(100 + rank())  # dropout: each process its own stream
    resume = {"train": None, "own": str(output / f"checkpoint-{STOP}"), "ours": True}
    trainer.train(resume_from_checkpoint=resume[args.scenario])
    result = {"losses": {s: v for s, v in trainer.losses.items() if s > STOP},
              "weights": weights_digest(model)}  # fmt: skip
    Path(args.out, f"rank-{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
