"""Small map-style datasets for the data-position tests."""

from __future__ import annotations

import random

import torch


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class Augmented(Numbers):
    """Random augmentation from the global generators, as user datasets do."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random()])
