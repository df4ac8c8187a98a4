"""DeepSpeed ZeRO's reconstruction protocol: each rank's slices of the fp32 master weights
and of the optimizer's moments put back together into whole tensors, keyed by parameter
name, as DeepSpeed's own ``zero_to_fp32.py`` does (:class:`Cutter`: ZeRO-1/2 joins each
group's slices in rank order, the group padded to ``2 * world`` elements; ZeRO-3 cuts each
parameter into ``ceil(numel / world)`` elements per rank). The files are read, and their
records checked, by :mod:`ddpckpt._convert.deepspeed`; what they hold arrives here as
:class:`RankSlices` and the model states' dicts, and leaves as the ``torch.save`` recipe
:mod:`ddpckpt._convert.legacy` imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddpckpt.errors import CorruptCheckpointError


@dataclass
class RankSlices:
    """One rank's optimizer file: its slice of each group's fp32 master weights (ZeRO-1/2:
    padding removed), the padding of its moments, and its base optimizer's state."""

    path: str
    fp32: list[torch.Tensor]
    paddings: list[int]
    base: Any  # the base optimizer's state_dict
    stage: int
    world: int
    scale: str | None  # a DynamicLossScaler's scale, as printed ("unknown" if no number)


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


class Cutter:
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


def merge(
    directory: str,
    where: str,
    models: list[Mapping[str, Any]],
    optims: list[RankSlices],
    sizes: int,
    model_sizes: int,
) -> tuple[dict[str, Any], list[str]]:
    """The recipe the importer reads (``model``, ``optimizer`` by name, ``lr_scheduler``,
    ``global_step`` ...) from the model states ``models`` (one, or one per rank under
    ZeRO-3; ``where`` names the first) and every rank's slices; ``sizes``: the optimizer
    files' bytes, which the slices joined may not exceed; ``model_sizes``: the model states
    files' bytes, four times which the buffers and frozen parameters made float32 may not
    exceed (one tensor under many names would be copied for each); and what was left out,
    with why."""
    model = models[0]
    if any(model.get(k) for k in ("ds_autoep_layers", "autoep_layers")):
        raise CorruptCheckpointError(
            f"{where}: a checkpoint of DeepSpeed's expert parallelism (AutoEP), its experts "
            "partitioned over expert groups, not imported; load it with DeepSpeed, then save "
            "once with ddpckpt"
        )
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
    cut = Cutter(shapes, world, optims[0].stage, sizes)
    masters = cut([list(o.fp32) for o in optims], f"{where}: fp32 weights")
    masters = {name: t.float() for name, t in masters.items()}
    module = model.get("module")
    if not isinstance(module, Mapping):
        why = (
            ": a pipeline-parallel checkpoint (its layers in layer_*-model_states.pt), not "
            "imported; load it with DeepSpeed, then save once with ddpckpt"
            if module is None
            else ""
        )
        raise CorruptCheckpointError(f"{where}: holds no model state_dict ('module'){why}")
    buffers = _field(model, "buffer_names", list, where)
    if not all(isinstance(b, str) for b in buffers):
        raise CorruptCheckpointError(f"{where}: buffer_names is not a list of names")
    budget = _Budget(4 * model_sizes, where)
    frozen = _frozen(models, where, budget)
    shared = _field(model, "shared_params", Mapping, where)
    weights: dict[str, Any] = {}
    for key, value in module.items():
        if key in masters:
            weights[key] = masters[key]
        elif key in frozen:
            weights[key] = frozen[key]
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            # a buffer (as zero_to_fp32.py restores them), or a parameter ZeRO-1 kept only in
            # the module (frozen): float32, as the fp32 masters
            budget.spend(value.numel() * 4)
            weights[key] = value.float()
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
            f"{number(scheduler['last_batch_iteration'])}: a torch scheduler cannot take it; "
            "build the torch scheduler that replaces it and step it that many times)"
        )
    elif isinstance(scheduler, Mapping) and scheduler:
        obj["lr_scheduler"] = dict(scheduler)
    if type(model.get("global_steps")) is int:
        obj["global_step"] = model["global_steps"]
    for key in ("global_samples", "skipped_steps"):
        if type(model.get(key)) is int:
            obj[key] = model[key]
    if optims[0].scale is not None:
        left_out.append(
            f"loss_scaler (DeepSpeed's DynamicLossScaler, scale {optims[0].scale}): torch's "
            "GradScaler keeps other state; start it with init_scale at that scale"
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


def number(value: Any) -> str:
    """A number of the file for a message; anything else is not repeated."""
    return repr(value) if type(value) in (int, float) else "unknown"


class _Budget:
    """Bytes the import may still make from the model states (see :func:`merge`)."""

    def __init__(self, left: int, where: str) -> None:
        self.left, self.where = left, where

    def spend(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise CorruptCheckpointError(
                f"{self.where}: its buffers and frozen parameters add up to more bytes than "
                "the model states files hold (one tensor under many names): refused"
            )


def _frozen(
    models: list[Mapping[str, Any]], where: str, budget: _Budget
) -> dict[str, torch.Tensor]:
    """The frozen parameters, as float32 when floating: whole in the one model states file
    (ZeRO-1/2), or each rank's piece in its own (ZeRO-3), joined as ``zero_to_fp32.py``
    joins them."""
    shapes = _field(models[0], "frozen_param_shapes", Mapping, where)
    fragments = [_field(m, "frozen_param_fragments", Mapping, where) for m in models]
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
        budget.spend(8 * sum(p.numel() for p in pieces))  # joined, then as float32
        whole = torch.cat([p.reshape(-1) for p in pieces])
        if whole.numel() < math.prod(dims):
            raise CorruptCheckpointError(
                f"{where}: the frozen parameter {name!r:.200} is cut short"
            )
        value = whole.narrow(0, 0, math.prod(dims)).view(dims)
        out[name] = value.float() if value.is_floating_point() else value
    return out


def _adam_mode(model: Mapping[str, Any], optims: list[RankSlices], left_out: list[str]) -> bool:
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
    optims: list[RankSlices], cut: Cutter, where: str, adam_w: bool
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
    if not isinstance(base, Mapping) or not isinstance(base.get("param_groups"), list):
        raise CorruptCheckpointError(f"{optims[0].path}: the base optimizer's state is malformed")
    groups_in = base["param_groups"]
    # Each param group lists its flat slices: one under ZeRO-1/2, one per sub-group under
    # ZeRO-3 (a group larger than sub_group_size), numbered in param_shapes' order.
    owner: dict[int, int] = {}
    for g, group in enumerate(groups_in):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, list) or not all(type(i) is int for i in params):
            raise CorruptCheckpointError(
                f"{optims[0].path}: group {g} of the base optimizer does not list its slices"
            )
        owner.update((i, g) for i in params)
    if sorted(owner) != list(range(len(shapes))) or len(owner) != sum(
        len(group["params"]) for group in groups_in
    ):
        raise CorruptCheckpointError(
            f"{optims[0].path}: the optimizer's groups list slices {sorted(owner)[:20]}, the "
            f"model's parameters lie in {len(shapes)}"
        )
    per_rank = [[_rank_group_state(o, i) for i in range(len(shapes))] for o in optims]
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
            for g, group_state in enumerate(states):
                part = group_state.get(key)
                if not isinstance(part, torch.Tensor) or part.dim() != 1:
                    raise CorruptCheckpointError(f"{o.path}: group {g} lacks its {key!r}")
                pad = o.paddings[g]
                row.append(part.narrow(0, 0, max(0, part.numel() - pad)))
            vectors.append(row)
        joined[key] = cut(vectors, f"{where}: {key}")
    state: dict[str, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = [{"params": []} for _ in groups_in]
    for g, names in enumerate(shapes):  # g: a slice (a ZeRO-3 sub-group), of group owner[g]
        scalars = {k: v for k, v in per_rank[0][g].items() if k not in joined}
        hyper = dict(groups_in[owner[g]])
        hyper.pop("params", None)
        group_step = hyper.pop("step", None)
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
        param_groups[owner[g]] = {**hyper, "params": param_groups[owner[g]]["params"] + list(names)}
    return {"state": state, "param_groups": param_groups}


def _rank_group_state(rank: RankSlices, index: int) -> Any:
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
