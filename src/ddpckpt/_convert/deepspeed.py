"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2, 3) without DeepSpeed or its pickles.

A tag directory of ``engine.save_checkpoint`` (or its parent, whose ``latest`` names the
tag) holds ``mp_rank_00_model_states.pt`` (the model in its training precision, the
parameters' names and shapes in the optimizer's flat order, the scheduler, the step) and
one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R (that
rank's slice of every parameter group's fp32 master weights, flattened, and of the
optimizer's moments). This module reads and checks the files; the weights and moments are
put back together by :mod:`ddpckpt._convert.zero_merge`, as DeepSpeed's own
``zero_to_fp32.py`` does, into the ``torch.save`` recipe :mod:`ddpckpt._convert.legacy`
imports: the model (fp32 masters), the optimizer keyed by name, the scheduler and the step.

The files pickle four DeepSpeed classes (the loss scaler, the ZeRO stage enum, a slice
address); each is read as an inert record of this module (DeepSpeed is never imported, and
no code of the file runs: torch's weights-only unpickler builds only these records,
tensors and plain values). ZeRO-3 (``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank,
each parameter cut into equal pieces, one per rank) is read by its own protocol.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt._convert.torchfile import read_torch_file
from ddpckpt._convert.zero_merge import RankSlices, merge, number
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._posix import open_regular

MODEL_STATES = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d{1,6})_mp_rank_00_optim_states\.pt")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_LATEST_BYTES = 256


class _Record:
    """An inert record: what a DeepSpeed object's pickled ``__dict__`` held, nothing else."""


class LossScaler(_Record):
    pass


class DynamicLossScaler(_Record):
    pass


def zero_stage(value: Any) -> int:
    """What a pickled ``ZeroStageEnum(n)`` becomes: the number (no enum member a pickle could
    change for the whole process)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise CorruptCheckpointError(f"ZeroStageEnum({value!r:.40}) is no ZeRO stage")
    return value


@dataclass
class FragmentAddress:
    numel: int
    start: int


STAND_INS: tuple[tuple[Any, str], ...] = (
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)


def tag_directory(path: str) -> str:
    """``path`` itself, or the tag its ``latest`` file names (DeepSpeed's save directory)."""
    if os.path.lexists(os.path.join(path, MODEL_STATES)) or os.path.lexists(
        os.path.join(path, _ZERO3_MODEL)
    ):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.lexists(latest):
        return path
    try:
        fd = open_regular(latest)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{latest}: {exc.kind}, not DeepSpeed's tag file") from None
    with os.fdopen(fd, "rb") as f:
        text = f.read(_LATEST_BYTES + 1)
    tag = text.decode("utf-8", "replace").strip()
    if len(text) > _LATEST_BYTES or not _TAG.fullmatch(tag) or tag in (".", ".."):
        raise CorruptCheckpointError(
            f"{latest}: names no tag this importer takes (a directory name of letters, digits, "
            "'.', '_' and '-'): give the tag directory itself"
        )
    return os.path.join(path, tag)


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint's tag directory, or a save directory
    with DeepSpeed's ``latest`` file (read, and checked, by :func:`read_deepspeed`)."""
    return os.path.isdir(path) and any(
        os.path.lexists(os.path.join(path, n)) for n in (MODEL_STATES, _ZERO3_MODEL, "latest")
    )


def read_deepspeed(
    source: str, trusted: Iterable[str] = (), trusted_source: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint at ``source`` as the ``torch.save`` recipe :mod:`.legacy` imports
    (``model``, ``optimizer`` keyed by name, ``lr_scheduler``, ``global_step`` ...), and
    what was left out, with why; local."""
    directory = tag_directory(source)
    if not os.path.isdir(directory):
        raise CorruptCheckpointError(
            f"{os.path.join(source, 'latest')}: names the tag {os.path.basename(directory)!r}, "
            f"which {source} does not hold"
        )
    names = os.listdir(directory)
    optim_files = _by_rank(directory, names, _OPTIM, "optimizer")
    if _ZERO3_MODEL in names:  # ZeRO-3: every rank its own model states
        model_files = _by_rank(directory, names, _ZERO3_MODELS, "model states")
        models = [_read(directory, n, trusted, trusted_source) for n in model_files]
    elif MODEL_STATES in names:
        models = [_read(directory, MODEL_STATES, trusted, trusted_source)]
    else:
        raise CorruptCheckpointError(
            f"{directory}: no {MODEL_STATES}: not a DeepSpeed checkpoint's tag directory"
        )
    optims = [_zero_state(directory, n, trusted, trusted_source) for n in optim_files]
    sizes = sum(os.path.getsize(os.path.join(directory, n)) for n in optim_files)
    stage = optims[0].stage
    if any(o.stage != stage for o in optims) or (stage == 3) != (len(models) > 1 or
                                                                  _ZERO3_MODEL in names):  # fmt: skip
        raise CorruptCheckpointError(
            f"{directory}: its files are of different ZeRO stages (model states of "
            f"{'ZeRO-3' if _ZERO3_MODEL in names else 'ZeRO-1/2'}, optimizer of ZeRO-{stage})"
        )
    where = os.path.join(directory, MODEL_STATES if len(models) == 1 else _ZERO3_MODEL)
    model_names = model_files if len(models) > 1 else [MODEL_STATES]
    model_sizes = sum(os.path.getsize(os.path.join(directory, n)) for n in model_names)
    try:
        return merge(directory, where, models, optims, sizes, model_sizes)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError,
            OverflowError, RecursionError) as exc:  # fmt: skip
        if isinstance(exc, CorruptCheckpointError):
            raise
        # a field of a type DeepSpeed never writes, met where the checks above do not look
        raise CorruptCheckpointError(
            f"{directory}: not a DeepSpeed checkpoint this importer can read "
            f"({type(exc).__name__} on a malformed field)"
        ) from exc


_ZERO3_MODELS = re.compile(r"zero_pp_rank_(\d{1,6})_mp_rank_00_model_states\.pt")


def _by_rank(directory: str, names: list[str], pattern: re.Pattern[str], what: str) -> list[str]:
    """The files ``pattern`` names, one per rank 0, 1, ... without a gap."""
    ranks = sorted((int(m.group(1)), n) for n in names if (m := pattern.fullmatch(n)))
    if not ranks:
        raise CorruptCheckpointError(
            f"{directory}: no zero_pp_rank_*_optim_states.pt: a DeepSpeed checkpoint saved "
            "without ZeRO (its optimizer in the model states) is not imported yet"
        )
    if [r for r, _ in ranks] != list(range(len(ranks))):
        raise CorruptCheckpointError(
            f"{directory}: the {what} files are of ranks {[r for r, _ in ranks][:20]}, not "
            f"0 to {len(ranks) - 1}: a rank's file is missing or doubled"
        )
    return [n for _, n in ranks]


def _read(directory: str, name: str, trusted: Iterable[str], trusted_source: bool) -> Any:
    path = os.path.join(directory, name)
    if os.path.islink(path):
        raise CorruptCheckpointError(f"{path}: a symbolic link, not a file of the checkpoint")
    try:
        obj, _ = read_torch_file(path, trusted, trusted_source, stand_ins=STAND_INS)
    except CorruptCheckpointError as exc:
        if path in str(exc):
            raise
        raise CorruptCheckpointError(f"{path}: {exc}") from exc
    if not isinstance(obj, Mapping):
        raise CorruptCheckpointError(f"{path}: holds a {type(obj).__name__}, not DeepSpeed's dict")
    return obj


def _zero_state(
    directory: str, name: str, trusted: Iterable[str], trusted_source: bool
) -> RankSlices:
    path = os.path.join(directory, name)
    doc = _read(directory, name, trusted, trusted_source).get("optimizer_state_dict")
    # DeepSpeed's BF16_Optimizer (bf16 under ZeRO-1) records no stage and keeps the padding
    # of its slices: read as ZeRO-1 once the padding is removed
    bf16 = isinstance(doc, Mapping) and "zero_stage" not in doc and name.startswith("bf16_")
    if not isinstance(doc, Mapping) or ("zero_stage" not in doc and not bf16):
        raise CorruptCheckpointError(f"{path}: holds no ZeRO optimizer state (zero_stage)")
    stage = 1 if bf16 else doc["zero_stage"]
    if not isinstance(stage, int) or int(stage) not in (1, 2, 3):
        raise CorruptCheckpointError(f"{path}: ZeRO stage {stage!r}: stages 1, 2 and 3 are read")
    count = doc.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(type(c) is int and 0 < c <= 1 << 20 for c in counts):
        raise CorruptCheckpointError(f"{path}: partition_count {count!r:.100} is no rank count")
    if len(set(counts)) > 1:
        raise CorruptCheckpointError(
            f"{path}: groups partitioned over {sorted(set(counts))} ranks: a mixture-of-experts "
            "checkpoint (experts partitioned over fewer ranks), not imported; load it with "
            "DeepSpeed, then save once with ddpckpt"
        )
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    fp32 = doc.get(key)
    if not isinstance(fp32, list) or not all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() for t in fp32
    ):
        raise CorruptCheckpointError(f"{path}: {key} is not one flat float tensor per group")
    paddings = doc.get("group_paddings", [0] * len(fp32))
    if not (
        isinstance(paddings, list)
        and len(paddings) == len(fp32)
        and all(type(p) is int and p >= 0 for p in paddings)
    ):
        raise CorruptCheckpointError(f"{path}: group_paddings is not one count per group")
    if bf16:
        fp32 = [t.narrow(0, 0, max(0, t.numel() - p)) for t, p in zip(fp32, paddings, strict=True)]
    base = doc.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    scaler = doc.get("loss_scaler")
    scale = number(vars(scaler).get("cur_scale")) if isinstance(scaler, DynamicLossScaler) else None
    return RankSlices(path, fp32, paddings, base, int(stage), max(counts), scale)
