"""Type-checked, never run: the public API used the way the documentation shows.

``mypy`` (``make lint``) checks this file against ddpckpt's annotations, so a signature or
return type that would break a user's type-checked code fails CI.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpckpt
from ddpckpt.data import ResumableDistributedSampler, SeededDataset, track_loader
from ddpckpt.errors import CheckpointError, CorruptCheckpointError
from ddpckpt.policies import AnyOf, EverySeconds, EverySteps, KeepAnyOf, KeepBest, KeepLast
from ddpckpt.storage import Reader, Storage, Writer, register


def plain_api(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    start = 0
    path: str | None = ddpckpt.latest("ckpt")
    if path is not None:
        info: ddpckpt.CheckpointInfo = ddpckpt.load(
            path, model=model, optimizer=optimizer, scheduler=scheduler
        )
        start = (info.step or 0) + 1
    saved = ddpckpt.save(f"ckpt/step-{start}", model=model, optimizer=optimizer, step=start)
    if isinstance(saved, ddpckpt.PendingSave):
        saved.wait()
    weights: dict[str, torch.Tensor] = ddpckpt.load_state_dict("ckpt/step-0")
    return start + len(weights)


def checkpointer(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    data = TensorDataset(torch.randn(8, 4))
    sampler = ResumableDistributedSampler(data, num_replicas=1, rank=0)
    loader = track_loader(DataLoader(SeededDataset(data, seed=0), sampler=sampler))
    state = ddpckpt.TrainingState(model=model, optimizer=optimizer, loader=loader)
    policy = AnyOf(EverySteps(10), EverySeconds(600.0))
    keep = KeepAnyOf(KeepLast(2), KeepBest(1, "loss"))
    with ddpckpt.Checkpointer("runs/x", state, save_policy=policy, retention=keep) as ckpt:
        info = ckpt.resume()
        step = info.step if info is not None and info.step is not None else 0
        if ckpt.should_save(step):
            ckpt.save(step, metrics={"loss": 0.5})
        steps: list[int] = ckpt.steps()
        latest: int | None = ckpt.latest_step()
    return len(steps) + (latest or 0)


def errors() -> str:
    try:
        ddpckpt.verify("ckpt/step-0")
    except CorruptCheckpointError as exc:
        return str(exc)
    except CheckpointError:
        return "other"
    return "ok"


class MyStorage(Storage):
    """A user's storage backend must be able to subclass the interface."""


def backend(make: type[MyStorage]) -> None:
    register("mine", lambda url: make())
    _: tuple[type[Reader], type[Writer]] = (Reader, Writer)


def dicts() -> Iterator[object]:
    ddpckpt.save_dict("plugin/epoch=1.ckpt", {"state_dict": {}}, step=1)
    yield ddpckpt.load_dict("plugin/epoch=1.ckpt", map_location="cpu")
