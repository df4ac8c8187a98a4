"""Import checkpoints written with ``torch.save`` by the usual recipes, without running them.

Understood layouts:

* a bare model ``state_dict``;
* a dict holding the model under ``model``/``state_dict``/``model_state_dict``/``net`` ...,
  and optionally ``optimizer``, ``scheduler``/``lr_scheduler``, ``scaler``, ``epoch``,
  ``step``/``global_step``/``iteration`` and anything else plain;
* a PyTorch Lightning ``.ckpt`` (``state_dict``, ``optimizer_states``, ``lr_schedulers``,
  ``epoch``, ``global_step``, precision-plugin scaler state, loops, callbacks ...);
* a ``torch.distributed.checkpoint`` (DCP) directory (:mod:`ddpckpt._convert.dcp`, which
  reads it without running its pickle), holding any of the above, such as
  ``{"model": ..., "optim": ...}`` of ``get_state_dict``, inside one wrapping entry or not,
  or torchtitan's layout (:mod:`ddpckpt._convert.torchtitan`);
* a DeepSpeed ZeRO checkpoint, stage 1, 2 or 3 (:mod:`ddpckpt._convert.deepspeed`), read as the model's
  fp32 master weights, the optimizer by parameter name, the scheduler and the step;
* a directory of safetensors weights (:mod:`ddpckpt._convert.safetensors_dir`): DCP's
  ``HuggingFaceStorageWriter``, ``save_pretrained``;
* a Hugging Face ``Trainer`` ``checkpoint-N`` or an Accelerate ``save_state`` directory
  (:mod:`ddpckpt._convert.hf`), written as the objects ddpckpt's integrations save, each
  process's random streams in that rank's file (:func:`~ddpckpt._io.planning.add_ranks`).

``module.`` (DDP/DataParallel) and ``_orig_mod.`` (torch.compile) prefixes are removed.
The file is read by :mod:`ddpckpt._convert.torchfile`: ``torch.load(weights_only=True)``
only, within limits; a pickle that names any other global is refused before it can run,
unless that global is a plain data class the user trusts.

Optimizer state in such files is keyed by position: it is stored that way and matched by
position (with shape checks) when loaded, as ``torch`` does. DCP's ``get_state_dict`` keys it
by parameter name: it is stored and matched by name, as ddpckpt's own checkpoints are.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ddpckpt._convert.dcp import is_dcp_directory, read_dcp
from ddpckpt._convert.deepspeed import is_deepspeed_checkpoint, read_deepspeed
from ddpckpt._convert.hf import (
    Source,
    is_accelerate_state,
    is_trainer_checkpoint,
    read_accelerate,
    read_trainer,
)
from ddpckpt._convert.safetensors_dir import is_safetensors_directory, read_safetensors_directory
from ddpckpt._convert.torchfile import read_torch_file
from ddpckpt._convert.torchtitan import from_torchtitan, is_torchtitan
from ddpckpt._coord.comm import Comm
from ddpckpt._format.codec import encode
from ddpckpt._format.manifest import MANIFEST_NAME
from ddpckpt._format.sections import (
    ExtraEntry,
    ModelSection,
    OptimizerSection,
    StatefulSection,
    StateSections,
)
from ddpckpt._format.statelayout import NAMED, SINGLE, Layout
from ddpckpt._io.planning import add_ranks, plan_write
from ddpckpt._io.writing import header_fields, write_and_commit
from ddpckpt._log import get_logger
from ddpckpt._state.capture import Snapshot
from ddpckpt._state.rng import numpy_key_as_tensor
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from ddpckpt.storage._location import locate

_log = get_logger(__name__)

_MODEL_KEYS = (
    "state_dict",
    "model",
    "model_state_dict",
    "model_state",
    "net",
    "network",
    "module",
    "weights",
)
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "opt")
_SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
_SCALER_KEYS = (
    "scaler",
    "grad_scaler",
    "scaler_state_dict",
    "amp_scaler",
    "MixedPrecision",
    "native_amp_scaling_state",
)
_STEP_KEYS = ("global_step", "step", "iteration", "iter", "steps")
_EPOCH_KEYS = ("epoch",)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _wrapper_prefixes(keys: list[str]) -> list[str]:
    """The ``module.``/``_orig_mod.`` prefixes every one of ``keys`` starts with, outermost
    first."""
    prefixes: list[str] = []
    changed = True
    while changed and keys:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in keys):
                keys = [k[len(prefix) :] for k in keys]
                prefixes.append(prefix)
                changed = True
    return prefixes


def _unwrapped_name(name: str, prefixes: list[str]) -> str:
    for prefix in prefixes:
        name = name.removeprefix(prefix)
    return name.replace("._orig_mod.", ".")


def _strip_wrappers(state: Mapping[str, Any], prefixes: list[str]) -> dict[str, Any]:
    """Drop the wrappers' ``prefixes`` and any nested ``._orig_mod.`` from every key."""
    keys = [_unwrapped_name(k, prefixes) for k in state]
    if len(set(keys)) != len(keys):
        raise CorruptCheckpointError("removing wrapper prefixes made two model keys equal")
    return dict(zip(keys, state.values(), strict=True))


def _pick(doc: dict[str, Any], names: Iterable[str]) -> tuple[str | None, Any]:
    for name in names:
        if name in doc:
            return name, doc[name]
    return None, None


def _is_state_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and any(isinstance(v, torch.Tensor) for v in value.values())
    )


def _model_section(
    weights: Mapping[str, Any], snapshot: Snapshot, name: str = "model", layout: Layout = SINGLE
) -> ModelSection:
    keys: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int | torch.SymInt, tuple[int, ...]], str] = {}
    extra_state: dict[str, Any] = {}
    for key, value in weights.items():
        if not isinstance(value, torch.Tensor):
            extra_state[key] = value
            continue
        identity = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if value.numel() and identity in seen:
            aliases[key] = seen[identity]
            continue
        seen[identity] = key
        keys.append(key)
        snapshot.tensors[f"{layout.model_prefix(name)}{key}"] = value
    section = ModelSection("imported", keys, aliases, {}, list(extra_state))
    if extra_state:
        section.extra_state = encode(extra_state, layout.model_extra_prefix(name), snapshot.tensors)
    return section


def _optimizer_section(
    optimizer: Mapping[str, Any], snapshot: Snapshot, where: str, prefixes: list[str],
    tensors: str = "optimizer", groups_rebuilt: bool = False,
) -> OptimizerSection:  # fmt: skip
    if not isinstance(optimizer, Mapping):
        raise CorruptCheckpointError(f"{where}: the optimizer entry is not an optimizer state_dict")
    groups_in, state_in = optimizer.get("param_groups"), optimizer.get("state")
    if not (
        isinstance(groups_in, list)
        and isinstance(state_in, Mapping)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups_in)
        and all(isinstance(p, (int, str)) for g in groups_in for p in g["params"])
    ):
        raise CorruptCheckpointError(f"{where}: the optimizer entry is not an optimizer state_dict")
    if not all(isinstance(v, Mapping) for v in state_in.values()):
        raise CorruptCheckpointError(f"{where}: the optimizer's state holds a non-dict entry")
    # get_state_dict (DCP) keys the state by parameter name: matched by name when loaded
    named = all(isinstance(p, str) for g in groups_in for p in g["params"])
    if not named and state_in and all(isinstance(k, str) and k.isdecimal() for k in state_in):
        state_in = {int(k): v for k, v in state_in.items()}  # DCP saved the keys as text
    claimed = [p for g in groups_in for p in g["params"]]
    if len(set(claimed)) != len(claimed):
        raise CorruptCheckpointError(f"{where}: the optimizer lists a parameter twice")
    unclaimed = set(state_in) - set(claimed)
    if unclaimed:
        raise CorruptCheckpointError(
            f"{where}: the optimizer holds state for {len(unclaimed)} parameter(s) no param "
            f"group lists (such as {sorted(map(str, unclaimed))[0][:100]!r})"
        )
    groups, state, shapes = [], {}, {}
    for g, group in enumerate(groups_in):
        names = (
            [_unwrapped_name(p, prefixes) for p in group["params"]]
            if named
            else [f"@group{g}.{i}" for i in range(len(group["params"]))]
        )
        for name, index in zip(names, group["params"], strict=True):
            per_param = state_in.get(index, {})
            if per_param:
                state[name] = per_param
            shaped = [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            shapes[name] = list(shaped[0].shape) if shaped else None
        groups.append({"params": names, "hyper": {k: v for k, v in group.items() if k != "params"}})
    section = {
        "type": "imported",
        "groups": groups,
        "state": state,
        "shapes": shapes,
        "by_position": not named,
        **({"groups_rebuilt": True} if groups_rebuilt and named else {}),
    }
    return OptimizerSection.from_json(encode(section, tensors, snapshot.tensors), where)


def _classify(
    obj: Any, where: str, model_key: str | None, groups_rebuilt: bool = False
) -> tuple[Snapshot, dict[str, Any], list[str]]:
    """Split a loaded legacy object into a snapshot, header fields and dropped keys."""
    snapshot, sections = Snapshot(), StateSections()
    header: dict[str, Any] = {"step": None, "epoch": None, "metrics": {}}
    if not isinstance(obj, Mapping):
        raise CorruptCheckpointError(f"{where}: holds a {type(obj).__qualname__}, not a dict")
    doc = dict(obj)
    lightning = "pytorch-lightning_version" in doc or "optimizer_states" in doc
    key: str | None
    if model_key is not None:
        if model_key not in doc:
            raise CorruptCheckpointError(
                f"{where}: has no entry {model_key!r} (has: {', '.join(map(str, doc))})"
            )
        key, weights = model_key, doc[model_key]
    else:
        key, weights = _pick(doc, _MODEL_KEYS)
        if key is None or not _is_state_dict(weights):
            if not _is_state_dict(doc):
                raise CorruptCheckpointError(
                    f"{where}: cannot tell which entry holds the model weights (top-level keys: "
                    f"{', '.join(map(str, doc))}); name it with --model-key"
                )
            key, weights = None, doc
    prefixes = _wrapper_prefixes(list(weights))
    sections.models["model"] = _model_section(_strip_wrappers(weights, prefixes), snapshot)
    if key is None:
        snapshot.state = sections.to_json()
        return snapshot, header, []
    del doc[key]
    if lightning and isinstance(doc.get("optimizer_states"), list) and doc["optimizer_states"]:
        states = doc.pop("optimizer_states")
        doc["optimizer"] = states[0]
        if len(states) > 1:
            doc["optimizer_states[1:]"] = states[1:]
    if lightning and isinstance(doc.get("lr_schedulers"), list) and doc["lr_schedulers"]:
        schedulers = doc.pop("lr_schedulers")
        doc["scheduler"] = schedulers[0]
        if len(schedulers) > 1:
            doc["lr_schedulers[1:]"] = schedulers[1:]
    name, optimizer = _pick(doc, _OPTIMIZER_KEYS)
    if name is not None and optimizer:
        sections.optimizers["optimizer"] = _optimizer_section(
            doc.pop(name), snapshot, where, prefixes, groups_rebuilt=groups_rebuilt
        )
    for kind, names in (("scheduler", _SCHEDULER_KEYS), ("scaler", _SCALER_KEYS)):
        name, value = _pick(doc, names)
        if name is not None and isinstance(value, Mapping) and value:
            state = encode(dict(doc.pop(name)), kind, snapshot.tensors)
            sections.place(f"{kind}s", kind, StatefulSection("imported", state))
    for field_name, keys in (("step", _STEP_KEYS), ("epoch", _EPOCH_KEYS)):
        name, value = _pick(doc, keys)
        if name is not None and type(value) is int and value >= 0:
            header[field_name] = doc.pop(name)
    dropped = []
    for name, value in doc.items():
        try:
            state = encode(value, f"extra/{name}", snapshot.tensors)
        except UnsupportedValueError as exc:
            dropped.append(f"{name} ({exc})")
            continue
        sections.extra[str(name)] = ExtraEntry("value", None, state)
    snapshot.state = sections.to_json()
    return snapshot, header, dropped


def _unwrapped(saved: dict[str, Any]) -> Any:
    """A DCP save's state inside one wrapping entry (the DCP tutorial's ``{"app": AppState}``):
    the entry's dict, while it holds no tensor of its own."""
    while (
        len(saved) == 1
        and isinstance(inner := next(iter(saved.values())), dict)
        and not _is_state_dict(inner)
    ):
        saved = inner
    return saved


def import_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    model_key: str | None = None,
    trusted_globals: Iterable[str] = (),
    trusted_source: bool = False,
    overwrite: bool = False,
) -> tuple[str, list[str]]:
    """Convert the ``torch.save`` file or DCP directory ``source`` into a ddpckpt checkpoint
    at ``destination``.

    Local (one process). Returns the checkpoint path and the top-level entries that were
    left out because they hold values that cannot be stored without pickle (each is also
    logged as a warning).
    """
    source, destination = os.fspath(source), os.fspath(destination)
    if not os.path.lexists(source):
        raise CheckpointNotFoundError(f"{source}: no such file or directory to import")
    if is_trainer_checkpoint(source) or is_accelerate_state(source):
        read = read_trainer if is_trainer_checkpoint(source) else read_accelerate
        found = read(source, trusted_source)
        snapshot, header, parts = _hf_snapshot(found, source)
        return _write(source, destination, snapshot, header, found.left_out, parts, overwrite)
    left_out: list[str] = []
    groups_rebuilt = False  # param groups rebuilt from each parameter's hyperparameters
    if os.path.isdir(source) and os.path.lexists(os.path.join(source, MANIFEST_NAME)):
        raise CorruptCheckpointError(
            f"{source}: a ddpckpt checkpoint already (it holds {MANIFEST_NAME}): load it with "
            "ddpckpt.load, no import needed"
        )
    if is_dcp_directory(source):
        obj = _unwrapped(read_dcp(source, trusted_globals, trusted_source))
        if model_key is None and is_torchtitan(obj):
            obj, left_out = from_torchtitan(obj, source)
            model_key, groups_rebuilt = "model", True
        beside = [k for k in _OPTIMIZER_KEYS if isinstance(obj.get(k), dict)]
        if model_key is None and _is_state_dict(obj) and beside:
            raise CorruptCheckpointError(
                f"{source}: the model's keys sit at the top level of the saved dict, beside "
                f"{beside[0]!r}, whose keys are not torchtitan's (state.<parameter>.<name>): "
                "load it with the code that wrote it, then save once with ddpckpt"
            )
    elif is_deepspeed_checkpoint(source):
        obj, left_out = read_deepspeed(source, trusted_globals, trusted_source)
        model_key = "model"
    elif is_safetensors_directory(source):
        obj, model_key = {"model": read_safetensors_directory(source)}, "model"
        left_out = [
            f"{n} (not read: the import takes the weights)"
            for n in sorted(os.listdir(source))
            if not n.endswith(".safetensors") and n != "model.safetensors.index.json"
        ]
    elif os.path.isdir(source):
        raise CorruptCheckpointError(
            f"{source}: a directory of no format `import` reads: a "
            "torch.distributed.checkpoint directory (.metadata), a Trainer checkpoint "
            "(trainer_state.json), an Accelerate save_state (random_states_0.pkl), a "
            "DeepSpeed ZeRO checkpoint (mp_rank_00_model_states.pt, or the 'latest' file "
            "naming it) or safetensors weights (*.safetensors); or a torch.save file, a "
            "Lightning .ckpt"
        )
    else:
        obj, _ = read_torch_file(source, trusted_globals, trusted_source)
    snapshot, header, dropped = _classify(obj, source, model_key, groups_rebuilt)
    return _write(source, destination, snapshot, header, left_out + dropped, [], overwrite)


def _write(
    source: str,
    destination: str,
    snapshot: Snapshot,
    header: dict[str, Any],
    dropped: list[str],
    parts: list[tuple[dict[str, Any], dict[str, torch.Tensor]]],
    overwrite: bool,
) -> tuple[str, list[str]]:
    """Write the checkpoint (``parts``: the per-rank state of ranks 1, 2, ...), after
    warning of what was left out."""
    for item in dropped:
        _log.warning("%s: left out of the import: %s", source, item)
    fields = header_fields(header["step"], header["epoch"], None)
    comm = Comm.local("ddpckpt.import", destination)
    plan = plan_write(
        comm, locate(destination), snapshot, fields, overwrite=overwrite, storage="shared"
    )
    add_ranks(plan, parts)
    return write_and_commit(plan), dropped


def _numbered_names(role: str, values: list[Any]) -> list[tuple[str, Any]]:
    """``role`` for one value, ``role0``, ``role1`` ... for several."""
    if len(values) == 1:
        return [(role, values[0])]
    return [(f"{role}{i}", value) for i, value in enumerate(values)]


def _hf_snapshot(
    found: Source, where: str
) -> tuple[Snapshot, dict[str, Any], list[tuple[dict[str, Any], dict[str, torch.Tensor]]]]:
    """The objects ddpckpt's integration of the source's framework saves (see
    :mod:`ddpckpt._convert.hf`): the snapshot (rank 0's per-rank state in it), the header,
    and the per-rank state of the other processes."""
    # Named as the integration names the prepared objects: "model", or "model0", "model1" ...
    # for several (ddpckpt.integrations.accelerate.training_state), in the named layout
    several = max(len(found.models), len(found.optimizers), len(found.schedulers)) > 1
    layout = NAMED if several else SINGLE
    snapshot, sections = Snapshot(), StateSections(layout)
    for name, weights in _numbered_names("model", found.models):
        # Accelerate saves the model of a DDP or compiled run with its wrappers' prefixes
        prefixes = _wrapper_prefixes(list(weights))
        sections.models[name] = _model_section(
            _strip_wrappers(weights, prefixes), snapshot, name, layout
        )
    for name, optimizer in _numbered_names("optimizer", found.optimizers):
        if optimizer:
            sections.optimizers[name] = _optimizer_section(
                optimizer, snapshot, where, [], layout.prefix("optimizers", name)
            )
    schedulers = _numbered_names("scheduler", found.schedulers)
    scalers = [] if found.scaler is None else [("scaler", found.scaler)]
    for (name, value), role in [*((s, "schedulers") for s in schedulers),
                                *((s, "scalers") for s in scalers)]:  # fmt: skip
        if not isinstance(value, Mapping):
            raise CorruptCheckpointError(f"{where}: the {name}'s file holds no state_dict")
        state = encode(dict(value), layout.prefix(role, name), snapshot.tensors)
        sections.place(role, name, StatefulSection("imported", state))
    for name, text in (("trainer_state", found.trainer_state), ("config", found.config)):
        if text is not None:
            sections.extra[name] = ExtraEntry("value", None, encode(text, f"extra/{name}", {}))
    for i, custom in enumerate(found.custom):
        state = encode(custom, f"extra/custom{i}", snapshot.tensors)
        sections.extra[f"custom{i}"] = ExtraEntry("stateful", None, state)
    if found.kind == "accelerate":  # older Accelerate saved no step counter: it starts at 0
        state = encode({"step": found.accelerator_step or 0}, "extra/accelerator_step", {})
        sections.extra["accelerator_step"] = ExtraEntry("stateful", "_StepCounter", state)
    ranks = []
    for streams in found.streams:
        tensors: dict[str, torch.Tensor] = {}
        if found.kind == "trainer":  # DdpckptTrainer's per-process run state
            run = {"rng": numpy_key_as_tensor(streams), "tr_loss": torch.tensor(0.0),
                   "total_loss": 0.0, "last_logged": found.step, "flos": 0.0}  # fmt: skip
            ranks.append(({"extra": {"run": encode(run, "extra/run", tensors)}}, tensors))
        else:
            ranks.append(({"rng": encode(streams, "rng", tensors)}, tensors))
    if found.kind == "trainer" and ranks:
        sections.extra["run"] = ExtraEntry("per_rank", "_PerRankRun")
    if ranks:
        snapshot.rank_state, snapshot.rank_tensors = ranks[0][0], ranks[0][1]
    snapshot.state = sections.to_json()
    header = {"step": found.step, "epoch": None}
    return snapshot, header, ranks[1:]
