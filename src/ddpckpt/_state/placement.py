"""Where an optimizer keeps each state tensor relative to its parameter, as a save
records it (:func:`note_placement`, for a plain optimizer's section and ZeRO's); a load
puts the state back there (:mod:`ddpckpt._state.optimizer`). Local to the calling rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def note_placement(
    state: Mapping[str, Any], param: torch.Tensor, placement: dict[str, str], own_dtype: set[str]
) -> None:
    """Record where the optimizer keeps each state tensor, relative to its parameter.

    Optimizers keep some scalars apart from the parameter (NAdam's ``mu_product`` on the
    host, ASGD's ``step`` on the device, float32 steps beside bfloat16 weights), which
    torch's own ``load_state_dict`` policy does not know: restoring them where they were
    keeps a resumed step identical. Only a parameter off the CPU tells host from device.
    """
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if param.device.type != "cpu":
            placement.setdefault(key, "param" if value.device == param.device else "host")
        if param.is_floating_point() and value.dtype != param.dtype:
            own_dtype.add(key)
