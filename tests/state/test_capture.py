"""Capturing state from live objects: the snapshot holds the live tensors, not copies."""

from __future__ import annotations

from conftest import make_mlp
from ddpckpt._state.capture import TrainingState, capture


def test_snapshot_shares_memory_with_live_tensors() -> None:
    model = make_mlp()
    snapshot = capture(TrainingState.of(model=model, rng=False))
    assert snapshot.tensors["model/0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert snapshot.rank_state == {}
