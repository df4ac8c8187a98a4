"""What ``ddpckpt check-resume`` records of the training state: one digest per component.

Components are named after the objects of the :class:`~ddpckpt.TrainingState` the script
checkpoints (a name the keyword shorthand gives is left out):

* ``model.parameters``, ``model.buffers`` (a state's model ``G``: ``model:G.parameters``);
* ``optimizer`` (``optimizer:opt_G``; one in ``extra``: ``optimizer:extra.NAME``; one that
  steps but is in no state: ``optimizer:unsaved.N``) and ``lr``, the learning rates of the
  optimizers the state holds;
* ``scheduler`` (``scheduler:NAME``), ``scaler`` (``scaler:NAME``);
* ``rng.python``, ``rng.numpy``, ``rng.torch``, ``rng.cuda``: the random generators;
* ``loader`` (``loader:NAME`` for a DataLoader in ``extra`` under another name than
  ``loader``): a tracked DataLoader's position, and ``loader.samples`` the sample indices of
  the batches it yielded in a step; ``extra.NAME``: any other ``extra`` entry;
* ``inputs`` (a digest of what the models were called with) and ``loss`` (``log_step``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import xxhash

from ddpckpt._format.tensorfile import byte_view
from ddpckpt._state.dtensor import local_tensor
from ddpckpt._state.zero import local_state_dict

SAMPLES_KEPT = 4096  # sample indices stored per step and loader; more are stored as a digest
CONSUMED = ("inputs", "loss", "loader*.samples")  # what a step read, not state it left


def digest(obj: Any) -> str:
    """A 64-bit hash of a nested state (tensors by dtype, shape and bytes; values by repr)."""
    hasher = xxhash.xxh3_64()
    feed(hasher, obj)
    return hasher.hexdigest()


def feed(hasher: Any, obj: Any) -> None:
    """Add ``obj`` to ``hasher`` (see :func:`digest`)."""
    if isinstance(obj, torch.Tensor):
        tensor = local_tensor(obj).detach()  # a DTensor: this rank's shard
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            hasher.update(byte_view(tensor))
    elif isinstance(obj, Mapping):
        hasher.update(b"{")
        for key, value in obj.items():
            feed(hasher, key)
            feed(hasher, value)
        hasher.update(b"}")
    elif isinstance(obj, (list, tuple)):
        hasher.update(b"[")
        for value in obj:
            feed(hasher, value)
        hasher.update(b"]")
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype"):  # a numpy array
        hasher.update(f"A{obj.dtype}{getattr(obj, 'shape', ())}".encode())
        hasher.update(obj.tobytes())
    else:
        hasher.update(repr(obj).encode())


def number(value: Any) -> Any:
    """A tensor as a number (or a list of numbers); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def named(kind: str, name: str) -> str:
    """The component of the object ``name`` of a role: ``optimizer``, ``optimizer:opt_G``."""
    return kind if name == kind else f"{kind}:{name}"


def loader_name(name: str) -> str:
    return named("loader", name)


def json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return number(value)
    if isinstance(value, Iterable):
        return list(value)
    return repr(value)


# ---------------------------------------------------------------------- the components


def models(state: Any) -> dict[str, Any]:
    from ddpckpt._training.wrappers import unwrap_model

    found: dict[str, Any] = {}
    for name, model in state.models.items():
        root = unwrap_model(model)
        found[f"{named('model', name)}.parameters"] = {
            n: digest(p) for n, p in root.named_parameters()
        }
        found[f"{named('model', name)}.buffers"] = {n: digest(b) for n, b in root.named_buffers()}
    return found


def optimizer_entries(
    state: Any, stepped: Sequence[torch.optim.Optimizer]
) -> list[tuple[str, torch.optim.Optimizer]]:
    """Every optimizer the recorder knows, by component: the state's, then those in
    ``extra``, then those that stepped without being in the state."""
    known: list[tuple[str, torch.optim.Optimizer]] = []
    if state is not None:
        known += [(named("optimizer", n), o) for n, o in state.optimizers.items()]
        known += [
            (f"optimizer:extra.{n}", o)
            for n, o in state.extra.items()
            if isinstance(o, torch.optim.Optimizer)
        ]
    unsaved = [o for o in stepped if all(o is not k for _, k in known)]
    return known + [(f"optimizer:unsaved.{i}", o) for i, o in enumerate(unsaved)]


def optimizers(
    state: Any, stepped: Sequence[torch.optim.Optimizer], *, saved_only: bool = False
) -> dict[str, Any]:
    found = {}
    for component, optimizer in optimizer_entries(state, stepped):
        if saved_only and component.startswith("optimizer:unsaved"):
            continue
        saved = local_state_dict(optimizer)
        # The groups the user and schedulers change: ZeRO copies them into its local
        # optimizer only inside step(), so the local optimizer's lag behind.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        found[component] = {
            "type": type(optimizer).__name__,
            "entries": len(saved["state"]),
            "state": digest(saved["state"]),
            "groups": digest(groups),
        }
    return found


def schedule(state: Any, stepped: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """``lr`` (of the optimizers the state holds; others are their own component) and
    each scheduler's position."""
    found: dict[str, Any] = {}
    lrs = []
    for component, optimizer in optimizer_entries(state, stepped):
        if not component.startswith("optimizer:unsaved"):
            lrs += [number(g.get("lr")) for g in optimizer.param_groups]
    found["lr"] = lrs
    for name, scheduler in state.schedulers.items() if state is not None else ():
        if not callable(getattr(scheduler, "state_dict", None)):
            continue
        saved = scheduler.state_dict()
        last_lr = getattr(scheduler, "get_last_lr", None)
        found[named("scheduler", name)] = {
            "last_epoch": number(saved.get("last_epoch")),
            "lr": [number(v) for v in last_lr()] if callable(last_lr) else None,
            "state": digest(saved),
        }
    return found


def scalers(state: Any) -> dict[str, Any]:
    return {
        named("scaler", name): {k: number(v) for k, v in scaler.state_dict().items()}
        for name, scaler in state.scalers.items()
    }


def rng() -> dict[str, str]:
    from ddpckpt._state.rng import capture_rng

    return {f"rng.{part}": digest(value) for part, value in capture_rng().items()}


def extras(state: Any) -> dict[str, Any]:
    from ddpckpt._training.loader import consumed, is_tracked

    found: dict[str, Any] = {}
    for name, obj in state.extra.items():
        if is_tracked(obj):
            found[loader_name(name)] = consumed(obj) or "not started"
        elif isinstance(obj, (torch.optim.Optimizer, torch.utils.data.DataLoader)):
            continue
        elif callable(getattr(obj, "state_dict", None)):
            found[f"extra.{name}"] = digest(obj.state_dict())
        else:  # a plain value (tensor, number, dict, list, numpy array): saved as it is
            found[f"extra.{name}"] = digest(obj)
    return found


def whole(state: Any, stepped: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """Every component of ``state`` (``None``: only the generators and the optimizers
    that stepped, before a plain loop's first save or load names the state)."""
    found: dict[str, Any] = {}
    if state is not None:
        found.update(models(state))
    found.update(optimizers(state, stepped))
    found.update(schedule(state, stepped))
    if state is not None:
        found.update(scalers(state))
    found.update(rng())
    if state is not None:
        found.update(extras(state))
    return found


def at_start(state: Any, stepped: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """What a step starts from: the state the previous step (or the resume) left, so that
    a change made between the resume and the first step is told from what the step did.
    Optimizers the state does not hold are known only once they step: left out."""
    found: dict[str, Any] = {}
    found.update(rng())
    found.update(schedule(state, stepped))
    if state is not None:
        found.update(models(state))
    found.update(optimizers(state, stepped, saved_only=True))
    return found


def consumed(
    state: Any, samples: Mapping[int, list[Any]], inputs: Any, forwards: int, losses: list[Any]
) -> dict[str, Any]:
    """What a step read: its batches' sample indices, its inputs, its losses."""
    found: dict[str, Any] = {}
    names = {id(obj): name for name, obj in (state.extra.items() if state is not None else ())}
    for loader, batches in samples.items():
        component = loader_name(names.get(loader, "unnamed"))
        kept = sum(len(b) for b in batches) <= SAMPLES_KEPT
        found[f"{component}.samples"] = batches if kept else digest(batches)
    if forwards:
        found["inputs"] = {"forwards": forwards, "digest": inputs.hexdigest()}
    if losses:
        found["loss"] = losses
    return found
