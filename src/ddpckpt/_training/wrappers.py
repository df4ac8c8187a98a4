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
