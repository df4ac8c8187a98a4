"""An optimizer's part of a checkpoint: state keyed by parameter name, tied or compiled."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ddpckpt
from conftest import make_mlp
from ddpckpt._state.capture import TrainingState, capture


def test_optimizer_params_outside_the_model_are_named_by_position() -> None:
    model = make_mlp()
    extra_param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra_param]}], lr=0.1)
    snapshot = capture(TrainingState.of(model=model, optimizer=opt, rng=False))
    groups = snapshot.state["optimizer"]["groups"]
    assert groups[1]["params"] == ["@group1.0"]


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
    with pytest.raises(ddpckpt.errors.StateMismatchError, match="unexpected"):
        ddpckpt.load(path, model=tied, optimizer=torch.optim.AdamW(tied.parameters()), rng=False)


def test_optimizer_names_of_a_compiled_submodule_are_canonical() -> None:
    model = nn.Sequential(make_mlp())
    model[0][3] = torch.compile(model[0][3], backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = capture(TrainingState.of(model=model, optimizer=opt, rng=False)).state["optimizer"][
        "groups"
    ]
    assert "0.3.weight" in groups[0]["params"]


def test_each_tensor_knows_which_optimizers_step_it() -> None:
    gan = nn.ModuleDict({"G": nn.Linear(3, 3), "D": nn.Linear(3, 1)})
    opt_g = torch.optim.Adam(gan["G"].parameters())
    opt_d = torch.optim.Adam(gan["D"].parameters())
    gan["D"](gan["G"](torch.randn(2, 3))).sum().backward()
    opt_g.step()
    opt_d.step()
    snapshot = capture(
        TrainingState.of(model=gan, optimizer=opt_g, extra={"opt_d": opt_d}, rng=False)
    )
    assert snapshot.stepped_by["model/G.weight"] == [opt_g]
    assert snapshot.stepped_by["model/D.weight"] == [opt_d]
    assert snapshot.stepped_by["optimizer/state/G.weight/exp_avg"] == [opt_g]
    d_moments = [n for n, w in snapshot.stepped_by.items() if n.startswith("extra/") and w]
    assert d_moments and all(snapshot.stepped_by[n] == [opt_d] for n in d_moments)


def test_a_numpy_array_among_a_param_groups_hyperparameters_loads_back(tmp_path) -> None:
    """The restore reads tensors lazily, by reference: a numpy array (``$ndarray``) must be
    read at once. It raised ``PartiallyRestoredError`` (no ``numpy`` on a reference)."""
    np = pytest.importorskip("numpy")
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["mask"] = np.arange(3.0)
    path = ddpckpt.save(tmp_path / "ckpt", model=model, optimizer=optimizer)
    fresh = make_mlp()
    loaded = torch.optim.SGD(fresh.parameters(), lr=0.1)
    ddpckpt.load(path, model=fresh, optimizer=loaded, rng=False)
    mask = loaded.param_groups[0]["mask"]
    assert isinstance(mask, np.ndarray) and np.array_equal(mask, np.arange(3.0))
