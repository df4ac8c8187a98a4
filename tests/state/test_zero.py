"""ZeroRedundancyOptimizer in one process: what cannot be saved is refused, naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt


def test_overlap_with_ddp_is_refused_and_nothing_stored(process_group, tmp_path) -> None:
    model = DDP(nn.Linear(4, 2))
    zero = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, overlap_with_ddp=True
    )
    with pytest.raises(
        ddpckpt.errors.UnsupportedValueError,
        match=r"^optimizer: ZeroRedundancyOptimizer\(overlap_with_ddp=True\) is not",
    ):
        ddpckpt.save(tmp_path / "ckpt", model=model, optimizer=zero)
    assert list(tmp_path.iterdir()) == []
