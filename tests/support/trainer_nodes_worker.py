"""A ``DdpckptTrainer`` run under torchrun, for simulated nodes (launch.torchrun_nodes).

    trainer_nodes_worker.py rotate --out DIR --output-dir out

A tiny GPT-2 on 2 ranks per node, 8 steps, a checkpoint every 2 steps with
``save_total_limit=2``; ``--output-dir`` is relative, so each node (its own working
directory) has a disk of its own. Each rank writes ``DIR/rank-R.json``: the checkpoints its
node's copy holds, and which of them have a ``trainer_state.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

from ddpckpt.integrations.transformers import DdpckptTrainer
from exiting import exit_now
from transformers_worker import Tokens

hf_logging.set_verbosity_error()
logging.getLogger("ddpckpt").setLevel(logging.WARNING)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["rotate"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    )
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=4, max_steps=8,
        save_strategy="steps", save_steps=2, save_total_limit=2, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
    )  # fmt: skip
    DdpckptTrainer(model=model, args=training, train_dataset=Tokens()).train()
    out = Path(args.output_dir)
    names = sorted(os.listdir(out))
    result = {
        "node": os.environ["GROUP_RANK"],
        "checkpoints": names,
        "trainer_state": [n for n in names if (out / n / "trainer_state.json").is_file()],
    }
    (args.out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
