"""Importing a checkpoint in torchtitan's layout, written as torchtitan's CheckpointManager
writes it (DCP, the model's keys at the top level, the optimizer flattened by
get_optimizer_state_dict): it resumes under ddpckpt with the same weights, moments,
param groups, schedule and step, and the DataLoader's pickle is named as left out."""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import ddpckpt
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt._convert.torchtitan import from_torchtitan
from ddpckpt.errors import CorruptCheckpointError


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(8, 8)
        self.attention_norm = nn.LayerNorm(8)


class _Titan(nn.Module):
    """Names as torchtitan's Llama has them: ``layers.0.attention.weight``, a norm, an output."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = h + block.attention(block.attention_norm(h))
        return self.output(self.norm(h))


def _make(seed: int = 0, groups: str = "decay-first"):
    """``groups``: the model's order (``decay-first``), no decay first (``reversed``), or
    the decayed parameters split into two groups of the same hyperparameters (``split``)."""
    torch.manual_seed(seed)
    model = _Titan()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    param_groups = [{"params": decay, "weight_decay": 0.1},
                    {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    if groups == "reversed":
        param_groups.reverse()
    elif groups == "split":
        param_groups[:1] = [{"params": decay[:2], "weight_decay": 0.1},
                            {"params": decay[2:], "weight_decay": 0.1}]  # fmt: skip
    optimizer = torch.optim.AdamW(param_groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lambda warmup, step: min(1.0, (step + 1) / warmup), 4)
    )
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler, seed: int) -> float:
    torch.manual_seed(100 + seed)
    tokens = torch.randint(0, 16, (4, 6))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def _losses(steps: int) -> tuple[io.BytesIO, ...]:
    out = []
    for values in ([3.0, 2.5][:steps], [3.1, 2.6][:steps], list(range(1, steps + 1))):
        buffer = io.BytesIO()
        torch.save(values, buffer)
        out.append(buffer)
    return tuple(out)


def _titan_save(path: Path, model, optimizer, scheduler, step: int, current: bool = False) -> None:
    """What torchtitan's CheckpointManager.save hands dcp.save: its TrainState of 2024 (the
    step as an int32 tensor, loss histories as torch.save files in buffers) or, ``current``,
    of today (the step and the tokens seen as ints)."""
    avg, peak, logged = _losses(step)
    train_state = (
        {"step": step, "ntokens_seen": 96 * step}
        if current
        else {
            "step": torch.tensor(step, dtype=torch.int32),
            "global_avg_losses": avg,
            "global_max_losses": peak,
            "log_steps": logged,
        }
    )
    states = {
        **get_model_state_dict(model),  # _flattened_model_states_sd
        "optimizer": get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        ),
        "lr_scheduler": scheduler.state_dict(),
        "dataloader": {"dp_rank_0": pickle.dumps({"_num_yielded": step}), "world_size": 1},
        "train_state": train_state,
    }
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(states, checkpoint_id=str(path))


@pytest.mark.parametrize("current", [False, True], ids=["train-state-2024", "train-state-now"])
def test_a_torchtitan_checkpoint_resumes_with_its_weights_moments_groups_and_step(
    tmp_path: Path, current: bool
) -> None:
    model, optimizer, scheduler = _make()
    for i in range(2):
        _step(model, optimizer, scheduler, i)
    _titan_save(tmp_path / "step-2", model, optimizer, scheduler, step=2, current=current)

    path, left_out = import_checkpoint(tmp_path / "step-2", tmp_path / "imported")
    assert left_out == [
        "dataloader (torchtitan's DataLoader position, a pickle of the loader's state, never "
        "unpickled: the resumed loader starts its data from the beginning)"
    ]
    resumed, resumed_optimizer, resumed_scheduler = _make(seed=1)
    info = ddpckpt.load(path, model=resumed, optimizer=resumed_optimizer,
                        scheduler=resumed_scheduler, rng=False)  # fmt: skip
    assert info.step == 2
    if current:
        assert info.extra["train_state"] == {"ntokens_seen": 192}
    else:
        assert info.extra["train_state"]["global_avg_losses"] == [3.0, 2.5]
    for (name, a), (_, b) in zip(resumed.named_parameters(), model.named_parameters(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    mine, theirs = resumed_optimizer.state_dict(), optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for index, state in theirs["state"].items():
        for key, value in state.items():
            assert torch.equal(mine["state"][index][key], value), (index, key)
    assert resumed_scheduler.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    for i in range(2, 4):  # the next steps are the same
        assert _step(resumed, resumed_optimizer, resumed_scheduler, i) == _step(
            model, optimizer, scheduler, i
        )


def test_an_optimizer_entry_naming_no_parameter_is_refused() -> None:
    model = {"w": torch.zeros(2)}
    flat = {"state.v.exp_avg": torch.zeros(2), "param_groups.v.lr": 0.1}
    with pytest.raises(CorruptCheckpointError, match="names no parameter"):
        from_torchtitan({**model, "optimizer": flat}, "step-2")


def test_dotted_parameter_names_are_split_at_the_longest_name_that_fits() -> None:
    model = {"a.b": torch.zeros(1), "a.b.c": torch.zeros(1)}
    flat = {"state.a.b.c.exp_avg": torch.ones(1), "state.a.b.exp_avg": torch.zeros(1),
            "param_groups.a.b.lr": 0.1, "param_groups.a.b.c.lr": 0.2}  # fmt: skip
    doc, _ = from_torchtitan({**model, "optimizer": flat}, "step-2")
    assert set(doc["optimizer"]["state"]) == {"a.b", "a.b.c"}
    assert doc["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["a.b"]},
                                                {"lr": 0.2, "params": ["a.b.c"]}]  # fmt: skip


@pytest.mark.parametrize("groups", ["reversed", "split"])
def test_param_groups_in_another_order_or_split_take_their_parameters_hyperparameters(
    tmp_path: Path, groups: str
) -> None:
    """torchtitan's flattened state keeps each parameter's hyperparameters, not the groups'
    order: the rebuilt groups are matched to the live optimizer's by their parameters (they
    were refused when their order differed from the model's)."""
    model, optimizer, scheduler = _make(groups=groups)
    for i in range(2):
        _step(model, optimizer, scheduler, i)
    _titan_save(tmp_path / "step-2", model, optimizer, scheduler, step=2, current=True)
    path, _ = import_checkpoint(tmp_path / "step-2", tmp_path / "imported")
    resumed, resumed_optimizer, resumed_scheduler = _make(seed=1, groups=groups)
    ddpckpt.load(path, model=resumed, optimizer=resumed_optimizer, scheduler=resumed_scheduler,
                 rng=False)  # fmt: skip
    assert resumed_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    for i in range(2, 4):
        assert _step(resumed, resumed_optimizer, resumed_scheduler, i) == _step(
            model, optimizer, scheduler, i
        )
    other, other_optimizer, _ = _make(
        seed=1, groups="decay-first" if groups == "split" else "split"
    )
    moved = [{"params": list(g["params"]), **{k: v for k, v in g.items() if k != "params"}}
             for g in other_optimizer.param_groups]  # fmt: skip
    moved[0]["params"].append(moved[-1]["params"].pop())  # a norm among the decayed ones
    with pytest.raises(ddpckpt.errors.StateMismatchError, match=r"param group 0 holds .* which it gave "
                       "different hyperparameters. Group the parameters as the run"):  # fmt: skip
        ddpckpt.load(path, model=other, optimizer=torch.optim.AdamW(moved, lr=1e-2), rng=False)


def _zero_rank(rank: int, store: str, path: str, out: str) -> None:
    """One rank of two loading the import into a ZeroRedundancyOptimizer whose groups come
    in the saved run's order (no decay first), not in the rebuilt (model's) order."""
    import json

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = _make(1)[0]
        no_decay = [p for n, p in model.named_parameters() if "norm" in n]
        decay = [p for n, p in model.named_parameters() if "norm" not in n]
        optimizer = ZeroRedundancyOptimizer(no_decay, torch.optim.AdamW, lr=1e-2,
                                            weight_decay=0.0)  # fmt: skip
        optimizer.add_param_group({"params": decay, "weight_decay": 0.1})
        ddpckpt.load(path, model=model, optimizer=optimizer, rng=False)
        local = [(g["weight_decay"], len(g["params"])) for g in optimizer.optim.param_groups]
        Path(out, f"rank{rank}.json").write_text(json.dumps(local))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_a_zero_redundancy_optimizer_takes_each_groups_own_hyperparameters(
    tmp_path: Path,
) -> None:
    """Its local optimizer holds only the parameters the rank owns: the rebuilt groups are
    cut to the wrapper's groups first (each local group was matched by position, so the
    no-decay group took the decayed one's weight decay)."""
    import json

    import torch.multiprocessing as mp

    model, optimizer, scheduler = _make(groups="reversed")
    _step(model, optimizer, scheduler, 0)
    _titan_save(tmp_path / "step-1", model, optimizer, scheduler, step=1, current=True)
    path, _ = import_checkpoint(tmp_path / "step-1", tmp_path / "imported")
    mp.spawn(_zero_rank, args=(str(tmp_path / "store"), path, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        local = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [wd for wd, _ in local] == [0.0, 0.1], (rank, local)


def test_a_scheduler_whose_groups_would_take_another_groups_rate_is_refused(
    tmp_path: Path,
) -> None:
    """The saving run had no decay first; the scheduler's base_lrs are in that order. A live
    optimizer of the other order would get each group's rate right at the load and swapped
    at the next scheduler.step(): refused before anything is loaded."""
    model, optimizer, _ = _make(groups="reversed")
    for group, lr in zip(optimizer.param_groups, (1e-3, 1e-2), strict=True):
        group["lr"] = group["initial_lr"] = lr
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _step(model, optimizer, scheduler, 0)
    _titan_save(tmp_path / "step-1", model, optimizer, scheduler, step=1, current=True)
    path, _ = import_checkpoint(tmp_path / "step-1", tmp_path / "imported")
    other, other_optimizer, _ = _make(seed=1)
    other_scheduler = torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(ddpckpt.errors.StateMismatchError, match=r"starting from \[0.001, 0.01\]"):
        ddpckpt.load(path, model=other, optimizer=other_optimizer, scheduler=other_scheduler,
                     rng=False)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    same, same_optimizer, _ = _make(seed=1, groups="reversed")
    same_scheduler = torch.optim.lr_scheduler.StepLR(same_optimizer, step_size=1, gamma=0.5)
    ddpckpt.load(path, model=same, optimizer=same_optimizer, scheduler=same_scheduler, rng=False)


class _TiedTitan(_Titan):
    """The output tied to the embedding, stored under the embedding's name."""

    def __init__(self) -> None:
        super().__init__()
        self.output.weight = self.tok_embeddings.weight


class _HeadFirst(_TiedTitan):
    """The same model with the output defined first: the tie's first name is output.weight."""

    def __init__(self) -> None:
        super().__init__()
        self._modules = {"output": self._modules.pop("output"), **self._modules}


def test_a_tied_weight_named_otherwise_in_the_live_model_keeps_its_state(tmp_path: Path) -> None:
    """Rebuilt groups in another order than the live ones, and a tie whose stored name is
    its second name in the live model: its state is found under either name."""
    torch.manual_seed(0)
    model = _TiedTitan()
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                                   {"params": decay, "weight_decay": 0.1}], lr=1e-2)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _step(model, optimizer, scheduler, 0)
    _titan_save(tmp_path / "step-1", model, optimizer, scheduler, step=1, current=True)
    path, _ = import_checkpoint(tmp_path / "step-1", tmp_path / "imported")
    torch.manual_seed(1)
    again = _HeadFirst()
    assert next(n for n, p in again.named_parameters() if p is again.output.weight) == (
        "output.weight"
    )
    again_optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in again.named_parameters() if "norm" in n], "weight_decay": 0.0},
         {"params": [p for n, p in again.named_parameters() if "norm" not in n],
          "weight_decay": 0.1}], lr=1e-2)  # fmt: skip
    ddpckpt.load(path, model=again, optimizer=again_optimizer, rng=False)
    saved = optimizer.state[model.tok_embeddings.weight]["exp_avg"]
    assert torch.equal(again_optimizer.state[again.output.weight]["exp_avg"], saved)
