"""Capturing an optimizer's part of a checkpoint: its ``state_dict()`` keyed by parameter
name (see :mod:`ddpckpt._state.optimizer`), each state tensor sorted as its parameter is
(replicated, per rank or to be verified), and which optimizers' ``step()`` writes which
captured tensor.

Every function here is local to the calling rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpckpt._format.codec import encode
from ddpckpt._format.sections import OptimizerSection
from ddpckpt._state.model import Replication, tensor_identity
from ddpckpt._state.optimizer import ParamNames, group_param_names
from ddpckpt._state.placement import note_placement
from ddpckpt._state.snapshot import Snapshot
from ddpckpt._state.zero import encode_owned, is_zero, param_state, zero_section
from ddpckpt.errors import StateMismatchError


def capture_optimizer(
    optimizer: torch.optim.Optimizer,
    names: ParamNames,
    replication: Replication,
    snapshot: Snapshot,
    prefix: str = "optimizer",
    label: str | None = None,
) -> OptimizerSection:
    """Add ``optimizer``'s state tensors to ``snapshot`` under ``prefix``; returns its
    section.

    ``names`` (from :func:`~ddpckpt._state.optimizer.param_names`) names the parameters;
    ``replication`` (from :func:`~ddpckpt._state.model.capture_model`) sorts each state
    tensor as its parameter. With ``label`` a parameter in no model is an error naming the
    optimizer so. A ``ZeroRedundancyOptimizer``'s state goes to ``snapshot.owned`` under
    its name (``label``'s, or ``"optimizer"``; see :mod:`ddpckpt._state.zero`).
    """
    before = set(snapshot.tensors)
    if is_zero(optimizer):
        group_names = group_param_names(names, optimizer, label=label)
        section, part = zero_section(optimizer, group_names, label or "optimizer")
        name = prefix.partition("/")[2] or "optimizer"
        snapshot.owned_state[name] = encode_owned(part, prefix, snapshot.owned)
    else:
        section = _section(optimizer, names, label)
    encoded = encode(section, prefix, snapshot.tensors)
    added = set(snapshot.tensors) - before
    snapshot.balanced.update(added)
    _sort_optimizer_state(optimizer, added, replication, snapshot)
    return OptimizerSection.from_json(encoded, prefix)


def _section(
    optimizer: torch.optim.Optimizer, names: ParamNames, label: str | None
) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` keyed by parameter name, with shapes and placement."""
    group_names = group_param_names(names, optimizer, label=label)
    saved = optimizer.state_dict()
    groups, state, shapes = [], {}, {}
    placement: dict[str, str] = {}
    own_dtype: set[str] = set()
    for g, (saved_group, names_in_group, live_group) in enumerate(
        zip(saved["param_groups"], group_names, optimizer.param_groups, strict=True)
    ):
        for index, name, param in zip(
            saved_group["params"], names_in_group, live_group["params"], strict=True
        ):
            shapes[name] = list(param.shape)
            if index in saved["state"]:
                state[name] = saved["state"][index]
                note_placement(state[name], param, placement, own_dtype)
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        groups.append({"params": names_in_group, "hyper": hyper})
        if len(set(names_in_group)) != len(names_in_group):
            raise StateMismatchError(
                f"{label or 'optimizer'} param group {g} lists a parameter twice"
            )
    return {
        "type": type(optimizer).__qualname__,
        "groups": groups,
        "state": state,
        "shapes": shapes,
        "placement": placement,
        "own_dtype": sorted(own_dtype),
    }


def _sort_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: set[str],
    replication: Replication,
    snapshot: Snapshot,
) -> None:
    """Replicated, per rank or to be verified: each state tensor follows its parameter.

    Only the state of parameters DDP synchronizes stays ``balanced``; state that cannot be
    traced to a parameter is verified too (never assumed).
    """
    by_id = {id(snapshot.tensors[n]): n for n in names}
    synced: set[str] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            for value in param_state(optimizer).get(param, {}).values():
                name = by_id.get(id(value))
                if name is None:
                    continue
                if id(param) in replication.synced:
                    synced.add(name)
                elif id(param) in replication.ignored:
                    snapshot.per_rank.add(name)
    snapshot.balanced -= names - synced
    snapshot.unverified |= names - synced - snapshot.per_rank


def record_steppers(optimizers: list[torch.optim.Optimizer], snapshot: Snapshot) -> None:
    """Note which optimizers' ``step()`` writes which captured tensor: their parameters
    and their per-parameter state (moments, step counts)."""
    by_identity: dict[tuple[Any, ...], list[torch.optim.Optimizer]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = param_state(optimizer).get(param, {}).values()
                for tensor in [param, *(v for v in state if isinstance(v, torch.Tensor))]:
                    writers = by_identity.setdefault(tensor_identity(tensor) or (), [])
                    if optimizer not in writers:
                        writers.append(optimizer)
    by_identity.pop((), None)
    captured = {**snapshot.tensors, **snapshot.owned,
                **{name: shard.local for name, shard in snapshot.sharded.items()}}  # fmt: skip
    for name, tensor in captured.items():
        stepping = by_identity.get(tensor_identity(tensor) or ())
        if stepping:
            snapshot.stepped_by[name] = stepping
