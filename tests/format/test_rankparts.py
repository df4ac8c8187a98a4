"""Per-rank state in the rank files (ddpckpt._format.rankparts): a manifest that does not grow
with it, each rank reading its own part, and format-2 checkpoints still loading."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt import GradientAccumulation
from ddpckpt._format.manifest import read_manifest
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate
from stored import assert_loaded_as_stored, assert_near_optimizer, stored_tensors

V2_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "format-v2-ranks")


class History:
    """Per-rank state of plain values (a sampler's position log, say)."""

    def __init__(self, items: list[int]) -> None:
        self.items = items

    def state_dict(self) -> dict:
        return {"items": self.items}

    def load_state_dict(self, state: dict) -> None:
        self.items = list(state["items"])


def mid_window(micro_steps: int):
    """A model with an accumulation window ``micro_steps`` into its 4 micro-steps (seeded)."""
    model = make_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accumulation = GradientAccumulation(model, steps=4)
    for seed in range(4 + micro_steps):
        torch.manual_seed(seed)
        with accumulation.context():
            model(torch.randn(4, 4)).pow(2).mean().backward()
        if accumulation.step():
            opt.step()
            opt.zero_grad()
    torch.manual_seed(1234)  # the RNG state the checkpoint holds
    return model, opt, accumulation


def fresh():
    model = make_mlp(seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, GradientAccumulation(model, steps=4)


def assert_resumed(loaded, expected) -> None:
    (model, opt, accumulation), (e_model, e_opt, e_accumulation) = loaded, expected
    assert accumulation.micro == e_accumulation.micro
    for name, value in e_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for p, e in zip(model.parameters(), e_model.parameters(), strict=True):
        assert torch.equal(p.grad, e.grad)
        assert torch.equal(opt.state[p]["momentum_buffer"], e_opt.state[e]["momentum_buffer"])
    assert torch.rand(3).tolist() == (torch.manual_seed(1234), torch.rand(3).tolist())[1]


def test_per_rank_state_lives_in_the_rank_file_not_the_manifest(tmp_path) -> None:
    sizes = {}
    for micro, label in ((1, "few"), (3, "more")):
        model, opt, accumulation = mid_window(micro)
        history = History(list(range(2000 * micro)))  # per-rank state of JSON values
        path = tmp_path / label
        ddpckpt.save(
            path,
            model=model,
            optimizer=opt,
            extra={"acc": accumulation, "h": ddpckpt.PerRank(history)},
        )
        sizes[label] = (path / "manifest.json").stat().st_size
        doc = json.loads((path / "manifest.json").read_text())
        assert doc["ranks"] == [] and "rng" in doc["rank_keys"] and "extra/h" in doc["rank_keys"]
        assert not any(name.startswith("rank0/") for name in doc["tensors"])
        loaded = fresh()
        back = History([])
        extra = {"acc": loaded[2], "h": ddpckpt.PerRank(back)}
        ddpckpt.load(path, model=loaded[0], optimizer=loaded[1], extra=extra)
        assert back.items == history.items
        assert_resumed(loaded, (model, opt, accumulation))
    # 4000 more list items of per-rank state; the manifest differs only in the rank file's size
    assert abs(sizes["more"] - sizes["few"]) < 16
    assert ddpckpt.verify(tmp_path / "more").step is None


def test_a_damaged_rank_file_is_named(tmp_path) -> None:
    model, _, accumulation = mid_window(1)
    ddpckpt.save(tmp_path / "c", model=model, extra={"acc": accumulation})
    rank_file = tmp_path / "c" / "rank-00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[20] ^= 1  # inside the header, where the rank's state is
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.safetensors"):
        ddpckpt.load(tmp_path / "c", model=fresh()[0], extra={"acc": fresh()[2]})
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.safetensors"):
        ddpckpt.verify(tmp_path / "c")


def test_format_2_checkpoints_with_per_rank_state_in_the_manifest_still_load() -> None:
    # Saved by ddpckpt with format 2 from mid_window(2) (see make_v2_fixture below).
    assert read_manifest(locate(V2_CHECKPOINT)).format_version == 2
    loaded = fresh()
    ddpckpt.load(V2_CHECKPOINT, model=loaded[0], optimizer=loaded[1], extra={"acc": loaded[2]})
    model, opt, accumulation = loaded
    assert_loaded_as_stored(model, opt, V2_CHECKPOINT)
    stored = stored_tensors(V2_CHECKPOINT)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, stored[f"rank0/extra/acc/grads/{name}"]), name
    e_model, e_opt, e_accumulation = mid_window(2)  # what the fixture was made from
    assert accumulation.micro == e_accumulation.micro
    torch.testing.assert_close(model.state_dict(), e_model.state_dict())
    torch.testing.assert_close(
        [p.grad for p in model.parameters()], [p.grad for p in e_model.parameters()]
    )
    assert_near_optimizer(opt, e_opt)
    assert torch.rand(3).tolist() == (torch.manual_seed(1234), torch.rand(3).tolist())[1]


def make_v2_fixture(path: str) -> None:  # run once with the format-2 code to make the fixture
    model, opt, accumulation = mid_window(2)
    ddpckpt.save(path, model=model, optimizer=opt, extra={"acc": accumulation}, overwrite=True)


def _overwritten_twice(model, opt, target: str) -> dict:
    """Save at ``target``, change the weights, save the same step there again; returns them."""
    ddpckpt.save(target, model=model, optimizer=opt, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.5)
    ddpckpt.save(target, model=model, optimizer=opt, step=1, overwrite=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_overwritten_checkpoint_loads_its_rank_file(ckpt_root):
    """On an object store an overwrite commits its files under a prefix: the rank file is
    found there, and the second save's weights come back bit for bit."""
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    target = str(ckpt_root / "step-1")
    saved = _overwritten_twice(model, opt, target)
    fresh = make_mlp(seed=5)
    ddpckpt.load(target, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_checkpointer_resumes_a_step_it_saved_twice(run_root):
    """Saving at the step a run resumed from overwrites it; the next resume takes that step,
    with its newest weights, and sets nothing aside as corrupt."""
    from ddpckpt.storage import storage_for

    root = str(run_root)
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddpckpt.Checkpointer(root, model=model, optimizer=opt) as ckpt:
        ckpt.resume()
        ckpt.save(1)
        ckpt.save(2)
        with torch.no_grad():
            model[0].weight.fill_(7.0)
        ckpt.save(2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = make_mlp(seed=5)
    with ddpckpt.Checkpointer(
        root, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1)
    ) as ckpt:
        assert ckpt.resume().step == 2
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert not [n for n in storage_for(root).walk(root) if ".corrupt-" in n]
