"""What is hashed to check that state stored once is the same on every rank."""

from __future__ import annotations

import torch

import ddpckpt._coord.consistency as consistency
from ddpckpt._coord.consistency import check_replicated, tensor_digest
from ddpckpt._state.snapshot import Snapshot


def snapshot_of(sizes: dict[str, int]) -> Snapshot:
    tensors = {name: torch.zeros(n, dtype=torch.uint8) for name, n in sizes.items()}
    return Snapshot(tensors=tensors, balanced=set(tensors))


def test_canaries_are_the_smallest_replicated_tensors_within_the_budget(monkeypatch) -> None:
    monkeypatch.setattr(consistency, "CANARY_BYTES", 100)
    sizes = {"big": 1000, "bias": 10, "norm": 40, "mid": 60}
    assert consistency._canaries(snapshot_of(sizes)) == ["bias", "norm"]
    assert consistency._canaries(snapshot_of({"huge": 10**6})) == ["huge"]  # never none


def test_digest_covers_every_byte_and_ignores_layout() -> None:
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(value.t().contiguous().t()) == tensor_digest(value)
    changed = value.clone()
    changed[2, 3] = torch.nextafter(changed[2, 3], torch.tensor(100.0))
    assert tensor_digest(changed) != tensor_digest(value)


def test_one_process_stores_everything_once() -> None:
    from ddpckpt._coord.comm import Comm

    snapshot = snapshot_of({"a": 4, "b": 4})
    snapshot.balanced, snapshot.unverified, snapshot.per_rank = {"a"}, {"b"}, set()
    check_replicated(Comm.local("test"), snapshot)
    assert snapshot.balanced == {"a", "b"} and not snapshot.rank_tensors
