"""Modules whose ``forward`` writes their own parameters in place.

The overlap mode of asynchronous saves copies parameters while the next forward runs,
on the assumption that only ``optimizer.step()`` writes them. A few of PyTorch's own
modules break it by design: an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``max_norm``
renormalises, in place, the rows each forward looks up. :func:`record_forward_writers`
notes their parameters, so that the saver copies them before ``save()`` returns
(:mod:`ddpckpt._io.async_saver`): a hook on their forward would need removing, and would
break a compiled model's graph. Writes it cannot foresee are caught after the fact
(:mod:`ddpckpt._io.staging`).
"""

from __future__ import annotations

from torch import nn

from ddpckpt._state.model import tensor_identity
from ddpckpt._state.snapshot import Snapshot

# The modules whose ``weight`` their forward may write.
_Writer = nn.Embedding | nn.EmbeddingBag

# (module type, the attribute that, when set, makes its forward write ``weight``)
_WRITES_WEIGHT_IN_FORWARD: tuple[tuple[type[_Writer], str], ...] = (
    (nn.Embedding, "max_norm"),
    (nn.EmbeddingBag, "max_norm"),
)


def forward_writers(model: nn.Module) -> list[_Writer]:
    """The submodules of ``model`` whose forward writes their ``weight`` in place."""
    return [
        module
        for module in model.modules()
        for kind, flag in _WRITES_WEIGHT_IN_FORWARD
        if isinstance(module, kind) and getattr(module, flag, None) is not None
    ]


def record_forward_writers(models: list[nn.Module], snapshot: Snapshot) -> None:
    """Note, in ``snapshot.written_in_forward``, the captured tensors a module's forward
    writes."""
    written = {
        identity
        for model in models
        for module in forward_writers(model)
        if (identity := tensor_identity(module.weight)) is not None
    }
    if not written:
        return
    captured = {**snapshot.tensors, **{n: s.local for n, s in snapshot.sharded.items()}}
    snapshot.written_in_forward.update(
        name for name, tensor in captured.items() if tensor_identity(tensor) in written
    )
