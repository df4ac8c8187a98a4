"""Every optimizer torch ships resumes exactly: same learning rates, parameters and state."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from resume_check import Training, assert_resume_is_exact, table_entry

BEFORE, AFTER = 4, 5  # steps before the save, steps after the load


def two_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weights and biases in separate groups, the biases at a lower learning rate."""
    weights = [p for p in model.parameters() if p.ndim > 1]
    biases = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": weights}, {"params": biases, "lr_scale": 0.5}]


def matrices_only(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for p in model.parameters() if p.ndim == 2]}]


def one_group(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": list(model.parameters())}]


@dataclass
class Case:
    """How a test builds one optimizer class: keyword arguments, groups, model."""

    kwargs: dict[str, Any]
    groups: Callable[[nn.Module], list[dict[str, Any]]] = two_groups
    sparse: bool = False  # an nn.Embedding(sparse=True), whose gradients are sparse


# Arguments that make each optimizer keep all the state it can (momentum, amsgrad, centred
# averages, history), so that the round trip is tested on all of it.
OPTIMIZERS: dict[str, Case] = {
    "SGD": Case({"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "Adam": Case({"lr": 0.01, "amsgrad": True, "weight_decay": 1e-3}),
    "AdamW": Case({"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.05}),
    "Adamax": Case({"lr": 0.02, "weight_decay": 1e-3}),
    "NAdam": Case({"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    "RAdam": Case({"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    "Adagrad": Case({"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    "Adadelta": Case({"lr": 1.0, "rho": 0.9, "weight_decay": 1e-3}),
    "ASGD": Case({"lr": 0.01, "t0": 3, "lambd": 1e-3}),  # averaging starts before the save
    "RMSprop": Case({"lr": 0.01, "momentum": 0.9, "centered": True}),
    "Rprop": Case({"lr": 0.01, "etas": (0.4, 1.3), "step_sizes": (1e-5, 1.0)}),
    "LBFGS": Case(
        {"lr": 0.5, "history_size": 3, "max_iter": 4, "line_search_fn": "strong_wolfe"},
        groups=one_group,  # LBFGS takes a single param group
    ),
    "SparseAdam": Case({"lr": 0.05, "betas": (0.8, 0.9)}, groups=one_group, sparse=True),
    "Adafactor": Case({"lr": 0.01, "weight_decay": 1e-3}),
    "Muon": Case({"lr": 0.02, "momentum": 0.9}, groups=matrices_only),  # 2-D parameters only
}


def discovered_optimizers() -> list[type]:
    """Every optimizer class ``torch.optim`` exports, found by introspection."""
    names = getattr(torch.optim, "__all__", dir(torch.optim))
    found = [getattr(torch.optim, name) for name in names]
    return [
        cls
        for cls in found
        if inspect.isclass(cls)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    ]


def build(
    cls: type, case: Case, device: str = "cpu", flags: dict[str, bool] | None = None
) -> Callable[[int], Training]:
    def training(seed: int) -> Training:
        torch.manual_seed(seed)
        if case.sparse:
            model: nn.Module = nn.Embedding(10, 4, sparse=True)
        else:
            model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        model.to(device)
        groups = case.groups(model)
        for group in groups:
            scale = group.pop("lr_scale", 1.0)
            if scale != 1.0:
                group["lr"] = case.kwargs["lr"] * scale
        opt = cls(groups, **case.kwargs, **(flags or {}))

        def step(i: int) -> None:
            data = torch.Generator().manual_seed(i)
            if case.sparse:
                inputs = torch.randint(0, 10, (6,), generator=data).to(device)
            else:
                inputs = torch.randn(5, 4, generator=data).to(device)
            rows, columns = (6, 4) if case.sparse else (5, 3)
            target = torch.randn(rows, columns, generator=data).to(device)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = (model(inputs) - target).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)

        return Training(model, opt, None, step)

    return training


# Implementations a class has but not on that device (fused Adagrad is CPU only).
UNSUPPORTED = {("Adagrad", "cuda", "fused")}
VARIANTS = [("cpu", "plain"), ("cpu", "fused"), ("cuda", "plain"), ("cuda", "fused"),
            ("cuda", "capturable")]  # fmt: skip


@pytest.mark.parametrize(("device", "flag"), VARIANTS, ids=["-".join(v) for v in VARIANTS])
@pytest.mark.parametrize("cls", discovered_optimizers(), ids=lambda cls: cls.__name__)
def test_every_optimizer_resumes_exactly(cls, device, flag, tmp_path) -> None:
    case = table_entry(OPTIMIZERS, cls, "OPTIMIZERS", __file__)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    flags = {} if flag == "plain" else {flag: True}
    if flags and flag not in inspect.signature(cls.__init__).parameters:
        pytest.skip(f"{cls.__name__} has no {flag} implementation")
    if (cls.__name__, device, flag) in UNSUPPORTED:
        pytest.skip(f"{cls.__name__} has no {flag} implementation on {device}")
    training = build(cls, case, device, flags)
    reference = training(0)
    reference.step(0)
    assert reference.optimizer.state, f"{cls.__name__} kept no state: the test would prove little"
    assert_resume_is_exact(training, tmp_path / "ckpt", BEFORE, AFTER)


@pytest.mark.parametrize("cls", [torch.optim.NAdam, torch.optim.ASGD], ids=lambda c: c.__name__)
def test_float32_scalars_beside_bfloat16_parameters_stay_float32(cls, tmp_path) -> None:
    """NAdam's mu_product and ASGD's eta/mu are float32 whatever the parameters' dtype."""
    case = OPTIMIZERS[cls.__name__]

    def training(seed: int) -> Training:
        run = build(cls, case)(seed)
        run.model.to(torch.bfloat16)  # before any step: the state is created in bfloat16 mode
        inner = run.step

        def step(i: int) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                inner(i)

        return Training(run.model, run.optimizer, None, step)

    assert_resume_is_exact(training, tmp_path / "ckpt", BEFORE, AFTER)


def test_the_table_covers_the_optimizers_users_name() -> None:
    """Discovery itself works: the common optimizers are found (guards the test above)."""
    names = {cls.__name__ for cls in discovered_optimizers()}
    assert {"SGD", "Adam", "AdamW", "LBFGS", "SparseAdam"} <= names
