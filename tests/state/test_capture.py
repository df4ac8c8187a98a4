"""Capturing state from live objects: canonical keys through any wrapper, tied weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from conftest import TiedLM, make_mlp, train_steps
from ddpckpt.errors import UnsupportedValueError
from ddpckpt.state.capture import canonical_state_dict, capture, unwrap_model

PLAIN_KEYS = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
              "1.num_batches_tracked", "3.weight", "3.bias"]  # fmt: skip


def wrappings():
    return {
        "plain": lambda m: m,
        "DataParallel": nn.DataParallel,
        "DDP": DDP,
        "compile": lambda m: torch.compile(m, backend="eager"),
        "DDP(compile)": lambda m: DDP(torch.compile(m, backend="eager")),
        "compile(DDP)": lambda m: torch.compile(DDP(m), backend="eager"),
        "DataParallel(DDP(compile))": lambda m: nn.DataParallel(
            DDP(torch.compile(m, backend="eager"))
        ),
    }


@pytest.mark.parametrize("wrap", list(wrappings()))
def test_keys_are_canonical_whatever_the_wrapping(process_group, wrap) -> None:
    model = make_mlp()
    wrapped = wrappings()[wrap](model)
    assert unwrap_model(wrapped) is model
    assert list(canonical_state_dict(wrapped)) == PLAIN_KEYS


def test_compiled_submodule_keys_are_canonical() -> None:
    model = nn.Sequential(make_mlp())
    model[0][3] = torch.compile(model[0][3], backend="eager")
    assert "0.3._orig_mod.weight" in model.state_dict()
    assert "0.3.weight" in canonical_state_dict(model)


def test_user_modules_named_module_keep_their_name() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    assert list(canonical_state_dict(Holder())) == ["module.weight", "module.bias"]


def test_tied_weights_are_stored_once_and_recorded_as_alias() -> None:
    snapshot = capture(model=TiedLM())
    section = snapshot.state["model"]
    assert section["aliases"] == {"head.weight": "embed.weight"}
    assert "model/head.weight" not in snapshot.tensors


def test_snapshot_shares_memory_with_live_tensors() -> None:
    model = make_mlp()
    snapshot = capture(model=model, rng=False)
    assert snapshot.tensors["model/0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert snapshot.rank_state == {}


def test_optimizer_params_outside_the_model_are_named_by_position() -> None:
    model = make_mlp()
    extra_param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra_param]}], lr=0.1)
    snapshot = capture(model=model, optimizer=opt, rng=False)
    groups = snapshot.state["optimizer"]["groups"]
    assert groups[1]["params"] == ["@group1.0"]


def test_unstorable_scheduler_state_names_the_key() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Odd:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, state):  # pragma: no cover - never reached
            pass

    with pytest.raises(UnsupportedValueError, match="extra/odd/fn"):
        capture(model=model, optimizer=opt, extra={"odd": Odd()})


class EmbeddingFirst(nn.Module):
    """A language model whose output head reuses the embedding, defined embedding first."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class HeadFirst(EmbeddingFirst):
    """The same model, written with the head defined before the embedding."""

    def __init__(self, seed: int) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(seed)
        self.head = nn.Linear(4, 7, bias=False)
        self.mix = nn.Linear(4, 4)
        self.emb = nn.Embedding(7, 4)
        self.emb.weight = self.head.weight


def adamw_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(len(opt.state))
    for _ in range(steps):
        opt.zero_grad()
        tokens = torch.randint(0, 7, (5,), generator=gen)
        nn.functional.cross_entropy(model(tokens), (tokens + 1) % 7).backward()
        opt.step()


@pytest.mark.parametrize(
    ("saved", "loaded"), [(EmbeddingFirst, HeadFirst), (HeadFirst, EmbeddingFirst)]
)
def test_tied_parameter_state_is_matched_by_any_of_its_names(saved, loaded, tmp_path) -> None:
    model = saved(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9))
    adamw_steps(model, opt, 3)
    path = os.fspath(tmp_path / "ckpt")
    ddpckpt.save(path, model=model, optimizer=opt, rng=False)

    fresh = loaded(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05, betas=(0.8, 0.9))
    ddpckpt.load(path, model=fresh, optimizer=fresh_opt, rng=False)

    assert fresh.emb.weight is fresh.head.weight
    for name in ("emb.weight", "mix.weight", "mix.bias"):
        before, after = (
            opt.state[model.get_parameter(name)],
            fresh_opt.state[fresh.get_parameter(name)],
        )
        assert before.keys() == after.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in before:
            assert torch.equal(before[key], after[key]), (name, key)
    adamw_steps(model, opt, 2)
    adamw_steps(fresh, fresh_opt, 2)
    for name, param in model.named_parameters():
        assert torch.equal(param, fresh.get_parameter(name)), name


def test_untied_state_into_a_tied_model_is_refused_naming_the_extra_name(tmp_path) -> None:
    model = EmbeddingFirst(seed=0)
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # untied
    opt = torch.optim.AdamW(model.parameters())
    adamw_steps(model, opt, 1)
    path = os.fspath(tmp_path / "ckpt")
    ddpckpt.save(path, model=model, optimizer=opt, rng=False)
    tied = EmbeddingFirst(seed=0)
    with pytest.raises(ddpckpt.StateMismatchError, match="unexpected"):
        ddpckpt.load(path, model=tied, optimizer=torch.optim.AdamW(tied.parameters()), rng=False)


def test_optimizer_names_of_a_compiled_submodule_are_canonical() -> None:
    model = nn.Sequential(make_mlp())
    model[0][3] = torch.compile(model[0][3], backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = capture(model=model, optimizer=opt, rng=False).state["optimizer"]["groups"]
    assert "0.3.weight" in groups[0]["params"]


def test_parameters_ddp_ignores_and_their_moments_are_kept_per_rank(process_group) -> None:
    model = make_mlp()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["3.weight", "1.running_mean"])
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters())
    train_steps(ddp, opt, steps=1)
    snapshot = capture(model=ddp, optimizer=opt, rng=False)
    ignored_state = opt.state[model[3].weight].values()
    moments = {n for n, t in snapshot.tensors.items() if any(t is v for v in ignored_state)}
    assert len(moments) == 3  # exp_avg, exp_avg_sq, step
    assert snapshot.per_rank == {"model/3.weight", "model/1.running_mean", *moments}
    assert "model/0.weight" in snapshot.balanced and "model/3.weight" not in snapshot.balanced
    assert not snapshot.unverified


def test_a_model_without_ddp_is_verified_not_assumed_replicated() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, steps=1)
    snapshot = capture(model=model, optimizer=opt, rng=False)
    assert not snapshot.balanced and not snapshot.per_rank
    assert snapshot.unverified == set(snapshot.tensors)  # buffers too: nothing broadcasts them


def test_a_module_valued_extra_is_verified_not_assumed_replicated(process_group) -> None:
    model = make_mlp()
    ddp = DDP(model)
    ema = torch.optim.swa_utils.AveragedModel(model)
    snapshot = capture(model=ddp, extra={"ema": ema}, rng=False)
    ema_names = {n for n in snapshot.tensors if n.startswith("extra/ema/")}
    assert "extra/ema/module.0.weight" in snapshot.unverified
    assert "extra/ema/n_averaged" in snapshot.unverified  # buffers too: no DDP broadcasts them
    assert not ema_names & snapshot.balanced


def test_each_tensor_knows_which_optimizers_step_it() -> None:
    gan = nn.ModuleDict({"G": nn.Linear(3, 3), "D": nn.Linear(3, 1)})
    opt_g = torch.optim.Adam(gan["G"].parameters())
    opt_d = torch.optim.Adam(gan["D"].parameters())
    gan["D"](gan["G"](torch.randn(2, 3))).sum().backward()
    opt_g.step()
    opt_d.step()
    snapshot = capture(model=gan, optimizer=opt_g, extra={"opt_d": opt_d}, rng=False)
    assert snapshot.stepped_by["model/G.weight"] == [opt_g]
    assert snapshot.stepped_by["model/D.weight"] == [opt_d]
    assert snapshot.stepped_by["optimizer/state/G.weight/exp_avg"] == [opt_g]
    d_moments = [n for n, w in snapshot.stepped_by.items() if n.startswith("extra/") and w]
    assert d_moments and all(snapshot.stepped_by[n] == [opt_d] for n in d_moments)


def test_a_torch_sampler_in_extra_points_at_its_loader() -> None:
    """torch's own DistributedSampler has no state: the message says to save the loader."""
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=0)
    with pytest.raises(UnsupportedValueError, match=r"extra=\{'loader': loader\}"):
        capture(model=make_mlp(), extra={"sampler": sampler}, rng=False)
