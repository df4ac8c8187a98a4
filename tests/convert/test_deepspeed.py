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
from deepspeed_layout import edit, write


class TiedLM(nn.Module):
    """Groups of 80, 15 and 1 elements: padded at 2 and 3 ranks, the last group's padding
    over every rank's slice at 3 (2 elements each, 1 of them the parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.norm = nn.BatchNorm1d(5)
        self.hidden = nn.Linear(5, 5)
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie them
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(self.norm(self.embed(tokens))))
        return self.head(hidden) / self.temperature


def build(seed: int) -> tuple[TiedLM, torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = TiedLM()
    decay = [model.embed.weight, model.hidden.weight]
    rest = [model.norm.weight, model.norm.bias, model.hidden.bias]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0},
         {"params": [model.temperature], "lr": 0.005, "weight_decay": 0.0}], lr=0.01
    )  # fmt: skip
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
    # the module's half precision (DeepSpeed keeps no fp32 copy of a frozen parameter)
    assert torch.equal(obj["model"]["hidden.bias"], model.hidden.bias.half().float())
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
    with pytest.raises(CorruptCheckpointError, match=r"latest: names no tag this importer takes"):
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


def _written(tmp_path: Path, **options) -> Path:
    model, optimizer, scheduler = build(0)
    train(model, optimizer, scheduler, range(2))
    return write(tmp_path / "ds", model, optimizer, world=2, step=2, scheduler=scheduler, **options)


def _optim_files(tag: Path) -> list[Path]:
    return sorted(tag.glob("zero_pp_rank_*_optim_states.pt"))


def test_what_cannot_carry_over_is_named(tmp_path: Path) -> None:
    """DeepSpeed's own scheduler (a torch scheduler would start over from it), an Adam whose
    mode the config does not say, a loss scaler's scale that is not a number."""
    tag = _written(tmp_path, fused_adam=True)

    def deepspeed_scheduler(doc):
        doc["lr_scheduler"] = {"last_batch_iteration": 7}
        doc["ds_config"].pop("optimizer")  # FusedAdam built by the script

    edit(tag / "mp_rank_00_model_states.pt", deepspeed_scheduler)
    edit(_optim_files(tag)[0], lambda d: setattr(
        d["optimizer_state_dict"]["loss_scaler"], "cur_scale", [[1] * 3] * 3))  # fmt: skip
    done = import_checkpoint(tag, tmp_path / "imported")
    said = "\n".join(done.left_out)
    assert "last_batch_iteration 7" in said and "step it that many times" in said
    assert "the Adam mode" in said and "decoupled weight decay (AdamW)" in said
    assert "DynamicLossScaler, scale unknown" in said
    model, optimizer, scheduler = build(1)
    info = ddpckpt.load(done.path, model=model, optimizer=optimizer)
    assert info.step == 2 and all(g["decoupled_weight_decay"] for g in optimizer.param_groups)
    with pytest.raises(ddpckpt.errors.StateMismatchError, match="scheduler"):
        ddpckpt.load(done.path, model=model, optimizer=optimizer, scheduler=scheduler)


def test_an_elastic_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    tag = _written(tmp_path)

    def elastic(doc):
        state = doc["optimizer_state_dict"]["base_optimizer_state"]["state"]
        doc["optimizer_state_dict"]["base_optimizer_state"] = [state[g] for g in sorted(state)]

    for path in _optim_files(tag):
        edit(path, elastic)
    with pytest.raises(CorruptCheckpointError, match=r"elastic_checkpoint, which keeps no hyper"):
        import_checkpoint(tag, tmp_path / "imported")


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("optim", lambda d: d["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
         .__setitem__("step", "x")),
        ("model", lambda d: d.__setitem__("buffer_names", [[1]])),
        ("model", lambda d: d.__setitem__("shared_params", torch.ones(3))),
        ("model", lambda d: d.__setitem__("frozen_param_fragments", torch.ones(3))),
        ("optim", lambda d: d["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]
         .__setitem__("bias_correction", torch.ones(2))),
    ],
    ids=["step", "buffer-names", "shared", "frozen", "bias-correction"],
)  # fmt: skip
def test_a_field_of_a_type_deepspeed_never_writes_is_a_corrupt_checkpoint(
    tmp_path: Path, where, change
) -> None:
    tag = _written(tmp_path, fused_adam=True)
    files = [tag / "mp_rank_00_model_states.pt"] if where == "model" else _optim_files(tag)
    for path in files:
        edit(path, change)
    with pytest.raises(CorruptCheckpointError):
        import_checkpoint(tag, tmp_path / "imported")


def test_one_tensor_shared_by_many_groups_is_refused_before_it_is_copied_for_each(
    tmp_path: Path,
) -> None:
    """100 groups whose slices are one tensor of 200 kB: joining them would copy it 200
    times (40 MB from files of under 1 MB)."""
    tag = _written(tmp_path)
    shared = torch.zeros(50_000)

    def groups(doc):
        doc["param_shapes"] = [{f"p{i}": torch.Size([100_000])} for i in range(100)]

    def slices(doc):
        zero = doc["optimizer_state_dict"]
        zero["single_partition_of_fp32_groups"] = [shared] * 100
        zero["group_paddings"] = [0] * 100
        zero["partition_count"] = [2] * 100

    edit(tag / "mp_rank_00_model_states.pt", groups)
    for path in _optim_files(tag):
        edit(path, slices)
    with pytest.raises(CorruptCheckpointError, match=r"add up to more bytes than the optimizer"):
        import_checkpoint(tag, tmp_path / "imported")


def test_a_zero_stage_in_a_file_changes_nothing_beyond_the_import(tmp_path: Path) -> None:
    """The stage is read as a number, no enum member a pickle's state could be set on."""
    from ddpckpt._convert import deepspeed

    assert deepspeed.zero_stage(2) == 2
    with pytest.raises(CorruptCheckpointError, match="no ZeRO stage"):
        deepspeed.zero_stage(9)
    tag = _written(tmp_path)
    edit(_optim_files(tag)[0], lambda d: d["optimizer_state_dict"].__setitem__("zero_stage", 7))
    with pytest.raises(CorruptCheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        import_checkpoint(tag, tmp_path / "imported")


def test_layouts_not_read_are_refused_by_name(tmp_path: Path) -> None:
    """Mixture-of-experts groups (partitioned over fewer ranks), a pipeline-parallel model
    (its 'module' None), a tag 'latest' names that is no plain directory name."""
    tag = _written(tmp_path)
    edit(_optim_files(tag)[0], lambda d: d["optimizer_state_dict"].__setitem__(
        "partition_count", [2, 1, 2]))  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match=r"mixture-of-experts checkpoint"):
        import_checkpoint(tag, tmp_path / "a")
    tag = _written(tmp_path / "pipeline")
    edit(tag / "mp_rank_00_model_states.pt", lambda d: d.__setitem__("module", None))
    with pytest.raises(CorruptCheckpointError, match=r"a pipeline-parallel checkpoint"):
        import_checkpoint(tag, tmp_path / "b")
    tag = _written(tmp_path / "experts")
    edit(tag / "mp_rank_00_model_states.pt", lambda d: d.__setitem__(
        "ds_autoep_layers", [{"num_experts": 4}]))  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match=r"expert parallelism \(AutoEP\)"):
        import_checkpoint(tag, tmp_path / "d")
    (tag.parent / "latest").write_text("global step 2")
    with pytest.raises(CorruptCheckpointError, match=r"give the tag directory itself"):
        import_checkpoint(tag.parent, tmp_path / "c")


def test_a_ddpckpt_checkpoint_is_not_imported_again(tmp_path: Path) -> None:
    ddpckpt.save(tmp_path / "ckpt", model=nn.Linear(2, 2))
    with pytest.raises(CorruptCheckpointError, match=r"a ddpckpt checkpoint already"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "out")


@pytest.mark.parametrize("stage", [2, 3])
def test_neighbouring_groups_of_equal_hyperparameters_and_zero3_sub_groups_stay_apart(
    tmp_path: Path, stage: int
) -> None:
    """Two param groups alike (each its own group in the live optimizer too), and ZeRO-3's
    sub-groups (a group's pieces over sub_group_size: several flat slices in one group)."""
    torch.manual_seed(0)
    model = TiedLM()
    alike = [{"params": [model.embed.weight, model.hidden.weight]},
             {"params": [model.norm.weight, model.norm.bias, model.hidden.bias,
                         model.temperature]}]  # fmt: skip
    optimizer = torch.optim.AdamW(alike, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    train(model, optimizer, scheduler, range(2))
    write(tmp_path / "ds", model, optimizer, world=3, step=2, stage=stage, sub_group_size=10)
    done = import_checkpoint(tmp_path / "ds", tmp_path / "imported")
    torch.manual_seed(1)
    again = TiedLM()
    groups = [{"params": [again.embed.weight, again.hidden.weight]},
              {"params": [again.norm.weight, again.norm.bias, again.hidden.bias,
                          again.temperature]}]  # fmt: skip
    again_optimizer = torch.optim.AdamW(groups, lr=0.01)
    ddpckpt.load(done.path, model=again, optimizer=again_optimizer)
    assert again_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg"], again_optimizer.state[q]["exp_avg"])


def test_one_buffer_under_many_names_is_refused_before_it_is_copied_for_each(
    tmp_path: Path,
) -> None:
    tag = _written(tmp_path)
    shared = torch.zeros(100_000, dtype=torch.float16)

    def many(doc):
        for i in range(100):
            doc["module"][f"copy{i}"] = shared
        doc["buffer_names"] += [f"copy{i}" for i in range(100)]

    edit(tag / "mp_rank_00_model_states.pt", many)
    with pytest.raises(CorruptCheckpointError, match=r"more bytes than the model states files"):
        import_checkpoint(tag, tmp_path / "imported")
