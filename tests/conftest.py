"""Shared fixtures: small models, a one-process gloo group, seeded RNG."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn


class TiedLM(nn.Module):
    """An embedding tied to the output layer, plus a norm with buffers."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3, scheduler=None
) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-rank gloo group on loopback, so DDP can wrap a module in-process."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def ckpt_dir(tmp_path) -> str:
    return os.fspath(tmp_path / "ckpt")
