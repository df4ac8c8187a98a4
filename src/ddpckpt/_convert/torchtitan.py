"""torchtitan's checkpoints: a DCP directory whose saved dict holds the model's keys at its
top level, beside ``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``.

torchtitan's ``CheckpointManager`` saves the model's state dict flattened into the top level
(``_flattened_model_states_sd``), and its ``OptimizersContainer`` saves
``get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``:
``state.<parameter>.<name>`` for each state tensor and ``param_groups.<parameter>.<name>``
for each hyperparameter. :func:`from_torchtitan` turns that into the dict the importer
reads: the model under ``model``, the optimizer as ``get_state_dict`` keys it (by parameter
name, one param group per distinct set of hyperparameters), the scheduler, the step of
``train_state``. The DataLoader's position (a pickle of the loader's state) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpckpt.errors import CorruptCheckpointError

OPTIMIZER, SCHEDULER, LOADER, TRAIN_STATE = "optimizer", "lr_scheduler", "dataloader", "train_state"


def is_torchtitan(saved: Mapping[str, Any]) -> bool:
    """Whether ``saved`` (a DCP save, nested again) has torchtitan's layout: tensors at the
    top level beside a flattened optimizer state dict."""
    optimizer = saved.get(OPTIMIZER)
    return (
        isinstance(optimizer, Mapping)
        and any(isinstance(v, torch.Tensor) for v in saved.values())
        and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in optimizer)
    )


def from_torchtitan(saved: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """The importer's dict for torchtitan's ``saved`` (see the module), and what was left
    out, with why."""
    model = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    doc: dict[str, Any] = {"model": model}
    left_out = []
    if saved[OPTIMIZER]:
        doc["optimizer"] = _unflattened(saved[OPTIMIZER], model, where)
    if isinstance(saved.get(SCHEDULER), Mapping) and saved[SCHEDULER]:
        scheduler = doc["scheduler"] = dict(saved[SCHEDULER])
        base = scheduler.get("base_lrs")
        if "lr_lambdas" not in scheduler and isinstance(base, list):
            # a LambdaLR's state holds an empty dict for each function that is no callable
            # object with a __dict__ (torchtitan's warmup is a functools.partial), and DCP
            # saves no empty dict: each is taken back as one
            scheduler["lr_lambdas"] = [{} for _ in base]
    train_state = saved.get(TRAIN_STATE)
    if isinstance(train_state, Mapping):
        rest = dict(train_state)
        step = rest.pop("step", None)  # an int32 tensor before 2025, an int since
        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
            step = int(step.item())
        if type(step) is int and step >= 0:
            doc["step"] = step
        elif step is not None:
            rest["step"] = step
        if rest:
            doc[TRAIN_STATE] = rest
    if LOADER in saved:
        left_out.append(
            f"{LOADER} (torchtitan's DataLoader position, a pickle of the loader's state, "
            "never unpickled: the resumed loader starts its data from the beginning)"
        )
    known = {OPTIMIZER, SCHEDULER, LOADER, TRAIN_STATE}
    doc.update((k, v) for k, v in saved.items() if k not in model and k not in known)
    return doc, left_out


def _unflattened(
    flat: Mapping[str, Any], model: Mapping[str, torch.Tensor], where: str
) -> dict[str, Any]:
    """``get_optimizer_state_dict``'s flattened form as its nested one, keyed by parameter
    name: ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, one
    group per distinct set of hyperparameters, in the model's order."""
    names = sorted(model, key=len, reverse=True)  # the longest name that fits a key is its own
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name = next((n for n in names if rest.startswith(n + ".")), None)
        if name is None:
            raise CorruptCheckpointError(
                f"{where}: optimizer entry {key[:200]!r} names no parameter of the model's keys"
            )
        field = rest[len(name) + 1 :]
        (state if kind == "state" else hyper).setdefault(name, {})[field] = value
    groups: list[dict[str, Any]] = []
    for name in model:
        if name not in hyper:
            if name in state:
                raise CorruptCheckpointError(
                    f"{where}: the optimizer holds state for {name[:200]!r} but no param group"
                )
            continue
        group = next((g for g in groups if _same(g, hyper[name])), None)
        if group is None:
            group = {**hyper[name], "params": []}
            groups.append(group)
        group["params"].append(name)
    return {"state": state, "param_groups": groups}


def _same(group: Mapping[str, Any], values: Mapping[str, Any]) -> bool:
    """Whether a param group holds exactly these hyperparameters (tensors compared by value)."""
    if set(group) - {"params"} != set(values):
        return False
    for k, v in values.items():
        mine = group[k]
        if isinstance(v, torch.Tensor) or isinstance(mine, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(mine, torch.Tensor)
                    and torch.equal(v, mine)):  # fmt: skip
                return False
        elif mine != v:
            return False
    return True
