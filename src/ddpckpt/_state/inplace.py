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

# (module type, the attribute that, when set, makes its forward write ``weight``)
_WRITES_WEIGHT_IN_FORWARD: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Embedding, "max_norm"),
    (nn.EmbeddingBag, "max_norm"),
)


def forward_writers(model: nn.Module) -> list[nn.Module]:
    """The submodules of ``model`` whose forward writes their ``weight`` in place."""
    return [
        module
        for module in model.modules()
        for kind, flag in _WRITES_WEIGHT_IN_FORWARD
        if isinstance(module, kind) and getattr(module, flag, None) is not None
    ]


def record_forward_writers(models: list[nn.Module], snapshot: Snapshot) -> None:
    """Note, in ``snapshot.written_in_forward``, which captured tensors a module's
    forward writes, and those modules."""
    by_identity: dict[tuple[object, ...], list[nn.Module]] = {}
    for model in models:
        for module in forward_writers(model):
            identity = tensor_identity(module.weight)
            if identity is not None:
                by_identity.setdefault(identity, []).append(module)
    if not by_identity:
        return
    captured = {**snapshot.tensors, **{n: s.local for n, s in snapshot.sharded.items()}}
    for name, tensor in captured.items():
        modules = by_identity.get(tensor_identity(tensor) or ())
        if modules:
            snapshot.written_in_forward[name] = modules
