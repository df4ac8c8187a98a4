"""Writing collectively (ddpckpt._io.writing): what travels through the store, with real ranks."""

from __future__ import annotations

import os
import re

import pytest
from torch import nn

import ddpckpt
from ddpckpt.errors import InsufficientSpaceError
from ddpckpt.storage import storage_for
from launch import torchrun_nodes


def _checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def test_a_small_checkpoint_fits_in_little_more_than_its_size(tmp_path, monkeypatch) -> None:
    model = nn.Linear(100, 120)  # about 47 KiB
    size = _checkpoint_bytes(ddpckpt.save(os.fspath(tmp_path / "measured"), model=model))
    free = size + 32 * 1024  # far less than the 1 MiB a fixed reserve kept
    monkeypatch.setattr(type(storage_for(os.fspath(tmp_path))), "free_bytes", lambda *_: free)
    assert ddpckpt.verify(ddpckpt.save(os.fspath(tmp_path / "fits"), model=model)) is not None


def test_a_refusal_names_the_bytes_needed_and_free(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(type(storage_for(os.fspath(tmp_path))), "free_bytes", lambda *_: 20_000)
    target = os.fspath(tmp_path / "ckpt")
    with pytest.raises(InsufficientSpaceError) as refused:
        ddpckpt.save(target, model=nn.Linear(100, 120))
    text = str(refused.value)
    assert f"{target}: the checkpoint needs " in text and "only 20,000 bytes" in text
    assert re.search(r"needs [0-9,]+ bytes .* are free in " + re.escape(str(tmp_path)), text)
    assert not os.path.exists(target)


@pytest.mark.processes
def test_node_local_saves_mid_window_send_no_model_bytes_through_the_store(tmp_path) -> None:
    # Two simulated nodes with node-local disks: every node's copy needs every rank's file,
    # here holding the gradients of a half-finished accumulation window (model-sized).
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    results = (
        torchrun_nodes(
            "store_bytes", tmp_path / "out", args=["--ckpt", "ckpt"], cwds=nodes, timeout=240
        )
        .ok()
        .results
    )
    for rank, out in results.items():
        small, large = out["store_bytes"]["8"], out["store_bytes"]["2048"]
        growth = out["grad_bytes"]["2048"] - out["grad_bytes"]["8"]  # ~ 300 KB more per rank
        assert large - small < growth / 20, (rank, small, large)
        assert out["grads_restored"] == [True, True], rank
    assert all((node / "ckpt-2048" / "manifest.json").exists() for node in nodes)
