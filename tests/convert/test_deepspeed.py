"""Importing a DeepSpeed ZeRO checkpoint (stages 2 and 3) (written by DeepSpeed's documented layout:
deepspeed_layout.py) without DeepSpeed and without running its pickles: the training
continues from the same fp32 weights, moments, schedule and step, tied weights stay tied,
and what cannot carry over is named."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpckpt
from ddpckpt._convert.deepspeed import read_deepspeed
from ddpckpt.convert import import_checkpoint
from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from deepspeed_layout import write


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.BatchNorm1d(6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie them

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.norm(self.embed(tokens)))))


def build(seed: int) -> tuple[TiedLM, torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = TiedLM()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [
        p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)
    ]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model: nn.Module, optimizer, scheduler, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens = torch.Generator().manual_seed(step)
        batch = torch.randint(0, 11, (8,), generator=tokens)
        loss = nn.functional.cross_entropy(model(batch), (batch + 1) % 11)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("stage", "world", "fused_adam", "bf16"),
    [(2, 2, False, False), (2, 3, True, False), (1, 3, False, True), (3, 2, False, False),
     (3, 3, True, False)],
)  # fmt: skip
def test_a_zero_checkpoint_continues_as_the_run_would_have(
    tmp_path: Path, stage, world, fused_adam, bf16
) -> None:
    """3 ranks cut the groups (ZeRO-1/2) or each parameter (ZeRO-3) unevenly, the last
    rank's piece padded; DeepSpeed's FusedAdam keeps the step in its group and says
    adam_w_mode; its BF16_Optimizer keeps the padding and records no stage: each continues
    as torch's AdamW."""
    model, optimizer, scheduler = build(0)
    train(model, optimizer, scheduler, range(3))
    with torch.no_grad():  # DeepSpeed's fp16 module holds the buffers, in half precision
        for buffer in model.buffers():
            buffer.copy_(buffer.half()) if buffer.is_floating_point() else None
    write(tmp_path / "ds", model, optimizer, world=world, step=3, scheduler=scheduler,
          fused_adam=fused_adam, stage=stage, bf16_optimizer=bf16)  # fmt: skip
    done = import_checkpoint(tmp_path / "ds", tmp_path / "imported")  # through its "latest"
    path, left_out = done.path, done.left_out
    assert [x.split(" (")[0] for x in left_out] == ([] if bf16 else ["loss_scaler"])
    assert bf16 or ("scale 65536.0" in left_out[0] and "init_scale" in left_out[0])

    again, again_optimizer, again_scheduler = build(1)
    info = ddpckpt.load(path, model=again, optimizer=again_optimizer, scheduler=again_scheduler)
    assert info.step == 3
    assert again.head.weight is again.embed.weight  # the tie kept
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], again_optimizer.state[q][key])
    assert again_scheduler.state_dict() == scheduler.state_dict()
    expected = train(model, optimizer, scheduler, range(3, 6))
    assert train(again, again_optimizer, again_scheduler, range(3, 6)) == expected
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_tag_directory_itself_imports_and_a_frozen_parameter_comes_from_its_fragments(
    tmp_path: Path, stage
) -> None:
    model, optimizer, scheduler = build(0)
    model.hidden.bias.requires_grad_(False)
    train(model, optimizer, scheduler, range(2))
    tag = write(tmp_path / "ds", model, optimizer, world=3, step=2, stage=stage)
    obj, _ = read_deepspeed(str(tag))
    assert torch.equal(obj["model"]["hidden.bias"], model.hidden.bias)
    assert obj["model"]["norm.num_batches_tracked"].dtype == torch.int64  # kept an integer
    assert obj["model"]["norm.running_mean"].dtype == torch.float32  # fp16 copy, as fp32
    assert obj["global_step"] == 2 and "hidden.bias" not in obj["optimizer"]["state"]


def test_a_missing_rank_and_files_of_two_stages_are_refused_by_name(tmp_path: Path) -> None:
    model, optimizer, scheduler = build(0)
    train(model, optimizer, scheduler, range(1))
    tag = write(tmp_path / "ds", model, optimizer, world=2, step=1)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CorruptCheckpointError, match=r"saved by 2 data-parallel ranks, but it has 1"
    ):
        import_checkpoint(tag, tmp_path / "a")
    other = write(tmp_path / "ds3", model, optimizer, world=2, step=1, stage=3)
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        (tag / name).write_bytes((other / name).read_bytes())
    with pytest.raises(CorruptCheckpointError, match=r"different ZeRO stages"):
        import_checkpoint(tag, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_latest_file_naming_another_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("../../etc")
    with pytest.raises(CorruptCheckpointError, match=r"latest: names no checkpoint tag"):
        import_checkpoint(tmp_path / "ds", tmp_path / "out")


class _Exploit:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_model_states_file_naming_a_function_is_refused_before_it_runs(
    tmp_path: Path, capsys
) -> None:
    model, optimizer, scheduler = build(0)
    train(model, optimizer, scheduler, range(1))
    tag = write(tmp_path / "ds", model, optimizer, world=2, step=1)
    states = tag / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(states) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"DynamicLossScaler" not in data  # the scaler is in the optimizer files
    torch.save({"module": {}, "buffer_names": [], "param_shapes": [], "exploit": _Exploit()},
               states, pickle_protocol=2)  # fmt: skip
    with pytest.raises(UnsafeCheckpointError, match=r"would call builtins.print"):
        import_checkpoint(tag, tmp_path / "out")
    assert "ran" not in capsys.readouterr().out
    with pytest.raises(pickle.UnpicklingError):  # what torch itself refuses, as a check
        torch.load(states, weights_only=True)
