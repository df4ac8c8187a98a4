"""Reading a Hugging Face ``Trainer`` ``checkpoint-N`` directory or an Accelerate
``save_state`` directory without running their pickles.

Both hold the model as safetensors (read with the bounded header parser of
:mod:`ddpckpt._format.tensorfile`; no pickle at all) or as ``pytorch_model.bin``, and the
optimizer, scheduler, scaler and each process's random streams as ``torch.save`` files, read
by :mod:`ddpckpt._convert.torchfile` (torch's weights-only unpickler, within limits; the
random streams hold numpy arrays, allowed as numbers only). Every file must be a regular
file of the directory, never a link. What the importer cannot store without pickle
(``training_args.bin``, a pickled sampler) is named as left out.

The result maps onto the objects ddpckpt's own integrations save, so that
:class:`~ddpckpt.integrations.transformers.DdpckptTrainer` and
:func:`~ddpckpt.integrations.accelerate.load_state` resume it as one of theirs: every
process's random streams as that process's own (one file per process).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._convert.torchfile import read_torch_file
from ddpckpt._format.boundary import load_json
from ddpckpt._format.tensorfile import dtype_from_name, read_header
from ddpckpt._log import get_logger
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._posix import open_regular

TRAINER_STATE = "trainer_state.json"
MAX_JSON_BYTES = 64 << 20  # trainer_state.json, config.json, a weights index
_log = get_logger(__name__)
_TRAINER_RNG = re.compile(r"rng_state(?:_(\d{1,6}))?\.pth")
_ACCELERATE_RNG = re.compile(r"random_states_(\d{1,6})\.pkl")
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


@dataclass
class Source:
    """What one directory held, read: its model weights and the ``torch.save`` documents
    by role, each process's random streams (in :func:`ddpckpt._state.rng.capture_rng`'s
    form) in process order, and what was left out, with why."""

    kind: str  # "trainer" or "accelerate"
    models: list[dict[str, torch.Tensor]]  # one, or Accelerate's prepared models in order
    optimizers: list[Any] = field(default_factory=list)  # in the order they were prepared
    schedulers: list[Any] = field(default_factory=list)
    scaler: Any = None
    streams: list[dict[str, Any]] = field(default_factory=list)
    step: int | None = None
    trainer_state: str | None = None  # the Trainer's, as its JSON text
    config: str | None = None  # the model's config.json, as its JSON text
    accelerator_step: int | None = None
    custom: list[Any] = field(default_factory=list)  # Accelerate's registered objects
    left_out: list[str] = field(default_factory=list)


def is_trainer_checkpoint(path: str) -> bool:
    """Whether ``path`` is a directory the ``Trainer`` saved (it holds ``trainer_state.json``)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, TRAINER_STATE))


def is_accelerate_state(path: str) -> bool:
    """Whether ``path`` is a directory ``Accelerator.save_state`` wrote (it holds
    ``random_states_<process>.pkl``, which every process writes)."""
    return os.path.isdir(path) and any(_ACCELERATE_RNG.fullmatch(n) for n in os.listdir(path))


def read_trainer(directory: str, trusted_source: bool = False) -> Source:
    """The ``checkpoint-N`` directory of a ``transformers.Trainer``; local."""
    names = set(os.listdir(directory))
    state_text = _json_text(directory, TRAINER_STATE)
    state = load_json(state_text, _at(directory, TRAINER_STATE), "trainer state",
                      limit=MAX_JSON_BYTES)  # fmt: skip
    step = state.get("global_step") if isinstance(state, dict) else None
    if type(step) is not int or step < 0:
        raise CorruptCheckpointError(
            f"{_at(directory, TRAINER_STATE)}: global_step is {step!r:.40}, not a step count"
        )
    source = Source("trainer", [_weights(directory, "model", names)], step=step,
                    trainer_state=state_text)  # fmt: skip
    if "config.json" in names:
        config = load_json(_json_text(directory, "config.json"), _at(directory, "config.json"),
                           "model config", limit=MAX_JSON_BYTES)  # fmt: skip
        if not isinstance(config, dict):
            raise CorruptCheckpointError(f"{_at(directory, 'config.json')}: not a JSON object")
        source.config = json.dumps(config)
    _read_states(source, directory, names, "pt", trusted_source)
    ranks = _numbered(names, _TRAINER_RNG)
    for _, name in ranks:
        raw = _torch(directory, name, trusted_source, arrays=True)
        source.streams.append(_trainer_streams(raw, _at(directory, name), source.left_out))
    if not ranks:
        source.left_out.append(
            "random streams (the directory holds no rng_state*.pth): DdpckptTrainer cannot "
            "resume from this checkpoint; ddpckpt.load restores its model, optimizer and "
            "scheduler"
        )
    source.left_out += _unread(names, _TRAINER_KNOWN, ranks, "Trainer")
    return source


def read_accelerate(directory: str, trusted_source: bool = False) -> Source:
    """The directory ``Accelerator.save_state`` wrote; local."""
    names = set(os.listdir(directory))
    more = _more_models(directory, names)
    source = Source("accelerate", [_weights(directory, "model", names, accelerate=True)])
    source.models += [_weights(directory, f"model_{i}", names, accelerate=True) for i in more]
    _read_states(source, directory, names, "bin", trusted_source)
    ranks = _numbered(names, _ACCELERATE_RNG)
    for rank, name in ranks:
        raw = _torch(directory, name, trusted_source, arrays=True)
        where = _at(directory, name)
        source.streams.append(_accelerate_streams(raw, where, source.left_out))
        if rank == 0 and isinstance(raw, dict) and type(raw.get("step")) is int:
            source.accelerator_step = raw["step"]
    customs = _numbered(names, re.compile(r"custom_checkpoint_(\d{1,6})\.pkl"))
    for _, name in customs:
        source.custom.append(_torch(directory, name, trusted_source))
    taken = {name for i in more for name in (f"model_{i}.safetensors", f"pytorch_model_{i}.bin")}
    taken |= {f"{role}_{i}.bin" for role in ("optimizer", "scheduler") for i in range(1, 1 << 10)
              if f"{role}_{i}.bin" in names}  # fmt: skip
    source.left_out += _unread(names, _ACCELERATE_KNOWN | taken, ranks + customs, "Accelerate")
    return source


def _more_models(directory: str, names: set[str]) -> list[int]:
    """The numbers 1, 2, ... of the models after the first in an Accelerate ``save_state``
    (``model_1.safetensors`` or ``pytorch_model_1.bin`` ...), without a gap."""
    numbers = sorted(
        int(m.group(1))
        for n in names
        if (m := re.fullmatch(r"(?:model|pytorch_model)_([1-9]\d{0,5})\.(?:safetensors|bin)", n))
    )
    if numbers != list(range(1, len(numbers) + 1)):
        raise CorruptCheckpointError(
            f"{directory}: the models after the first are numbered {numbers[:20]}, not 1, 2, "
            "... without a gap (one weight file each): some are missing or doubled"
        )
    return numbers


# ---------------------------------------------------------------- files of the directory

_TRAINER_KNOWN = frozenset({
    TRAINER_STATE, "config.json", "model.safetensors",
    "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "optimizer.pt", "scheduler.pt", "scaler.pt",
})  # fmt: skip
_ACCELERATE_KNOWN = frozenset({
    "model.safetensors", "pytorch_model.bin", "optimizer.bin", "scheduler.bin", "scaler.pt",
})  # fmt: skip
_WHY_LEFT_OUT = {
    "training_args.bin": "the Trainer's TrainingArguments, a pickle of its classes; the "
    "resumed run takes the arguments its script gives",
    "sampler.bin": "a pickled sampler object",
    "dl_state_dict.bin": "a stateful DataLoader's position, which ddpckpt's loader does "
    "not take; the resumed loader starts its epoch at the beginning",
}
_WHY_LEFT_OUT_NUMBERED = {  # Accelerate's second, third ... DataLoader's
    re.compile(r"sampler_\d{1,6}\.bin"): _WHY_LEFT_OUT["sampler.bin"],
    re.compile(r"dl_state_dict_\d{1,6}\.bin"): _WHY_LEFT_OUT["dl_state_dict.bin"],
}
# What save_pretrained writes beside the weights: not needed to resume the run
_FOR_FROM_PRETRAINED = frozenset({
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
})  # fmt: skip
# Layouts of the Trainer's checkpoints not imported yet, by a file or directory each holds
_NOT_YET = {
    "pytorch_model.bin.index.json": "a model sharded into pytorch_model-*.bin files",
    "adapter_model.safetensors": "a PEFT adapter",
    "adapter_model.bin": "a PEFT adapter",
    "pytorch_model_fsdp_0": "a checkpoint of the Trainer's FSDP integration",
}


def _at(directory: str, name: str) -> str:
    return os.path.join(directory, name)


def _regular(directory: str, name: str) -> str:
    """The path of ``name`` in ``directory``, a regular file and no link."""
    os.close(_opened(directory, name))
    return _at(directory, name)


def _opened(directory: str, name: str) -> int:
    """A descriptor of ``name`` in ``directory``, a regular file and no link."""
    path = _at(directory, name)
    try:
        return open_regular(path)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(
            f"{path}: {exc.kind}, not a file the checkpoint wrote; refused"
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _json_text(directory: str, name: str) -> str:
    path = _at(directory, name)
    with os.fdopen(_opened(directory, name), "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{path}: over {MAX_JSON_BYTES} bytes; refused")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{path}: not UTF-8 text") from None


def _read_states(
    source: Source, directory: str, names: set[str], suffix: str, trusted_source: bool
) -> None:
    """The optimizer's and scheduler's ``torch.save`` files (``optimizer.<suffix>``, the
    Trainer's ``pt``, Accelerate's ``bin``) and the scaler's ``scaler.pt``, where present."""
    for role, found in (("optimizer", source.optimizers), ("scheduler", source.schedulers)):
        # Accelerate's second, third ... as optimizer_1.bin, optimizer_2.bin ...
        files = [f"{role}.{suffix}", *(f"{role}_{i}.{suffix}" for i in range(1, 1 << 10))]
        for name in itertools.takewhile(names.__contains__, files):
            found.append(_torch(directory, name, trusted_source))
        beyond = sorted(n for n in names if re.fullmatch(rf"{role}_\d+\.{suffix}", n))
        if len(beyond) > max(0, len(found) - 1):
            raise CorruptCheckpointError(
                f"{directory}: {', '.join(beyond)[:300]} without every {role} file before "
                "them: some are missing"
            )
    if "scaler.pt" in names:
        source.scaler = _torch(directory, "scaler.pt", trusted_source)
    if f"optimizer.{suffix}" not in names:
        _log.warning(
            "%s holds no optimizer.%s (the Trainer's save_only_model saves none; otherwise a "
            "file was lost): the imported checkpoint has no optimizer state, so a resume that "
            "restores an optimizer refuses it; ddpckpt.load restores the model alone",
            directory,
            suffix,
        )


def _torch(directory: str, name: str, trusted_source: bool, *, arrays: bool = False) -> Any:
    return read_torch_file(_regular(directory, name), (), trusted_source, arrays=arrays)[0]


def _numbered(names: Iterable[str], pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """The files named by ``pattern`` (one number each: a process, an object), in number
    order; the numbers must run 0, 1, ... without a gap."""
    found = sorted((int(m.group(1) or 0), n) for n in names if (m := pattern.fullmatch(n)))
    numbers = [number for number, _ in found]
    for (number, first), (again, second) in itertools.pairwise(found):
        if number == again:
            raise CorruptCheckpointError(
                f"{first} and {second} both hold the state of process {number}: which one "
                "is meant cannot be told; remove the stale one"
            )
    if numbers != list(range(len(numbers))):
        raise CorruptCheckpointError(
            f"the files {', '.join(n for _, n in found)[:300]} are not numbered 0, 1, ... "
            "without a gap: some are missing"
        )
    return found


def _unread(
    names: set[str], known: frozenset[str], numbered: list[tuple[int, str]], writer: str
) -> list[str]:
    """The files of the directory this import does not take, each with why."""
    taken = known | {n for _, n in numbered}
    out = []
    for name in sorted(names - taken):
        if _SHARD_NAME.fullmatch(name) and name.endswith(".safetensors") and "-of-" in name:
            continue  # a shard of the model's weights, read through its index
        if name in _FOR_FROM_PRETRAINED:
            why = "written for from_pretrained, not needed to resume; it stays in the source"
        else:
            matched = (w for p, w in _WHY_LEFT_OUT_NUMBERED.items() if p.fullmatch(name))
            why = _WHY_LEFT_OUT.get(name) or next(
                matched, f"a file {writer} does not write, not understood"
            )
        out.append(f"{name} ({why})")
    return out


def _weights(
    directory: str, stem: str, names: set[str], accelerate: bool = False
) -> dict[str, torch.Tensor]:
    """The model's weights: ``model.safetensors``, a sharded one through its index, or
    ``pytorch_model.bin``."""
    for marker, what in _NOT_YET.items():
        if marker in names:
            raise CorruptCheckpointError(
                f"{_at(directory, marker)}: {what}, not imported yet; load it with the "
                "Trainer, then save once with DdpckptTrainer"
            )
    steps = sorted(
        (n for n in names if n.startswith("global_step")), key=lambda n: (len(n), n)
    )  # fmt: skip (global_step9 before global_step10)
    if steps:
        raise CorruptCheckpointError(
            f"{directory}: a checkpoint of the Trainer's DeepSpeed integration: import the "
            f"DeepSpeed checkpoint inside it (ddpckpt import {_at(directory, steps[-1])} OUT) "
            "for the model, optimizer and scheduler; the Trainer's own state (its step "
            "counter, random streams) does not carry over that way: load it with the Trainer, "
            "then save once with DdpckptTrainer, to keep it"
        )
    if f"{stem}.safetensors" in names:
        return read_safetensors(_regular(directory, f"{stem}.safetensors"))
    index = f"{stem}.safetensors.index.json"
    if index in names and not accelerate:
        weights: dict[str, torch.Tensor] = {}
        for shard, keys in _index(directory, index).items():
            tensors = read_safetensors(_regular(directory, shard))
            missing = sorted(keys - tensors.keys())
            if missing:
                raise CorruptCheckpointError(
                    f"{_at(directory, index)}: names {missing[0][:200]!r} in {shard}, which "
                    "does not hold it"
                )
            weights.update((k, tensors[k]) for k in sorted(keys))
        return weights
    pickled = f"pytorch_{stem}.bin"  # pytorch_model.bin; Accelerate's pytorch_model_1.bin ...
    if pickled in names:
        weights = _torch(directory, pickled, False)
        if not isinstance(weights, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
        ):
            raise CorruptCheckpointError(f"{_at(directory, pickled)}: not a model state_dict")
        return dict(weights)
    raise CorruptCheckpointError(
        f"{directory}: holds no model weights ({stem}.safetensors, its index, or {pickled})"
    )


def _index(directory: str, name: str) -> dict[str, set[str]]:
    """The shards a ``*.safetensors.index.json`` names and the keys of each."""
    where = _at(directory, name)
    doc = load_json(_json_text(directory, name), where, "weights index", limit=MAX_JSON_BYTES)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{where}: no weight_map of tensor names to files")
    shards: dict[str, set[str]] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard):
            raise CorruptCheckpointError(
                f"{where}: {key[:200]!r} lies in {shard!r:.200}, not a file of this directory"
            )
        shards.setdefault(shard, set()).add(key)
    return shards


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (a regular file), as CPU tensors, its
    header parsed within ddpckpt's bounds (no record outside the file, none overlapping)."""
    return safetensors_file(path)[0]


def safetensors_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`read_safetensors`, and the header's ``__metadata__`` strings."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        header = read_header(read, size, path, os.path.basename(path))
        tensors = {}
        for entry in header.entries:
            dtype = dtype_from_name(entry.dtype, path)
            raw = bytearray(entry.end - entry.begin)
            f.seek(entry.begin)
            if f.readinto(raw) != len(raw):
                raise CorruptCheckpointError(f"{path}: ends inside tensor {entry.key[:200]!r}")
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[entry.key] = flat.view(dtype).reshape(entry.shape)
    return tensors, dict(header.metadata)


# ---------------------------------------------------------------- random streams


def _trainer_streams(raw: Any, where: str, left_out: list[str]) -> dict[str, Any]:
    """A Trainer's ``rng_state*.pth``: ``python``, ``numpy``, ``cpu``, ``cuda``."""
    return _streams(raw, where, left_out, python="python", numpy="numpy", cpu="cpu",
                    cuda="cuda")  # fmt: skip


def _accelerate_streams(raw: Any, where: str, left_out: list[str]) -> dict[str, Any]:
    """Accelerate's ``random_states_<process>.pkl``."""
    return _streams(raw, where, left_out, python="random_state", numpy="numpy_random_seed",
                    cpu="torch_manual_seed", cuda="torch_cuda_manual_seed", plain=("step",))  # fmt: skip


def _streams(
    raw: Any, where: str, left_out: list[str], *, python: str, numpy: str, cpu: str,
    cuda: str, plain: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """One process's saved random streams as :func:`ddpckpt._state.rng.capture_rng` holds
    them, each checked by giving it to a generator of its kind."""
    if not isinstance(raw, dict) or python not in raw or cpu not in raw:
        raise CorruptCheckpointError(f"{where}: not the random streams it should hold")
    state: dict[str, Any] = {}
    try:
        random.Random().setstate(raw[python])
        state["python"] = raw[python]
        state["torch"] = _torch_state(raw[cpu])
        if numpy in raw:
            import numpy as np

            legacy = np.random.RandomState()
            legacy.set_state(raw[numpy])
            state["numpy"] = legacy.get_state(legacy=False)
        if cuda in raw:
            devices = raw[cuda] if isinstance(raw[cuda], (list, tuple)) else [raw[cuda]]
            state["cuda"] = [_cuda_state(d) for d in devices]
    except (TypeError, ValueError, RuntimeError, OverflowError, KeyError, IndexError) as exc:
        raise CorruptCheckpointError(
            f"{where}: a random stream no generator takes ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    for key in sorted(set(raw) - {python, numpy, cpu, cuda, *plain}, key=str):
        left_out.append(f"{os.path.basename(where)}[{str(key)[:80]!r}] (the random stream of "
                        "a device ddpckpt does not restore)")  # fmt: skip
    return state


def _torch_state(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError("torch's generator state is not a 1-D uint8 tensor")
    state = value.clone()
    torch.Generator().set_state(state)
    return state


def _cuda_state(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.shape != (16,):
        raise TypeError("a CUDA generator state is not 16 bytes (seed and offset)")
    return value.clone()
