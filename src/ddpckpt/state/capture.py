"""What a checkpoint holds, taken from live training objects and put back into them.

The entry points :mod:`ddpckpt.io` uses. Capture is local to a process;
:mod:`ddpckpt.io.writing` decides which rank writes what, :mod:`ddpckpt.io.load` restores
each part through the functions re-exported here:

* **Model** (:mod:`ddpckpt.state.model`): canonical keys, tied weights, what DDP keeps
  replicated; restored through the module's own ``load_state_dict``.
* **Optimizer** (:mod:`ddpckpt.state.optimizer`): state and param groups keyed by
  *parameter name*, with shapes.
* **Scheduler, GradScaler, extras** (:mod:`ddpckpt.state.objects`): their
  ``state_dict()``, encoded without pickle.
* **Per rank**: RNG states (see :mod:`ddpckpt.state.rng`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpckpt.format.codec import encode
from ddpckpt.state.model import capture_model, check_model, restore_model, restore_rank_buffers
from ddpckpt.state.objects import capture_extra, capture_stateful, extra_kind, restore_stateful
from ddpckpt.state.optimizer import (
    capture_optimizer,
    check_optimizer,
    record_steppers,
    restore_optimizer,
)
from ddpckpt.state.rng import capture_rng
from ddpckpt.state.snapshot import Snapshot

__all__ = [
    "Snapshot",
    "capture",
    "check_model",
    "check_optimizer",
    "extra_kind",
    "restore_model",
    "restore_optimizer",
    "restore_rank_buffers",
    "restore_stateful",
]


def capture(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Snapshot:
    """Capture the training state of this process (no I/O, no communication).

    Tensors in the snapshot are the live tensors themselves (detached), not copies.
    """
    snapshot = Snapshot()
    root, replication = capture_model(model, snapshot)
    if optimizer is not None:
        capture_optimizer(optimizer, root, replication, snapshot)
    if scheduler is not None:
        capture_stateful("scheduler", scheduler, snapshot)
    if scaler is not None:
        capture_stateful("scaler", scaler, snapshot)
    if extra:
        capture_extra(extra, snapshot)
    if rng:
        snapshot.rank_state["rng"] = encode(capture_rng(), "rng", snapshot.rank_tensors)
    candidates = [optimizer, *(extra or {}).values()]
    optimizers = [o for o in candidates if isinstance(o, torch.optim.Optimizer)]
    record_steppers(optimizers, snapshot)
    return snapshot
