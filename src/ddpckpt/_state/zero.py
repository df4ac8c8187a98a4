"""``ZeroRedundancyOptimizer`` (ZeRO-1): optimizer state sharded over the DDP ranks.

ZeRO assigns each parameter to one rank (``_partition_parameters``: largest first to the
rank with the fewest elements) and keeps that parameter's state only there, in its local
optimizer (``zero.optim``); ``zero.param_groups`` hold every parameter and the
hyperparameters the user and schedulers change. torch's own ``state_dict()`` needs
``consolidate_state_dict()`` first, which gathers the whole state onto one rank: the very
memory ZeRO exists to save.

Here no rank gathers anything. Each rank captures the state of the parameters it owns,
keyed by parameter name, into ``Snapshot.owned`` and writes it itself; the manifest's
optimizer section (written by the first rank, with each rank's part merged in:
:func:`merge_owned_state`) then looks like that of a plain optimizer of the same class,
plus ZeRO's partition (``zero``: which rank owned each parameter, for ``inspect``).
Loading reads, on each rank, only the state of the parameters the live partition gives
it, at any world size; the same checkpoint loads into a plain optimizer of the inner
class too, and a plain optimizer's checkpoint into ZeRO.

Every function here is local to the calling rank.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from ddpckpt._format.codec import JSON, encode
from ddpckpt._format.statelayout import layout_of
from ddpckpt._state.placement import note_placement
from ddpckpt.errors import UnsupportedValueError


def is_zero(optimizer: object) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (looked up, not imported: a
    process that made one has imported its module)."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    kind = getattr(module, "ZeroRedundancyOptimizer", None)
    return kind is not None and isinstance(optimizer, kind)


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's type as a checkpoint records it: ZeRO's is its local optimizer's
    (``AdamW`` ...), whose state it holds."""
    inner = optimizer.optim if is_zero(optimizer) else optimizer  # type: ignore[attr-defined]
    return type(inner).__qualname__


def param_state(optimizer: torch.optim.Optimizer) -> Mapping[Any, Any]:
    """Per-parameter state by parameter, where the optimizer keeps it (ZeRO: this rank's
    local optimizer, for the parameters it owns)."""
    return optimizer.optim.state if is_zero(optimizer) else optimizer.state  # type: ignore[attr-defined]


def local_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``; ZeRO's local optimizer's (this rank's shard), which
    needs no consolidation."""
    inner = optimizer.optim if is_zero(optimizer) else optimizer  # type: ignore[attr-defined]
    return inner.state_dict()


def _check_supported(zero: Any, label: str) -> None:
    if zero._overlap_with_ddp:
        raise UnsupportedValueError(
            f"{label}: ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported (its "
            "functional local optimizer has no state to save until DDP's buckets are "
            "rebuilt); construct it with overlap_with_ddp=False"
        )


def zero_section(
    zero: Any, group_names: list[list[str]], label: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """ZeRO's optimizer section (shared: param groups, shapes, partition; no state) and
    this rank's part (the state of the parameters it owns, keyed by name, with where it
    lives), before encoding; ``group_names`` names each group's parameters."""
    _check_supported(zero, label)
    local = zero.optim
    saved = local.state_dict()
    by_param: dict[int, Any] = {}
    for saved_group, live_group in zip(saved["param_groups"], local.param_groups, strict=True):
        for index, param in zip(saved_group["params"], live_group["params"], strict=True):
            if index in saved["state"]:
                by_param[id(param)] = saved["state"][index]
    owners = zero._param_to_rank
    groups, shapes, ranks, own = [], {}, [], {}
    placement: dict[str, str] = {}
    own_dtype: set[str] = set()
    for group, names in zip(zero.param_groups, group_names, strict=True):
        for name, param in zip(names, group["params"], strict=True):
            shapes[name] = list(param.shape)
            if id(param) in by_param:
                own[name] = by_param[id(param)]
                note_placement(own[name], param, placement, own_dtype)
        groups.append({"params": names, "hyper": {k: v for k, v in group.items() if k != "params"}})
        ranks.append([owners[p] for p in group["params"]])
    section = {"type": type(local).__qualname__, "groups": groups, "state": {}, "shapes": shapes,
               "placement": {}, "own_dtype": [],
               "zero": {"world_size": zero.world_size, "ranks": ranks}}  # fmt: skip
    part = {"state": own, "placement": placement, "own_dtype": sorted(own_dtype)}
    return section, part


def encode_owned(part: dict[str, Any], prefix: str, owned: dict[str, torch.Tensor]) -> JSON:
    """This rank's part of a ZeRO section encoded, its tensors added to ``owned`` under the
    names a plain optimizer's state would have (``<prefix>/state/<param>/<key>``)."""
    state = {name: encode(value, f"{prefix}/state/{name}", owned)
             for name, value in part["state"].items()}  # fmt: skip
    return {"state": state, "placement": part["placement"], "own_dtype": part["own_dtype"]}


def merge_owned_state(state: dict[str, JSON], parts: list[dict[str, JSON]]) -> None:
    """Merge every rank's encoded part (by optimizer name, from :func:`encode_owned`) into
    the manifest's ``state``: its optimizer sections then hold every parameter's state."""
    named = layout_of(state).named
    for part in parts:
        for name, owned in part.items():
            section = state["optimizers"][name] if named else state["optimizer"]
            section["state"].update(owned["state"])
            section["placement"].update(owned["placement"])
            section["own_dtype"] = sorted({*section["own_dtype"], *owned["own_dtype"]})


def after_restore(zero: Any) -> None:
    """Make ZeRO's exposed param groups show the hyperparameters just loaded into its
    local optimizer (schedulers read and write the exposed ones)."""
    zero._sync_param_groups(zero.optim.param_groups, zero.param_groups)
