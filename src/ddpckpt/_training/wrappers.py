"""The user's objects as the training loop holds them: a model inside its wrappers (DDP,
DataParallel, torch.compile), an object with state. Every function is local to the caller."""

from __future__ import annotations

import sys
from collections.abc import Iterator

from torch import nn


def inner_attr(module: nn.Module) -> str | None:
    """The attribute holding the wrapped module, if ``module`` is a wrapper."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return "module"
    compiled = _optimized_module_type()
    if compiled is not None and isinstance(module, compiled):
        return "_orig_mod"
    return None


def _optimized_module_type() -> type | None:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(dynamo, "OptimizedModule", None)


def wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """The wrappers (DDP, DataParallel, torch.compile) around the user's module in
    ``model``, outermost first."""
    while (attr := inner_attr(model)) is not None:
        yield model
        model = getattr(model, attr)


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if that module is imported: one that made such objects has imported it
    (looked up, not imported: importing FSDP costs a save tens of MB)."""
    return getattr(sys.modules.get(module), name, None)


def dtensor_wrapper(module: nn.Module) -> str | None:
    """What turned ``module``'s parameters into DTensors, on it or on any submodule:
    ``"FSDP2"`` (``fully_shard``, HSDP included) or ``"replicate()"``; ``None`` for neither."""
    fsdp = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp is None:
        return None
    replicated = _loaded_class("torch.distributed._composable.replicate_with_fsdp",
                               "ReplicateModule")  # fmt: skip
    found = [m for m in module.modules() if isinstance(m, fsdp)]
    if not found:
        return None
    if replicated is not None and all(isinstance(m, replicated) for m in found):
        return "replicate()"
    return "FSDP2"


def user_class(module: nn.Module) -> type:
    """The class the user wrote of ``module``: FSDP2 and ``replicate()`` swap a module's
    class for a dynamic subclass (``FSDPSequential``, ``ReplicateSequential``)."""
    fsdp = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp is None or not isinstance(module, fsdp):
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, fsdp))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any nesting of DDP, DataParallel and torch.compile."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}")
    while (attr := inner_attr(model)) is not None:
        model = getattr(model, attr)
    return model


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )
