"""The tensors a checkpoint on disk holds, read with safetensors itself (not ddpckpt).

Fixtures of old formats were made by training a few steps; recomputing that training on
another CPU can differ in the last bit (vectorised kernels differ between instruction
sets), so tests compare what ddpckpt loads with the stored bytes exactly and with the
recomputation only to a float tolerance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ddpckpt.storage._location import locate


def stored_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_loaded_as_stored(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint: str | Path
) -> None:
    """Every model tensor and optimizer state tensor equals the stored one, bit for bit."""
    stored = stored_tensors(checkpoint)
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
    if optimizer is None:
        return
    names = {p: n for n, p in model.named_parameters()}
    checked = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, stored[f"optimizer/state/{names[param]}/{key}"])
                checked += 1
    assert checked, "the optimizer holds no state"


def assert_near_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Same param groups; state tensors equal up to float rounding."""
    a_state, b_state = a.state_dict(), b.state_dict()
    assert a_state["param_groups"] == b_state["param_groups"]
    torch.testing.assert_close(a_state["state"], b_state["state"])


def shard_piece(checkpoint: str | Path, name: str, index: int) -> tuple[str, int]:
    """The file and first byte of the ``index``-th shard (in offset order) of the sharded
    tensor ``name``, wherever the format keeps its record (the manifest or an index file)."""
    from ddpckpt._format.manifest import read_manifest
    from ddpckpt._io.reader import all_pieces

    pieces = all_pieces(locate(str(checkpoint)), read_manifest(locate(str(checkpoint))))[name]
    piece = sorted(pieces, key=lambda p: p.offsets)[index]
    return piece.entry.file, piece.entry.begin
