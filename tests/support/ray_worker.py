"""Ray Train runs on a local Ray cluster (loopback), written as Ray Train's docs teach:
``TorchTrainer``, ``ScalingConfig(num_workers=2)``, ``prepare_model``,
``prepare_data_loader``, ``FailureConfig(max_failures=1)``, ``CheckpointConfig``.

    ray_worker.py --out DIR [--storage s3://bucket/prefix]

Two runs of the same training function in one Ray session, 2 workers, 14 steps over two
epochs of a shuffled DataLoader with dropout, a checkpoint every 3 steps
(``ddpckpt.integrations.ray.report``): ``reference`` uninterrupted; ``killed``, whose
worker 1 SIGKILLs itself after step 8 of its first attempt (Ray Train restarts the worker
group, which resumes through ``ddpckpt.integrations.ray.resume``). Writes ``DIR/result.json``:
per run and worker, each step's loss and batch (the last attempt's), the step each attempt
resumed from, the final weights' digest, and the checkpoints left in the run's storage.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, EVERY, KILL_AFTER = 14, 3, 8


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    import ddpckpt
    from ddpckpt.integrations.ray import report, resume

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True))
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ddpckpt.TrainingState(model=model, optimizer=optimizer, loader=loader)
    info = resume(state)
    step, start_epoch = (info.step, info.epoch) if info else (0, 0)
    log = Path(config["out"]) / f"{config['run']}-rank{rank}.jsonl"
    with log.open("a") as out:
        out.write(json.dumps({"resumed_from": step}) + "\n")
    for epoch in range(start_epoch, 2):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            with log.open("a") as out:
                out.write(json.dumps({"step": step, "loss": loss.item(),
                                      "batch": inputs.sum().item()}) + "\n")  # fmt: skip
            if step % EVERY == 0:
                report({"loss": loss.item()}, state, step=step, epoch=epoch)
            killed = Path(config["out"]) / "killed"
            if config["kill"] and rank == 1 and step == KILL_AFTER and not killed.exists():
                killed.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == STEPS:
                break
        if step == STEPS:
            break
    digest = [p.detach().sum().item() for p in model.parameters()]
    with log.open("a") as out:
        out.write(json.dumps({"weights": digest}) + "\n")


def main() -> None:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ddpckpt.storage import storage_for

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--storage", help="RunConfig(storage_path=...); default: OUT/storage")
    args = parser.parse_args()
    storage = args.storage or str(args.out / "storage")
    ray.init(num_cpus=2, include_dashboard=False)
    result: dict[str, Any] = {}
    for run, kill in (("reference", False), ("killed", True)):
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"out": str(args.out), "run": run, "kill": kill},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                storage_path=storage, name=run,
                failure_config=FailureConfig(max_failures=1),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )  # fmt: skip
        fit = trainer.fit()
        ranks = {}
        for rank in (0, 1):
            lines = [json.loads(x) for x in (args.out / f"{run}-rank{rank}.jsonl").open()]
            ranks[rank] = {
                "resumed_from": [x["resumed_from"] for x in lines if "resumed_from" in x],
                "steps": {x["step"]: [x["loss"], x["batch"]] for x in lines if "step" in x},
                "weights": [x["weights"] for x in lines if "weights" in x][-1],
            }
        result[run] = {
            "ranks": ranks,
            "checkpoint": os.path.basename(fit.checkpoint.path),
            "stored": sorted(storage_for(storage).list(f"{storage}/{run}")),
        }
    (args.out / "result.json").write_text(json.dumps(result))
    ray.shutdown()


if __name__ == "__main__":
    main()
