"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2, 3) without DeepSpeed or its pickles.

A tag directory of ``engine.save_checkpoint`` (or its parent, whose ``latest`` names the
tag) holds ``mp_rank_00_model_states.pt`` (the model in its training precision, the
parameters' names and shapes in the optimizer's flat order, the scheduler, the step) and
one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R (that
rank's slice of every parameter group's fp32 master weights, flattened, and of the
optimizer's moments). The weights are put back together as DeepSpeed's own
``zero_to_fp32.py`` does (its reconstruction protocol: each group's slices concatenated in
rank order, the parameters taken one after another in ``param_shapes`` order, the group
padded to ``2 * world`` elements), and the moments the same way, so the result is the
``torch.save`` recipe :mod:`ddpckpt._convert.legacy` imports: the model (fp32 masters),
the optimizer keyed by parameter name, the scheduler and the step.

The files pickle four DeepSpeed classes (the loss scaler, the ZeRO stage enum, a slice
address); each is read as an inert record of this module (DeepSpeed is never imported, and
no code of the file runs: torch's weights-only unpickler builds only these records,
tensors and plain values). ZeRO-3 (``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank,
each parameter cut into equal pieces, one per rank) is read by its own protocol.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt._convert.torchfile import read_torch_file
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._base import NotRegularFileError
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
            f"{latest}: names no checkpoint tag (DeepSpeed writes one directory name there)"
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
    try:
        return _assemble(directory, models, optims, sizes)
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


@dataclass
class _RankState:
    """One rank's optimizer file: its slice of each group's fp32 master weights (ZeRO-1/2:
    padding removed), the padding of its moments, and its base optimizer's state."""

    path: str
    fp32: list[torch.Tensor]
    paddings: list[int]
    base: Any
    base_step: Any
    stage: int
    world: int
    scaler: Any


def _zero_state(
    directory: str, name: str, trusted: Iterable[str], trusted_source: bool
) -> _RankState:
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
        raise CorruptCheckpointError(f"{path}: partition_count {count!r} is not a rank count")
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
    return _RankState(path, fp32, paddings, base, doc.get("base_optimizer_state_step"),
                      int(stage), max(counts), doc.get("loss_scaler"))  # fmt: skip


def _shapes(model: Mapping[str, Any], where: str) -> list[dict[str, tuple[int, ...]]]:
    groups = model.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CorruptCheckpointError(f"{where}: param_shapes is not a list of name-to-shape maps")
    out, seen = [], set()
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            if not isinstance(name, str) or not isinstance(shape, (torch.Size, list, tuple)):
                raise CorruptCheckpointError(f"{where}: param_shapes holds a malformed entry")
            dims = tuple(shape)
            if not all(type(d) is int and 0 <= d < 1 << 62 for d in dims) or name in seen:
                raise CorruptCheckpointError(f"{where}: the shape of {name[:200]!r} is not a shape")
            seen.add(name)
            shapes[name] = dims
        out.append(shapes)
    return out


class _Cutter:
    """Cuts per-rank flat vectors (``vectors[rank][group]``) into the parameters, by the
    reconstruction protocol of DeepSpeed's ``zero_to_fp32.py`` for the stage.

    ZeRO-1/2: each group's slices concatenated in rank order hold the group's parameters one
    after another (the group padded to ``2 * world`` elements). ZeRO-3: each parameter is cut
    into ``ceil(numel / world)`` elements per rank, and a rank's groups, concatenated, hold
    its piece of every parameter one after another."""

    def __init__(
        self, shapes: list[dict[str, tuple[int, ...]]], world: int, stage: int, budget: int
    ) -> None:
        self.shapes, self.world, self.stage = shapes, world, stage
        # Bytes the optimizer files hold: every slice is stored once and joined once (for
        # the weights and for each moment), so joining more means slices shared in the
        # pickle, which would copy one tensor many times.
        self.budget = budget

    def __call__(self, vectors: list[list[torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
        self.budget -= sum(t.numel() * t.element_size() for row in vectors for t in row)
        if self.budget < 0:
            raise CorruptCheckpointError(
                f"{where}: the ranks' slices add up to more bytes than the optimizer files "
                "hold (one tensor shared by many slices): refused"
            )
        if self.stage == 3:
            return self._zero3([torch.cat(groups) for groups in vectors], where)
        out: dict[str, torch.Tensor] = {}
        for g, shapes in enumerate(self.shapes):
            flat = torch.cat([groups[g] for groups in vectors])
            out.update(self._zero2(flat, shapes, f"{where} (group {g})"))
        return out

    def _zero2(
        self, flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], where: str
    ) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CorruptCheckpointError(
                    f"{where}: the parameters need more than the {flat.numel()} elements the "
                    "ranks hold"
                )
            out[name] = flat.narrow(0, offset, numel).view(shape)
            offset += numel
        align = 2 * self.world
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel() / align):
            raise CorruptCheckpointError(
                f"{where}: the ranks hold {flat.numel()} elements, the parameters {offset}: the "
                "optimizer files are not of this checkpoint"
            )
        return out

    def _zero3(self, flats: list[torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for shapes in self.shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                piece = -(-numel // self.world)
                if any(offset + piece > f.numel() for f in flats):
                    raise CorruptCheckpointError(
                        f"{where}: a rank holds fewer elements than the parameters' pieces need"
                    )
                whole = torch.cat([f.narrow(0, offset, piece) for f in flats])
                out[name] = whole.narrow(0, 0, numel).view(shape)
                offset += piece
        if any(f.numel() != offset for f in flats):
            raise CorruptCheckpointError(
                f"{where}: a rank holds {max(f.numel() for f in flats)} elements, the "
                f"parameters' pieces {offset}: the optimizer files are not of this checkpoint"
            )
        return out


def _assemble(
    directory: str, models: list[Mapping[str, Any]], optims: list[_RankState], sizes: int
) -> tuple[dict[str, Any], list[str]]:
    model = models[0]
    where = os.path.join(directory, MODEL_STATES if len(models) == 1 else _ZERO3_MODEL)
    world = optims[0].world
    if world != len(optims) or (len(models) > 1 and len(models) != world):
        raise CorruptCheckpointError(
            f"{directory}: saved by {world} data-parallel ranks, but it has {len(optims)} "
            f"optimizer files and {len(models)} model states files"
        )
    shapes = _shapes(model, where)
    groups = len(shapes)
    if any(len(o.fp32) != groups or o.world != world for o in optims):
        raise CorruptCheckpointError(
            f"{directory}: the optimizer files do not all hold {groups} parameter groups of "
            f"{world} ranks"
        )
    cut = _Cutter(shapes, world, optims[0].stage, sizes)
    masters = cut([list(o.fp32) for o in optims], f"{where}: fp32 weights")
    masters = {name: t.float() for name, t in masters.items()}
    module = model.get("module")
    if not isinstance(module, Mapping):
        raise CorruptCheckpointError(f"{where}: holds no model state_dict ('module')")
    buffers = _field(model, "buffer_names", list, where)
    if not all(isinstance(b, str) for b in buffers):
        raise CorruptCheckpointError(f"{where}: buffer_names is not a list of names")
    frozen = _frozen(models, where)
    shared = _field(model, "shared_params", Mapping, where)
    weights: dict[str, Any] = {}
    for key, value in module.items():
        if key in masters:
            weights[key] = masters[key]
        elif key in frozen:
            weights[key] = frozen[key]
        elif key in set(buffers) and isinstance(value, torch.Tensor) and value.is_floating_point():
            weights[key] = value.float()  # as zero_to_fp32.py restores them
        else:
            weights[key] = value
    weights.update((k, v) for k, v in masters.items() if k not in weights)
    for name, target in shared.items():
        if isinstance(name, str) and isinstance(target, str) and target in weights:
            weights[name] = weights[target]  # a tie: stored once, loaded tied
    obj: dict[str, Any] = {"model": weights}
    left_out: list[str] = []
    optimizer = _optimizer(optims, cut, where, _adam_mode(model, optims, left_out))
    if optimizer is not None:
        obj["optimizer"] = optimizer
    scheduler = model.get("lr_scheduler")
    if isinstance(scheduler, Mapping) and set(scheduler) == {"last_batch_iteration"}:
        # DeepSpeed's own schedulers (WarmupLR, WarmupDecayLR, OneCycle ...) keep only this:
        # a torch scheduler would take it as its state and start its schedule over
        left_out.append(
            f"lr_scheduler (a DeepSpeed scheduler's state, last_batch_iteration "
            f"{_number(scheduler['last_batch_iteration'])}: a torch scheduler cannot take it; "
            "build the torch scheduler that replaces it and step it that many times)"
        )
    elif isinstance(scheduler, Mapping) and scheduler:
        obj["lr_scheduler"] = dict(scheduler)
    if type(model.get("global_steps")) is int:
        obj["global_step"] = model["global_steps"]
    for key in ("global_samples", "skipped_steps"):
        if type(model.get(key)) is int:
            obj[key] = model[key]
    scaler = optims[0].scaler
    if isinstance(scaler, DynamicLossScaler):
        left_out.append(
            f"loss_scaler (DeepSpeed's DynamicLossScaler, scale "
            f"{_number(vars(scaler).get('cur_scale'))}): torch's GradScaler keeps other state; "
            "start it with init_scale at that scale"
        )
    for key in ("data_sampler", "random_ltd"):
        if model.get(key) is not None:
            left_out.append(f"{key} (DeepSpeed's own state)")
    return obj, left_out


def _field(doc: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """``doc[key]``, an empty ``kind`` if absent or None, else a value of ``kind``."""
    value = doc.get(key)
    if value is None:
        return kind() if kind is not Mapping else {}
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{where}: {key} is a {type(value).__name__}")
    return value


def _number(value: Any) -> str:
    """A number of the file for a message; anything else is not repeated."""
    return repr(value) if type(value) in (int, float) else "unknown"


def _frozen(models: list[Mapping[str, Any]], where: str) -> dict[str, torch.Tensor]:
    """The frozen parameters, as float32 when floating: whole in the one model states file
    (ZeRO-1/2), or each rank's piece in its own (ZeRO-3), joined as ``zero_to_fp32.py``
    joins them."""
    shapes = _field(models[0], "frozen_param_shapes", Mapping, where)
    fragments = [_field(m, "frozen_param_fragments", Mapping, where) for m in models]
    budget = sum(f.numel() for fr in fragments for f in fr.values() if isinstance(f, torch.Tensor))
    out = {}
    for name, shape in shapes.items():
        pieces = [f.get(name) for f in fragments]
        dims = tuple(shape) if isinstance(shape, (torch.Size, list, tuple)) else None
        if (
            dims is None
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims)
            or not all(isinstance(p, torch.Tensor) for p in pieces)
        ):
            raise CorruptCheckpointError(f"{where}: the frozen parameter {name!r:.200} malformed")
        budget -= sum(p.numel() for p in pieces)
        if budget < 0:
            raise CorruptCheckpointError(f"{where}: the frozen parameters share their fragments")
        whole = torch.cat([p.reshape(-1) for p in pieces])
        if whole.numel() < math.prod(dims):
            raise CorruptCheckpointError(
                f"{where}: the frozen parameter {name!r:.200} is cut short"
            )
        value = whole.narrow(0, 0, math.prod(dims)).view(dims)
        out[name] = value.float() if value.is_floating_point() else value
    return out


def _adam_mode(model: Mapping[str, Any], optims: list[_RankState], left_out: list[str]) -> bool:
    """Whether DeepSpeed's own Adam (FusedAdam, CPUAdam: groups with ``bias_correction``)
    decayed the weights decoupled (AdamW), from the saved config: its optimizer ``type`` and
    ``adam_w_mode`` (default True, as DeepSpeed's); named in ``left_out`` when unknown."""
    groups = optims[0].base.get("param_groups") if isinstance(optims[0].base, Mapping) else None
    if not (isinstance(groups, list) and groups and isinstance(groups[0], Mapping)
            and "bias_correction" in groups[0]):  # fmt: skip
        return False  # not DeepSpeed's Adam: its groups say what they are
    config = model.get("ds_config")
    spec = config.get("optimizer") if isinstance(config, Mapping) else None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    params = spec.get("params") if isinstance(spec, Mapping) else None
    if isinstance(kind, str) and kind.lower() in ("adam", "adamw"):
        mode = params.get("adam_w_mode", True) if isinstance(params, Mapping) else True
        return kind.lower() == "adamw" or mode is not False
    left_out.append(
        "the Adam mode (DeepSpeed's FusedAdam or CPUAdam, built by the script, not named in "
        "ds_config): taken as decoupled weight decay (AdamW), their default; if the run set "
        "adam_w_mode=False, set decoupled_weight_decay=False in the optimizer's param groups"
    )
    return True


def _optimizer(
    optims: list[_RankState], cut: _Cutter, where: str, adam_w: bool
) -> dict[str, Any] | None:
    """The base optimizer's state keyed by parameter name: each moment's slices joined and
    cut as the weights are; a step kept in the group (DeepSpeed's Adam) goes to each
    parameter, as torch's Adam keeps it; DeepSpeed's Adam flags as torch's."""
    base = optims[0].base
    if base is None:
        return None
    shapes = cut.shapes
    if isinstance(base, list):
        raise CorruptCheckpointError(
            f"{optims[0].path}: saved with elastic_checkpoint, which keeps no hyperparameters "
            "(learning rate, betas ...) of the optimizer: not imported; load it with DeepSpeed "
            "and save it once with elastic_checkpoint off, or with ddpckpt"
        )
    else:
        if not isinstance(base, Mapping) or not isinstance(base.get("param_groups"), list):
            raise CorruptCheckpointError(
                f"{optims[0].path}: the base optimizer's state is malformed"
            )
        groups_in = base["param_groups"]
        if len(groups_in) != len(shapes):
            raise CorruptCheckpointError(
                f"{optims[0].path}: the optimizer has {len(groups_in)} groups, the model "
                f"{len(shapes)}"
            )
        indices = []
        for g, group in enumerate(groups_in):
            params = group.get("params") if isinstance(group, Mapping) else None
            if not (isinstance(params, list) and len(params) == 1 and type(params[0]) is int):
                raise CorruptCheckpointError(
                    f"{optims[0].path}: group {g} of the base optimizer is not one flat slice"
                )
            indices.append(params[0])
        per_rank = [[_rank_group_state(o, i) for i in indices] for o in optims]
    if not all(isinstance(s, Mapping) for states in per_rank for s in states):
        raise CorruptCheckpointError(f"{where}: a group's optimizer state is not a dict")
    if not all(isinstance(g, Mapping) for g in groups_in):
        raise CorruptCheckpointError(f"{where}: a param group is not a dict")
    moments = sorted({k for s in per_rank[0] for k, v in s.items()
                      if isinstance(v, torch.Tensor) and v.dim() == 1})  # fmt: skip
    joined = {}
    for key in moments:
        vectors = []
        for o, states in zip(optims, per_rank, strict=True):
            row = []
            for g, state in enumerate(states):
                part = state.get(key)
                if not isinstance(part, torch.Tensor) or part.dim() != 1:
                    raise CorruptCheckpointError(f"{o.path}: group {g} lacks its {key!r}")
                pad = o.paddings[g]
                row.append(part.narrow(0, 0, max(0, part.numel() - pad)))
            vectors.append(row)
        joined[key] = cut(vectors, f"{where}: {key}")
    state: dict[str, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    for g, names in enumerate(shapes):
        scalars = {k: v for k, v in per_rank[0][g].items() if k not in joined}
        hyper = dict(groups_in[g])
        hyper.pop("params", None)
        group_step = hyper.pop("step", optims[0].base_step)
        step = scalars.pop("step", group_step)  # FusedAdam: per parameter, its group's is 0
        if "bias_correction" in hyper:  # DeepSpeed's FusedAdam / CPUAdam, as torch's Adam
            if hyper.pop("bias_correction") is not True:
                raise CorruptCheckpointError(
                    f"{optims[0].path}: an Adam without bias correction, which torch's Adam "
                    "cannot continue"
                )
            hyper.pop("adam_w_mode", None)
            hyper["decoupled_weight_decay"] = adam_w
        for name in names:
            own: dict[str, Any] = {key: cut_key[name] for key, cut_key in joined.items()}
            if own and step is not None:
                own["step"] = _step(step, optims[0].path)
            own.update(scalars)
            if own:
                state[name] = own
        if param_groups and param_groups[-1]["hyper"] == hyper:  # ZeRO-3's sub-groups of one
            param_groups[-1]["params"] += list(names)
        else:
            param_groups.append({"hyper": hyper, "params": list(names)})
    return {
        "state": state,
        "param_groups": [{**g["hyper"], "params": g["params"]} for g in param_groups],
    }


def _rank_group_state(rank: _RankState, index: int) -> Any:
    """The state of the flat slice ``index`` in ``rank``'s base optimizer (non-elastic)."""
    state = rank.base.get("state") if isinstance(rank.base, Mapping) else None
    if not isinstance(state, Mapping):
        raise CorruptCheckpointError(f"{rank.path}: the base optimizer's state holds no state")
    return state.get(index, {})


def _step(value: Any, where: str) -> torch.Tensor:
    """A step count as torch's Adam keeps it: a float32 scalar tensor."""
    if type(value) in (int, float) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        number = float(value)
        if math.isfinite(number) and number >= 0:
            return torch.tensor(number)
    raise CorruptCheckpointError(f"{where}: a step count that is not a number of steps")
