"""Schedulers and ``extra`` objects in a checkpoint: what cannot be stored, what is verified."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import make_mlp
from ddpckpt._state.capture import TrainingState, capture
from ddpckpt.errors import UnsupportedValueError


def test_unstorable_scheduler_state_names_the_key() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Odd:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, state):  # pragma: no cover - never reached
            pass

    with pytest.raises(UnsupportedValueError, match="extra/odd/fn"):
        capture(TrainingState.of(model=model, optimizer=opt, extra={"odd": Odd()}))


def test_a_module_valued_extra_is_verified_not_assumed_replicated(process_group) -> None:
    model = make_mlp()
    ddp = DDP(model)
    ema = torch.optim.swa_utils.AveragedModel(model)
    snapshot = capture(TrainingState.of(model=ddp, extra={"ema": ema}, rng=False))
    ema_names = {n for n in snapshot.tensors if n.startswith("extra/ema/")}
    assert "extra/ema/module.0.weight" in snapshot.unverified
    assert "extra/ema/n_averaged" in snapshot.unverified  # buffers too: no DDP broadcasts them
    assert not ema_names & snapshot.balanced


def test_a_torch_sampler_in_extra_points_at_its_loader() -> None:
    """torch's own DistributedSampler has no state: the message says to save the loader."""
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=0)
    with pytest.raises(UnsupportedValueError, match=r"extra=\{'loader': loader\}"):
        capture(TrainingState.of(model=make_mlp(), extra={"sampler": sampler}, rng=False))
