"""Writing collectively (ddpckpt._io.writing): what travels through the store, with real ranks."""

from __future__ import annotations

import pytest

from launch import torchrun_nodes

pytestmark = pytest.mark.distributed


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
