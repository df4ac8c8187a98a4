"""Helpers of the save and load tests: what a directory holds, damage, equal state."""

from __future__ import annotations

import torch

from ddpckpt.storage import storage_for


def names_in(directory: str) -> list[str]:
    """What ``directory`` holds (nothing if it does not exist), in whichever storage."""
    try:
        return sorted(storage_for(directory).list(directory))
    except FileNotFoundError:
        return []


def parent_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0]


def flip_byte(path: str, offset: int) -> None:
    storage = storage_for(path)
    data = bytearray(storage.read(path))
    data[offset] ^= 0x01
    storage.replace(path, bytes(data))


def assert_state_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), key
        elif isinstance(x, dict):
            assert_state_equal(x, y)
        else:
            assert x == y, key


class Counter:
    """A user object with state_dict/load_state_dict (e.g. a data position)."""

    def __init__(self) -> None:
        self.seen = 0
        self.history: list[int] = []

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], list(state["history"])
