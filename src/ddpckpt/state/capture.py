"""What a checkpoint holds, taken from live training objects and put back into them.

Capture is local to a process; :mod:`ddpckpt.io.checkpoint` decides which rank writes what.

* **Model**: unwrapped from ``DistributedDataParallel``, ``DataParallel`` and
  ``torch.compile`` at any depth; keys are canonical (no ``module.`` or ``_orig_mod.``).
  Tied weights are stored once and recorded as aliases. Loading goes through the
  module's own ``load_state_dict`` (so its hooks run) after a strict key/shape check
  that reports every difference at once.
* **Optimizer**: state and param groups keyed by *parameter name*, with shapes, so
  reordered module definitions restore the right moments or fail with a clear error.
* **Scheduler, GradScaler, extras**: their ``state_dict()``, encoded without pickle.
* **Per rank**: RNG states (see :mod:`ddpckpt.state.rng`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ddpckpt._log import get_logger
from ddpckpt.errors import StateMismatchError, UnsupportedValueError
from ddpckpt.format.codec import JSON, decode, encode
from ddpckpt.state.rng import capture_rng

__all__ = [
    "ModelView",
    "PerRank",
    "Snapshot",
    "TensorSource",
    "canonical_state_dict",
    "capture",
    "is_stateful",
    "model_view",
    "restore_rank_buffers",
    "unwrap_model",
]

_log = get_logger(__name__)
_LIST_LIMIT = 12


class TensorSource(Protocol):
    """Supplies verified tensors by name while restoring."""

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape of ``name``, without reading it."""
        ...

    def get(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor called ``name``, on the CPU (or already in ``like``).

        The result may share memory with the checkpoint file: callers copy from it and
        never keep it or write to it. ``like`` is a tensor the caller will copy into; a
        source may fill it directly and return it.
        """
        ...


@dataclass
class Snapshot:
    """One rank's captured training state.

    ``state`` and ``tensors`` are the shared training state (model, optimizer, scheduler,
    scaler, extras): stored once. Only the tensors named in ``balanced`` are identical on
    every rank, so only they may be written by any rank: parameters DDP synchronizes and
    their optimizer state. Tensors in ``unverified`` are assumed identical on every rank
    but nothing guarantees it (a model without DDP, module-valued extras such as an EMA
    copy, optimizer state of parameters outside DDP): :mod:`ddpckpt.dist.consistency`
    compares their digests across ranks, treats the identical ones as ``balanced`` and
    stores the others per rank. Tensors in ``per_rank`` differ between ranks by design
    (parameters and buffers DDP ignores, and their optimizer state): stored per rank
    whenever there are several ranks. Every other shared tensor (buffers such as BatchNorm
    statistics, which each rank updates with its own batch until DDP broadcasts rank 0's
    at the next forward) is stored as rank 0 holds it.

    ``rank_state`` and ``rank_tensors`` are this rank's own (RNG, buffers under
    ``broadcast_buffers=False``, and, under ``rank_state["own"]``, this rank's values of
    shared tensors that differ between ranks; see :meth:`keep_per_rank`): stored per rank.
    ``stepped_by`` maps a shared tensor to the optimizers whose ``step()`` writes it (for
    the overlap mode, which may copy such tensors until the first of those steps).
    Tensors are referenced from the trees by name.
    """

    state: dict[str, JSON] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    balanced: set[str] = field(default_factory=set)
    unverified: set[str] = field(default_factory=set)
    per_rank: set[str] = field(default_factory=set)
    rank_state: dict[str, JSON] = field(default_factory=dict)
    rank_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stepped_by: dict[str, list[torch.optim.Optimizer]] = field(default_factory=dict)

    def keep_per_rank(self, names: Iterable[str]) -> None:
        """Store this rank's values of the shared tensors ``names`` in its own file too.

        The shared copy keeps rank 0's values (what a rank that did not exist at save time
        loads); :func:`ddpckpt.io.checkpoint.load` gives every other rank its own.
        """
        own = self.rank_state.setdefault("own", {})
        for name in names:
            self.balanced.discard(name)
            self.unverified.discard(name)
            self.rank_tensors[f"own/{name}"] = self.tensors[name]
            own[name] = f"own/{name}"  # type: ignore[index]


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


# --------------------------------------------------------------------------- model


def _inner_attr(module: nn.Module) -> str | None:
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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any nesting of DDP, DataParallel and torch.compile."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__qualname__}")
    while (attr := _inner_attr(model)) is not None:
        model = getattr(model, attr)
    return model


def _canonical_key(root: nn.Module, key: str, *, is_module_path: bool = False) -> str:
    """``key`` without the path segments that only step through wrapper modules."""
    parts = key.split(".") if key else []
    module_parts = parts if is_module_path else parts[:-1]
    kept: list[str] = []
    module: nn.Module | None = root
    for part in module_parts:
        if module is not None and _inner_attr(module) == part:
            module = getattr(module, part)
            continue
        kept.append(part)
        module = module._modules.get(part) if module is not None else None
    if not is_module_path:
        kept.append(parts[-1])
    return ".".join(kept)


@dataclass
class ModelView:
    """A model's state dict under canonical keys, with the way back to live keys."""

    root: nn.Module
    entries: dict[str, Any]  # canonical key -> live tensor (or extra-state object)
    live_key: dict[str, str]  # canonical key -> key in root.state_dict()
    versions: dict[str, int]  # canonical module path -> module version


def model_view(model: nn.Module) -> ModelView:
    root = unwrap_model(model)
    live = root.state_dict(keep_vars=True)
    entries: dict[str, Any] = {}
    live_key: dict[str, str] = {}
    for key, value in live.items():
        name = _canonical_key(root, key)
        entries[name] = value
        live_key[name] = key
    versions: dict[str, int] = {}
    for prefix, meta in getattr(live, "_metadata", {}).items():
        if isinstance(meta, dict) and isinstance(meta.get("version"), int):
            versions[_canonical_key(root, prefix, is_module_path=True)] = meta["version"]
    return ModelView(root, entries, live_key, versions)


def canonical_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with canonical keys (no wrapper prefixes), live tensors."""
    return model_view(model).entries


def _tensor_identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    if tensor.numel() == 0:
        return None
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


@dataclass
class _Replication:
    """What the DDP wrappers around a model keep identical on every rank (by tensor id)."""

    wrapped: bool = False
    synced: set[int] = field(default_factory=set)  # parameters DDP broadcasts and all-reduces
    ignored: set[int] = field(default_factory=set)  # parameters and buffers DDP leaves alone
    rank_buffers: bool = False  # broadcast_buffers=False: each rank keeps its own buffers


def _replication(model: nn.Module) -> _Replication:
    """Which of ``model``'s tensors DDP keeps replicated, from every DDP wrapper around it.

    DDP synchronizes a parameter unless its name is in ``parameters_to_ignore`` (set by
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``); parameters
    it all-reduces late (``delay_all_reduce_named_params``) are listed there too, but are
    synchronized.
    """
    found = _Replication()
    while (attr := _inner_attr(model)) is not None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            found.wrapped = True
            found.rank_buffers |= not model.broadcast_buffers
            ignore = set(getattr(model, "parameters_to_ignore", ()))
            delayed = {id(p) for p in getattr(model, "_delay_all_reduce_params", ())}
            for name, param in model.module.named_parameters():
                synced = name not in ignore or id(param) in delayed
                (found.synced if synced else found.ignored).add(id(param))
            found.ignored.update(id(b) for n, b in model.module.named_buffers() if n in ignore)
        model = getattr(model, attr)
    return found


def _capture_model(model: nn.Module, snapshot: Snapshot) -> tuple[nn.Module, _Replication]:
    view = model_view(model)
    replication = _replication(model)
    parameters = {id(p) for p in view.root.parameters()}
    keys: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    extra_state: dict[str, Any] = {}
    for key, value in view.entries.items():
        if not isinstance(value, torch.Tensor):
            extra_state[key] = value
            continue
        identity = _tensor_identity(value)
        if identity is not None and identity in seen:
            aliases[key] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = key
        keys.append(key)
        name = f"model/{key}"
        snapshot.tensors[name] = value.detach()
        if id(value) in replication.ignored:
            snapshot.per_rank.add(name)
        elif id(value) in replication.synced:
            snapshot.balanced.add(name)
        elif id(value) in parameters or not replication.wrapped:
            snapshot.unverified.add(name)  # no DDP keeps it identical: compared before writing
    if replication.rank_buffers:
        elsewhere = snapshot.balanced | snapshot.per_rank | snapshot.unverified
        buffers = {
            key: snapshot.tensors[f"model/{key}"] for key in keys if f"model/{key}" not in elsewhere
        }
        snapshot.rank_state["model_buffers"] = encode(
            buffers, "model_buffers", snapshot.rank_tensors
        )
    section: dict[str, JSON] = {
        "type": type(view.root).__qualname__,
        "keys": keys,
        "aliases": aliases,
        "versions": view.versions,
        "extra_keys": list(extra_state),
    }
    if extra_state:
        section["extra_state"] = encode(extra_state, "model_extra_state", snapshot.tensors)
    snapshot.state["model"] = section
    return view.root, replication


def _limited(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    more = len(items) - _LIST_LIMIT
    return shown + (f", ... and {more} more" if more > 0 else "")


def _mismatch_report(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    lines = []
    if missing:
        lines.append(f"  missing from the checkpoint ({len(missing)}): {_limited(missing)}")
    if unexpected:
        lines.append(f"  unexpected in the checkpoint ({len(unexpected)}): {_limited(unexpected)}")
    if shapes:
        lines.append(f"  shape mismatch ({len(shapes)}): {_limited(shapes)}")
    return "\n".join(lines)


def check_model(
    model: nn.Module, section: Mapping[str, Any], source: TensorSource, where: str, strict: bool
) -> None:
    """Compare the checkpoint's model keys and shapes with the live model's (reads nothing).

    With ``strict`` any difference raises :class:`StateMismatchError` listing all of
    them; otherwise the differences are logged as a warning and skipped on load.
    """
    live = model_view(model).entries
    shapes = {key: source.meta(f"model/{key}")[1] for key in section["keys"]}
    stored = [*section["keys"], *section["aliases"], *section["extra_keys"]]
    missing = [k for k in live if k not in set(stored)]
    unexpected = [k for k in stored if k not in live]
    wrong = [
        f"{key}: checkpoint {list(shapes[key])}, model {list(live[key].shape)}"
        for key in section["keys"]
        if isinstance(live.get(key), torch.Tensor) and tuple(live[key].shape) != shapes[key]
    ]
    if not (missing or unexpected or wrong):
        return
    report = _mismatch_report(missing, unexpected, wrong)
    if strict:
        raise StateMismatchError(
            f"{where}: checkpoint does not match the model "
            f"({type(unwrap_model(model)).__qualname__}):\n{report}\n"
            "Keys are compared without 'module.'/'_orig_mod.' wrapper prefixes. "
            "Pass strict=False to load only the matching keys."
        )
    _log.warning("%s: loading with strict=False; skipping what does not match:\n%s", where, report)


def restore_model(
    model: nn.Module, section: Mapping[str, Any], source: TensorSource, where: str, strict: bool
) -> None:
    """Load the weights into ``model`` through its own ``load_state_dict`` (hooks run).

    Call :func:`check_model` first; with ``strict=False`` mismatched keys are skipped.
    """
    view = model_view(model)
    state: dict[str, Any] = {}
    for key in section["keys"]:
        target = view.entries.get(key)
        name = f"model/{key}"
        if isinstance(target, torch.Tensor) and tuple(target.shape) == source.meta(name)[1]:
            # Not read straight into the parameter: the module's load hooks must see the
            # incoming value apart from the current one. A GPU copy is read onto the GPU
            # (pinned, pipelined) rather than mapped then copied from pageable memory.
            like = torch.empty_like(target) if target.is_cuda else None
            state[view.live_key[key]] = source.get(name, like=like)
    for alias, key in section["aliases"].items():
        if alias in view.live_key and key in view.live_key and view.live_key[key] in state:
            state[view.live_key[alias]] = state[view.live_key[key]]
    if "extra_state" in section:
        extra = decode(section["extra_state"], lambda n: source.get(n).clone(), where=where)
        state.update({view.live_key[k]: v for k, v in extra.items() if k in view.live_key})
    root = view.root
    root.load_state_dict(_with_versions(state, root, section["versions"]), strict=strict)


def restore_rank_buffers(model: nn.Module, encoded: JSON, source: TensorSource, where: str) -> None:
    """Copy this rank's own buffers (saved under ``broadcast_buffers=False``) into ``model``."""
    view = model_view(model)
    with torch.no_grad():
        for key, value in decode(encoded, source.get, where=where).items():
            target = view.entries.get(key)
            if isinstance(target, torch.Tensor) and target.shape == value.shape:
                target.copy_(value)


def _with_versions(state: dict[str, Any], root: nn.Module, versions: Mapping[str, int]) -> Any:
    """Attach the stored module versions, so version-dependent load hooks behave as saved."""
    ordered: Any = OrderedDict(state)
    ordered._metadata = OrderedDict(
        (prefix, {"version": versions[canonical]})
        for prefix, _ in root.named_modules(remove_duplicate=False)
        if (canonical := _canonical_key(root, prefix, is_module_path=True)) in versions
    )
    return ordered


# --------------------------------------------------------------------------- optimizer


def _all_param_names(root: nn.Module) -> dict[int, list[str]]:
    """Every canonical name of each parameter, by ``id``: tied weights have several."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(_canonical_key(root, name))
    return names


def _param_names(
    root: nn.Module,
    optimizer: torch.optim.Optimizer,
    stored: list[set[str]] | None = None,
) -> list[list[str]]:
    """Each param group's parameter names; parameters outside the model are named by position.

    A tied parameter has several names: it takes whichever of them ``stored`` lists for
    its group (so state saved as ``emb.weight`` reaches a model that now defines ``head``
    first), else its first name in the module's definition order.
    """
    names = _all_param_names(root)
    result = []
    for g, group in enumerate(optimizer.param_groups):
        known = stored[g] if stored is not None and g < len(stored) else set()
        result.append(
            [
                next((n for n in names[id(p)] if n in known), names[id(p)][0])
                if id(p) in names
                else f"@group{g}.{i}"
                for i, p in enumerate(group["params"])
            ]
        )
    return result


def _live_names(
    section: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[str]]:
    """Names to match stored state against: parameter names, or positions for imports."""
    if section.get("by_position"):
        return [
            [f"@group{g}.{i}" for i in range(len(group["params"]))]
            for g, group in enumerate(optimizer.param_groups)
        ]
    stored = [set(group["params"]) for group in section["groups"]]
    return _param_names(unwrap_model(model), optimizer, stored)


def _capture_optimizer(
    optimizer: torch.optim.Optimizer, root: nn.Module, snapshot: Snapshot
) -> None:
    names = _param_names(root, optimizer)
    saved = optimizer.state_dict()
    groups, state, shapes = [], {}, {}
    placement: dict[str, str] = {}
    own_dtype: set[str] = set()
    for g, (saved_group, group_names, live_group) in enumerate(
        zip(saved["param_groups"], names, optimizer.param_groups, strict=True)
    ):
        for index, name, param in zip(
            saved_group["params"], group_names, live_group["params"], strict=True
        ):
            shapes[name] = list(param.shape)
            if index in saved["state"]:
                state[name] = saved["state"][index]
                _note_placement(state[name], param, placement, own_dtype)
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        groups.append({"params": group_names, "hyper": hyper})
        if len(set(group_names)) != len(group_names):
            raise StateMismatchError(f"optimizer param group {g} lists a parameter twice")
    section = {
        "type": type(optimizer).__qualname__,
        "groups": groups,
        "state": state,
        "shapes": shapes,
        "placement": placement,
        "own_dtype": sorted(own_dtype),
    }
    before = set(snapshot.tensors)
    snapshot.state["optimizer"] = encode(section, "optimizer", snapshot.tensors)
    snapshot.balanced.update(set(snapshot.tensors) - before)


def _note_placement(
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


def check_optimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module, encoded: JSON, where: str
) -> None:
    """Raise :class:`StateMismatchError` unless the stored state fits ``optimizer`` by name."""
    section = decode(encoded, _LazyTensor, where=where)
    shapes = section["shapes"]
    live_names = _live_names(section, model, optimizer)
    stored_groups = section["groups"]
    if len(stored_groups) != len(live_names):
        raise StateMismatchError(
            f"{where}: the checkpoint's optimizer has {len(stored_groups)} param group(s), "
            f"the live {type(optimizer).__qualname__} has {len(live_names)}"
        )
    problems = []
    for g, (stored, names, group) in enumerate(
        zip(stored_groups, live_names, optimizer.param_groups, strict=True)
    ):
        live_shapes = {n: list(p.shape) for n, p in zip(names, group["params"], strict=True)}
        missing = [n for n in names if n not in stored["params"]]
        unexpected = [n for n in stored["params"] if n not in live_shapes]
        wrong = [
            f"{n}: checkpoint {shapes[n]}, model {live_shapes[n]}"
            for n in stored["params"]
            if n in live_shapes and shapes[n] is not None and list(shapes[n]) != live_shapes[n]
        ]
        if missing or unexpected or wrong:
            problems.append(f" param group {g}:\n{_mismatch_report(missing, unexpected, wrong)}")
    if problems:
        outside = [n for names in live_names for n in names if n.startswith("@")]
        if outside and not section.get("by_position"):
            problems.append(
                f" {len(outside)} of the optimizer's parameters are not parameters of the model "
                "passed; pass the model the optimizer was built over"
            )
        raise StateMismatchError(
            f"{where}: the checkpoint's optimizer state does not match the live "
            f"{type(optimizer).__qualname__}'s parameters (matched by name):\n"
            + "\n".join(problems)
        )


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    encoded: JSON,
    source: TensorSource,
    where: str,
) -> None:
    """Load optimizer state matched by parameter name (call :func:`check_optimizer` first)."""
    section = decode(encoded, _LazyTensor, where=where)
    live_names = _live_names(section, model, optimizer)
    if section.get("by_position"):
        _log.warning(
            "%s: optimizer state was imported from a torch.save file, which keys it by "
            "position: it is matched to the live parameters in order (shapes checked)",
            where,
        )
    param_groups, state, index = [], {}, 0
    for stored, names, group in zip(
        section["groups"], live_names, optimizer.param_groups, strict=True
    ):
        indices = []
        fused = bool(stored["hyper"].get("fused")) or bool(stored["hyper"].get("capturable"))
        kept = _Kept(fused, section.get("placement", {}), set(section.get("own_dtype", ())))
        for name, param in zip(names, group["params"], strict=True):
            if name in section["state"]:
                state[index] = {
                    key: _materialize(value, key, param, kept, source)
                    for key, value in section["state"][name].items()
                }
            indices.append(index)
            index += 1
        param_groups.append({**_cloned(stored["hyper"], source), "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    # load_state_dict moves every value beside its parameter; put back those kept elsewhere.
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, values in state.items():
        optimizer.state[params[index]].update(values)


class _LazyTensor(str):
    """A tensor reference decoded but not yet read (read once its destination is known)."""


@dataclass
class _Kept:
    """Where a param group's optimizer state goes: its flags and what the save recorded."""

    fused: bool  # fused or capturable: torch wants ``step`` as float32 beside the parameter
    placement: Mapping[str, str]  # key -> "param" or "host", from a save off the CPU
    own_dtype: set[str]  # keys whose dtype differed from their parameter's

    def target(self, key: str, param: torch.Tensor, stored: torch.dtype) -> tuple[Any, Any]:
        """Device and dtype of the state tensor ``key`` of ``param``."""
        where = self.placement.get(key)
        if key == "step":
            if self.fused:
                return param.device, torch.float32
            return (param.device if where == "param" else torch.device("cpu")), stored
        if where == "host":
            return torch.device("cpu"), stored
        keep = key in self.own_dtype or not param.is_floating_point()
        return param.device, (stored if keep else param.dtype)


def _materialize(
    value: Any, key: str, param: torch.Tensor, kept: _Kept, source: TensorSource
) -> Any:
    """Read a stored optimizer value straight onto the device and dtype it had when saved.

    Follows ``Optimizer._process_value_according_to_param_policy`` (state beside its
    parameter, in its dtype; ``step`` on the host unless fused or capturable), corrected by
    what the save recorded (see :func:`_note_placement`), so that ``load_state_dict`` has
    nothing left to copy and the state never shares memory with the checkpoint file. New
    tensors, never the optimizer's current ones: a load that fails a checksum halfway leaves
    the optimizer as it was, and tensors that others still hold (a ``state_dict()`` kept
    aside, a snapshot being copied) are not overwritten.
    """
    if isinstance(value, _LazyTensor):
        stored_dtype, shape = source.meta(str(value))
        device, dtype = kept.target(key, param, stored_dtype)
        target = torch.empty(shape, dtype=dtype, device=device)
        got = source.get(str(value), like=target)
        if got is not target:
            target.copy_(got)
        return target
    if isinstance(value, dict):
        return {k: _materialize(v, k, param, kept, source) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v, key, param, kept, source) for v in value)
    return value


def _cloned(value: Any, source: TensorSource) -> Any:
    """``value`` with every unread tensor reference replaced by a private CPU copy."""
    if isinstance(value, _LazyTensor):
        return source.get(str(value)).clone()
    if isinstance(value, dict):
        return {k: _cloned(v, source) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v, source) for v in value)
    return value


# --------------------------------------------------------------------------- generic objects


def _capture_stateful(kind: str, obj: Any, snapshot: Snapshot) -> None:
    snapshot.state[kind] = {
        "type": type(obj).__qualname__,
        "state": encode(obj.state_dict(), kind, snapshot.tensors),
    }


def restore_stateful(
    obj: Any, section: Mapping[str, Any], source: TensorSource, where: str
) -> None:
    """``obj.load_state_dict`` with the stored state; modules get zero-copy views."""
    # Module.load_state_dict copies into its own tensors; other objects may keep what they get.
    copies_in = isinstance(obj, nn.Module)
    obj.load_state_dict(
        decode(
            section["state"],
            lambda n: source.get(n) if copies_in else source.get(n).clone(),
            where=where,
        )
    )


class PerRank:
    """Marks an ``extra`` object whose state differs between ranks, so it is saved per rank.

    ``extra={"state": ddpckpt.PerRank(obj)}``. DataLoaders, torchdata's ``StatefulDataLoader``
    and :class:`~ddpckpt.GradientAccumulation` are recognised without it. A rank that did
    not exist when the checkpoint was saved gets rank 0's state, with a warning.
    """

    def __init__(self, obj: Any) -> None:
        if not is_stateful(obj):
            raise TypeError(
                f"PerRank needs an object with state_dict()/load_state_dict(), got {type(obj).__qualname__}"
            )
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


def extra_kind(obj: Any) -> str:
    """How an ``extra`` entry is stored: ``per_rank``, ``stateful`` (shared) or ``value``.

    A plain ``DataLoader`` becomes tracked here (see :mod:`ddpckpt.training.loader`), so passing it
    to a load tracks it before the loop.
    """
    from ddpckpt.training.loader import adopt_loaders

    adopt_loaders({"": obj})
    if not is_stateful(obj):
        return "value"
    per_rank = isinstance(obj, PerRank) or getattr(type(obj), "ddpckpt_per_rank", False)
    if per_rank or type(obj).__module__.startswith("torchdata.stateful_dataloader"):
        return "per_rank"
    return "stateful"


def _capture_extra(extra: Mapping[str, Any], snapshot: Snapshot) -> None:
    from ddpckpt.training.loader import check_data_extra

    check_data_extra(extra)
    section: dict[str, JSON] = {}
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"extra keys must be non-empty strings, got {name!r}")
        prefix = f"extra/{name}"
        kind = extra_kind(obj)
        if kind == "per_rank":
            section[name] = {"kind": kind, "type": type(obj).__qualname__}
            own = snapshot.rank_state.setdefault("extra", {})
            own[name] = encode(obj.state_dict(), prefix, snapshot.rank_tensors)
        elif kind == "stateful":
            section[name] = {
                "kind": "stateful",
                "type": type(obj).__qualname__,
                "state": encode(obj.state_dict(), prefix, snapshot.tensors),
            }
            if isinstance(obj, nn.Module):  # e.g. an EMA copy: its parameters are replicated
                names = (f"{prefix}/{k}" for k, _ in obj.named_parameters(remove_duplicate=False))
                snapshot.balanced.update(n for n in names if n in snapshot.tensors)
        elif isinstance(obj, torch.utils.data.Sampler):
            raise UnsupportedValueError(
                f"{prefix}: a {type(obj).__qualname__} has no position of its own to save: "
                "the DataLoader that iterates it knows what training consumed. Put that "
                "loader in extra instead (extra={'loader': loader}); ddpckpt saves and "
                "restores its position exactly"
            )
        else:
            section[name] = {"kind": "value", "state": encode(obj, prefix, snapshot.tensors)}
    snapshot.state["extra"] = section


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
    root, replication = _capture_model(model, snapshot)
    if optimizer is not None:
        before = set(snapshot.tensors)
        _capture_optimizer(optimizer, root, snapshot)
        _sort_optimizer_state(optimizer, set(snapshot.tensors) - before, replication, snapshot)
    if scheduler is not None:
        _capture_stateful("scheduler", scheduler, snapshot)
    if scaler is not None:
        _capture_stateful("scaler", scaler, snapshot)
    if extra:
        _capture_extra(extra, snapshot)
        modules = tuple(f"extra/{n}/" for n, obj in extra.items() if isinstance(obj, nn.Module))
        claimed = {n for n in snapshot.tensors if n.startswith(modules)} if modules else set()
        snapshot.balanced -= claimed  # e.g. an EMA copy: nothing keeps it identical on all ranks
        snapshot.unverified |= claimed
    if rng:
        snapshot.rank_state["rng"] = encode(capture_rng(), "rng", snapshot.rank_tensors)
    optimizers = [o for o in [optimizer, *(extra or {}).values()] if _is_optimizer(o)]
    _record_steppers(optimizers, snapshot)
    return snapshot


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _sort_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: set[str],
    replication: _Replication,
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
            for value in optimizer.state.get(param, {}).values():
                name = by_id.get(id(value))
                if name is None:
                    continue
                if id(param) in replication.synced:
                    synced.add(name)
                elif id(param) in replication.ignored:
                    snapshot.per_rank.add(name)
    snapshot.balanced -= names - synced
    snapshot.unverified |= names - synced - snapshot.per_rank


def _record_steppers(optimizers: list[torch.optim.Optimizer], snapshot: Snapshot) -> None:
    """Note which optimizers' ``step()`` writes which captured tensor: their parameters
    and their per-parameter state (moments, step counts)."""
    by_identity: dict[tuple[Any, ...], list[torch.optim.Optimizer]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {}).values()
                for tensor in [param, *(v for v in state if isinstance(v, torch.Tensor))]:
                    writers = by_identity.setdefault(_tensor_identity(tensor) or (), [])
                    if optimizer not in writers:
                        writers.append(optimizer)
    by_identity.pop((), None)
    for name, tensor in snapshot.tensors.items():
        writers = by_identity.get(_tensor_identity(tensor) or ())
        if writers:
            snapshot.stepped_by[name] = writers
