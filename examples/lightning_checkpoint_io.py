"""A PyTorch Lightning ``CheckpointIO`` that writes ddpckpt checkpoints.

    trainer = lightning.Trainer(plugins=[DdpckptCheckpointIO()], ...)

Lightning calls ``save_checkpoint`` on global rank 0 only and ``load_checkpoint`` on every
rank; :func:`ddpckpt.save_dict` and :func:`ddpckpt.load_dict` need nothing from the other
ranks. Each ``.ckpt`` path becomes a checkpoint directory: no pickle, checksummed,
committed atomically (a crash mid-save leaves the previous checkpoint as it was).

Lightning is imported only inside this file; ddpckpt's tests do not run it (the test
suite exercises ``save_dict``/``load_dict`` with a Lightning-shaped dict instead).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO

import ddpckpt


def _plain(value: Any) -> Any:
    """``value`` with Lightning's ``AttributeDict`` (hyperparameters) and other dict
    subclasses as plain dicts: ddpckpt refuses types it cannot restore as they were."""
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _plain(v)) for k, v in value.items())
    if isinstance(value, Mapping) and type(value) not in (Counter, defaultdict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class DdpckptCheckpointIO(CheckpointIO):
    """Saves Lightning's checkpoint dict with ddpckpt; loads it back onto the CPU."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("DdpckptCheckpointIO takes no storage_options")
        step = checkpoint.get("global_step")
        epoch = checkpoint.get("epoch")
        ddpckpt.save_dict(
            str(path),
            _plain(checkpoint),
            step=step if isinstance(step, int) else None,
            epoch=epoch if isinstance(epoch, int) else None,
            overwrite=True,  # Lightning rewrites e.g. last.ckpt; the swap is atomic
        )

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # None would put every tensor on the device rank 0 saved it from (cuda:0 on every
        # rank); Lightning copies the state into the modules itself, so read it on the CPU.
        return ddpckpt.load_dict(
            str(path), map_location="cpu" if map_location is None else map_location
        )

    def remove_checkpoint(self, path: Any) -> None:
        ddpckpt.remove_checkpoint(str(path))
