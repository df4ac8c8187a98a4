"""A model's part of a checkpoint: canonical keys, tied weights, what DDP keeps replicated.

The model is unwrapped from ``DistributedDataParallel``, ``DataParallel`` and
``torch.compile`` at any depth; keys are canonical (no ``module.`` or ``_orig_mod.``).
Tied weights are stored once and recorded as aliases. Each tensor is sorted by what keeps
it identical on every rank (see :class:`~ddpckpt._state.snapshot.Snapshot`): parameters DDP
synchronizes, parameters and buffers it ignores, tensors nothing keeps identical.
Loading goes through the module's own ``load_state_dict`` (so its hooks run) after a
strict key/shape check that reports every difference at once.

Every function here is local to the calling rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpckpt._format.codec import JSON, decode, encode
from ddpckpt._format.pinned_ring import passes_through
from ddpckpt._format.sections import ModelSection
from ddpckpt._format.statelayout import SINGLE, Layout
from ddpckpt._log import get_logger
from ddpckpt._state.dtensor import is_dtensor, live_region, local_tensor, restore_dtensor
from ddpckpt._state.snapshot import Snapshot, TensorSource, restoring
from ddpckpt._training.wrappers import dtensor_wrapper, inner_attr, unwrap_model, user_class
from ddpckpt.errors import CorruptCheckpointError, StateMismatchError

if TYPE_CHECKING:
    from ddpckpt._format.reshard import Box

_log = get_logger(__name__)
_LIST_LIMIT = 12


def canonical_key(root: nn.Module, key: str, *, is_module_path: bool = False) -> str:
    """``key`` without the path segments that only step through wrapper modules."""
    parts = key.split(".") if key else []
    module_parts = parts if is_module_path else parts[:-1]
    kept: list[str] = []
    module: nn.Module | None = root
    for part in module_parts:
        if module is not None and inner_attr(module) == part:
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
    """``model``'s live state dict (``keep_vars``) under canonical keys, and module versions."""
    root = unwrap_model(model)
    live = root.state_dict(keep_vars=True)
    entries: dict[str, Any] = {}
    live_key: dict[str, str] = {}
    for key, value in live.items():
        name = canonical_key(root, key)
        entries[name] = value
        live_key[name] = key
    versions: dict[str, int] = {}
    for prefix, meta in getattr(live, "_metadata", {}).items():
        if isinstance(meta, dict) and isinstance(meta.get("version"), int):
            versions[canonical_key(root, prefix, is_module_path=True)] = meta["version"]
    return ModelView(root, entries, live_key, versions)


def canonical_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with canonical keys (no wrapper prefixes), live tensors."""
    return model_view(model).entries


def tensor_identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same memory (tied weights); ``None`` for an empty one.

    A DTensor is identified by its local shard.
    """
    tensor = local_tensor(tensor)
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
class Replication:
    """What the DDP wrappers around a model keep identical on every rank (by tensor id)."""

    wrapped: bool = False
    synced: set[int] = field(default_factory=set)  # parameters DDP broadcasts and all-reduces
    ignored: set[int] = field(default_factory=set)  # parameters and buffers DDP leaves alone
    rank_buffers: bool = False  # broadcast_buffers=False: each rank keeps its own buffers


def _replication(model: nn.Module) -> Replication:
    """Which of ``model``'s tensors DDP keeps replicated, from every DDP wrapper around it.

    DDP synchronizes a parameter unless its name is in ``parameters_to_ignore`` (set by
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``); parameters
    it all-reduces late (``delay_all_reduce_named_params``) are listed there too, but are
    synchronized.
    """
    found = Replication()
    while (attr := inner_attr(model)) is not None:
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


@dataclass
class CapturedModel:
    """What capturing one model adds besides its tensors (see :func:`capture_model`)."""

    section: ModelSection
    root: nn.Module  # the unwrapped module, which names the parameters
    replication: Replication  # what DDP keeps replicated (the optimizer's state follows it)
    rank_buffers: JSON | None  # this rank's own buffers under broadcast_buffers=False


def capture_model(
    model: nn.Module, snapshot: Snapshot, name: str = "model", layout: Layout = SINGLE
) -> CapturedModel:
    """Add the tensors of ``model`` (called ``name``) to ``snapshot``; returns its section.

    Tensors are sorted by what keeps them identical on every rank (see
    :class:`~ddpckpt._state.snapshot.Snapshot`) and named as ``layout`` says.
    """
    prefix = layout.model_prefix(name)
    view = model_view(model)
    replication = _replication(model)
    parameters = {id(p) for p in view.root.parameters()}
    wrapper = dtensor_wrapper(view.root)
    keys: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    extra_state: dict[str, Any] = {}
    for key, value in view.entries.items():
        if not isinstance(value, torch.Tensor):
            extra_state[key] = value
            continue
        identity = tensor_identity(value)
        if identity is not None and identity in seen:
            aliases[key] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = key
        keys.append(key)
        stored = prefix + key
        snapshot.tensors[stored] = value.detach()
        if id(value) in replication.ignored:
            snapshot.per_rank.add(stored)
        elif id(value) in replication.synced:
            snapshot.balanced.add(stored)
        elif id(value) in parameters or not replication.wrapped:
            snapshot.unverified.add(stored)  # no DDP keeps it identical: compared before writing
            if wrapper is not None:
                snapshot.unsynced[stored] = wrapper
    rank_buffers = None
    if replication.rank_buffers:
        elsewhere = snapshot.balanced | snapshot.per_rank | snapshot.unverified
        buffers = {
            key: snapshot.tensors[prefix + key] for key in keys if prefix + key not in elsewhere
        }
        rank_buffers = encode(buffers, layout.buffers_prefix(name), snapshot.rank_tensors)
    section = ModelSection(user_class(view.root).__qualname__, keys, aliases, view.versions,
                           list(extra_state), wrapped_by=wrapper)  # fmt: skip
    if extra_state:
        prefix = layout.model_extra_prefix(name)
        section.extra_state = encode(extra_state, prefix, snapshot.tensors)
    return CapturedModel(section, view.root, replication, rank_buffers)


def _limited(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    more = len(items) - _LIST_LIMIT
    return shown + (f", ... and {more} more" if more > 0 else "")


def mismatch_report(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    """Indented lines listing what is missing, unexpected and misshapen (each list cut short)."""
    lines = []
    if missing:
        lines.append(f"  missing from the checkpoint ({len(missing)}): {_limited(missing)}")
    if unexpected:
        lines.append(f"  unexpected in the checkpoint ({len(unexpected)}): {_limited(unexpected)}")
    if shapes:
        lines.append(f"  shape mismatch ({len(shapes)}): {_limited(shapes)}")
    return "\n".join(lines)


def check_model(
    model: nn.Module,
    section: ModelSection,
    source: TensorSource,
    where: str,
    strict: bool,
    prefix: str = "model/",
    label: str = "the model",
) -> None:
    """Compare the checkpoint's model keys and shapes with the live model's (reads nothing).

    With ``strict`` any difference raises :class:`StateMismatchError` listing all of
    them; otherwise the differences are logged as a warning and skipped on load.
    """
    live = model_view(model).entries
    shapes = {
        key: source.meta(prefix + key, read_region(live.get(key), key))[1] for key in section.keys
    }
    stored = [*section.keys, *section.aliases, *section.extra_keys]
    # a key the checkpoint lacks but the live model ties to one it holds (the same parameter
    # object: a tied embedding saved once, as save_pretrained does) is loaded with it
    held = {id(live[k]) for k in stored if isinstance(live.get(k), torch.Tensor)}
    missing = [k for k in live if k not in set(stored) and id(live[k]) not in held]
    unexpected = [k for k in stored if k not in live]
    wrong = [
        f"{key}: checkpoint {list(shapes[key])}, model {list(live[key].shape)}"
        for key in section.keys
        if isinstance(live.get(key), torch.Tensor) and tuple(live[key].shape) != shapes[key]
    ]
    if not (missing or unexpected or wrong):
        return
    report = mismatch_report(missing, unexpected, wrong)
    if strict:
        raise StateMismatchError(
            f"{where}: checkpoint does not match {label} "
            f"({type(unwrap_model(model)).__qualname__}):\n{report}\n"
            "Keys are compared without 'module.'/'_orig_mod.' wrapper prefixes. "
            "Pass strict=False to load only the matching keys."
        )
    _log.warning(
        "%s: loading %s with strict=False; skipping what does not match:\n%s", where, label, report
    )


def read_region(value: Any, name: str) -> Box | None:
    """What a load will read of the stored ``name`` into the live ``value``: a DTensor's own
    region, a plain tensor's whole (``None`` for anything else)."""
    if not isinstance(value, torch.Tensor):
        return None
    if is_dtensor(value):
        return live_region(value, name)
    return (0,) * value.dim(), tuple(value.shape)


def restore_model(
    model: nn.Module,
    section: ModelSection,
    source: TensorSource,
    where: str,
    strict: bool,
    prefix: str = "model/",
) -> None:
    """Load the weights into ``model`` through its own ``load_state_dict`` (hooks run).

    Call :func:`check_model` first; with ``strict=False`` mismatched keys are skipped.
    A tensor is read straight into the live one (on a GPU through two small pinned
    buffers), so a load holds no second copy of the weights, then handed to
    ``load_state_dict`` as its own value; a model whose load hooks must see the incoming
    value apart from the current one (a ``load_state_dict`` pre-hook, or a
    ``_load_from_state_dict`` of its own) gets it in a separate GPU tensor or a view of the
    mapped file instead. A checksum failure while reading in place leaves the model partly
    updated (see :func:`ddpckpt._io.load.load`).
    A DTensor (FSDP2, ``replicate()``) is filled in place, its local shard only.
    """
    view = model_view(model)  # a sharded model's state dict hooks put its shards in place
    in_place = not _compares_incoming(view.root)
    state: dict[str, Any] = {}
    sharded: set[str] = set()
    for key in section.keys:
        target = view.entries.get(key)
        name = prefix + key
        if is_dtensor(target) and tuple(target.shape) == source.meta(name)[1]:
            restore_dtensor(target, name, source)
            sharded.add(view.live_key[key])
        elif isinstance(target, torch.Tensor) and tuple(target.shape) == source.meta(name)[1]:
            # Read straight into the live tensor (a GPU one through pinned buffers, pipelined);
            # for modules whose hooks compare, a GPU copy goes to a buffer of its own and a
            # CPU one is mapped, then copied by load_state_dict.
            like = None
            if in_place:
                like = target.detach()
            elif passes_through(target):
                like = torch.empty_like(target)
            got = source.get(name, like=like)
            # Read into the live tensor: it is its own value, nothing left to copy.
            state[view.live_key[key]] = target if in_place and got is like else got
    for alias, key in section.aliases.items():
        if alias in view.live_key and key in view.live_key and view.live_key[key] in state:
            state[view.live_key[alias]] = state[view.live_key[key]]
    _add_live_ties(view, section, state, sharded)
    if section.extra_state is not None:
        extra = decode(section.extra_state, lambda n: source.get(n).clone(), where=where)
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{where}: the model's extra state is no dict")
        state.update({view.live_key[k]: v for k, v in extra.items() if k in view.live_key})
    root = view.root
    loaded = _with_versions(state, root, section.versions)
    with restoring(f"{type(root).__qualname__}.load_state_dict", where):
        if not sharded:
            root.load_state_dict(loaded, strict=strict)
            return
        result = root.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if k not in sharded]
    if strict and (missing or result.unexpected_keys):
        raise StateMismatchError(
            f"{where}: the model refused keys while loading: missing {missing}, unexpected "
            f"{result.unexpected_keys}"
        )


def _add_live_ties(
    view: ModelView, section: ModelSection, state: dict[str, Any], sharded: set[str]
) -> None:
    """Give each live key the checkpoint lacks, but the live model ties to a key it loaded
    (the same parameter object: a tied embedding stored once, as ``save_pretrained`` stores
    it), that key's value; a tie to a sharded tensor filled in place is filled with it."""
    loaded: dict[int, str] = {}
    for key in section.keys:
        target = view.entries.get(key)
        if isinstance(target, torch.Tensor):
            loaded.setdefault(id(target), view.live_key[key])
    for key, target in view.entries.items():
        live, tied = view.live_key[key], loaded.get(id(target))
        if tied is None or tied == live or live in state or live in sharded:
            continue
        if tied in state:
            state[live] = state[tied]
        elif tied in sharded:
            sharded.add(live)


def _compares_incoming(root: nn.Module) -> bool:
    """Whether a module of ``root`` may look at an incoming value next to the current one
    while loading: it has a ``load_state_dict`` pre-hook, or a ``_load_from_state_dict``
    that is not torch's own."""
    for module in root.modules():
        if module._load_state_dict_pre_hooks:
            return True
        loader = type(module)._load_from_state_dict
        if not getattr(loader, "__module__", "").startswith("torch."):
            return True
    return False


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
        if (canonical := canonical_key(root, prefix, is_module_path=True)) in versions
    )
    return ordered
