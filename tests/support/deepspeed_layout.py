"""DeepSpeed ZeRO checkpoints (stages 1 to 3) written by the layout DeepSpeed's own code writes, without
DeepSpeed (its package builds its extensions at install: it does not install from this
project's CPU wheel of torch without building).

Followed from deepspeedai/DeepSpeed (commit edaa722, 2026-08): ``engine._save_checkpoint``
and ``_common_checkpoint_state`` (``mp_rank_00_model_states.pt``), ``_save_zero_checkpoint``
and ``stage_1_and_2.DeepSpeedZeroOptimizer.state_dict`` (one
``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank), ``_get_zero_param_shapes``,
``_get_shared_params``, ``utils/zero_to_fp32.py`` (the reconstruction it documents). The
pickles name DeepSpeed's own classes (``DynamicLossScaler``, ``ZeroStageEnum``,
``fragment_address``): classes of those names are placed in ``sys.modules`` while saving.

The optimizer works on each rank's slice of a group's flat fp32 vector; Adam is elementwise,
so an AdamW over the model's parameters has exactly the moments the ranks' slices hold:
:func:`write` takes a trained model and its ``torch.optim.AdamW`` and writes what DeepSpeed
would have written for them at ``world`` ranks.
"""

from __future__ import annotations

import enum
import math
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

VERSION = "0.18.2"


class DynamicLossScaler:
    def __init__(self) -> None:
        self.cur_scale = 65536.0
        self.cur_iter = 12
        self.last_overflow_iter = 3
        self.scale_factor = 2.0
        self.scale_window = 1000
        self.min_scale = 1.0
        self.delayed_shift = 2
        self.cur_hysteresis = 2
        self.consecutive_hysteresis = False
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = torch.float16


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class fragment_address:  # DeepSpeed's name
    numel: int
    start: int


_MODULES = {
    "deepspeed.runtime.fp16.loss_scaler": {"DynamicLossScaler": DynamicLossScaler},
    "deepspeed.runtime.zero.config": {"ZeroStageEnum": ZeroStageEnum},
    "deepspeed.utils.tensor_fragment": {"fragment_address": fragment_address},
}


def _as_deepspeed() -> list[str]:
    added = []
    for name, classes in _MODULES.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module not in sys.modules:
                sys.modules[module] = types.ModuleType(module)
                added.append(module)
        for cls_name, cls in classes.items():
            cls.__module__ = name
            setattr(sys.modules[name], cls_name, cls)
    return added


def write(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world: int,
    step: int, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    fused_adam: bool = False, tag: str | None = None, stage: int = 2,
    bf16_optimizer: bool = False, sub_group_size: int | None = None,
) -> Path:  # fmt: skip
    """Write ``model`` and its AdamW ``optimizer`` as DeepSpeed ZeRO-``stage`` (1, 2 or 3) at ``world``
    ranks, fp16 training (the module in half precision, fp32 masters in the optimizer
    files), into ``directory/tag`` with ``directory/latest`` naming it; the tag directory.
    ``fused_adam``: the optimizer as DeepSpeed's FusedAdam keeps it (the step in the
    group, ``adam_w_mode``). ``bf16_optimizer``: as DeepSpeed's BF16_Optimizer (bf16 under
    ZeRO-1) writes it: ``bf16_zero_pp_rank_R_...``, no stage recorded, the fp32 slices with
    their padding (``bf16_optimizer.BF16_Optimizer.state_dict``)."""
    if stage == 3:
        return _write_zero3(directory, model, optimizer, world=world, step=step,
                            scheduler=scheduler, fused_adam=fused_adam, tag=tag,
                            sub_group_size=sub_group_size)  # fmt: skip
    out = _tag_directory(directory, tag or f"global_step{step}")
    names = {p: n for n, p in model.named_parameters()}  # first name of a tied parameter
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    align = 2 * world  # nccl_start_alignment_factor (2) x world
    partitions: list[list[torch.Tensor]] = [[] for _ in range(world)]
    paddings: list[list[int]] = [[] for _ in range(world)]
    moments: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
    for params in groups:
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        padded = align * math.ceil(flat.numel() / align)
        size = padded // world
        state_flat = {
            key: torch.cat([optimizer.state[p][key].reshape(-1) for p in params])
            for key in ("exp_avg", "exp_avg_sq")
        }
        for rank in range(world):
            begin, end = rank * size, (rank + 1) * size
            # the part of this rank's slice past the group's elements (stage_1_and_2's
            # groups_padding: several trailing ranks may hold padding, or only padding)
            pad = max(0, end - max(begin, flat.numel()))
            padded_flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
            keep = end if bf16_optimizer else end - pad  # BF16_Optimizer keeps the padding
            partitions[rank].append(padded_flat[begin:keep].clone())
            paddings[rank].append(pad)
            moments[rank].append({
                key: torch.nn.functional.pad(value, (0, padded - flat.numel()))[begin:end].clone()
                for key, value in state_flat.items()
            })  # fmt: skip
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    added = _as_deepspeed()
    try:
        module = OrderedDict(
            (k, v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()
        )
        shapes = [OrderedDict((names[p], p.shape) for p in params) for params in groups]
        frozen = OrderedDict(
            (n, p.detach().cpu().half()) for n, p in model.named_parameters() if not p.requires_grad
        )  # fmt: skip (the module's precision)
        config = {"train_batch_size": 8, "fp16": {"enabled": True},
                  "zero_optimization": {"stage": stage},
                  **({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
                     if fused_adam else {})}  # fmt: skip
        states = _model_states(model, names, module, shapes, step, world, scheduler, config)
        if stage == 2:  # saved where gradients are partitioned (save_frozen_param)
            states["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in frozen.items())
            states["frozen_param_fragments"] = frozen
        torch.save(states, out / "mp_rank_00_model_states.pt")
        for rank in range(world):
            groups_out = _param_groups(hyper, [[g] for g in range(len(hyper))], fused_adam)
            state = {g: _with_step(m, step, fused_adam) for g, m in enumerate(moments[rank])}
            offsets = []
            for params in groups:
                mapping, start = OrderedDict(), 0
                for p in params:
                    mapping[names[p]] = fragment_address(p.numel(), start)
                    start += p.numel()
                offsets.append(mapping)
            zero = {
                "loss_scaler": DynamicLossScaler(),
                "dynamic_loss_scale": True,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": {"state": state, "param_groups": groups_out},
                "single_partition_of_fp32_groups": partitions[rank],
                "zero_stage": ZeroStageEnum(stage),
                "group_paddings": paddings[rank],
                "partition_count": [world] * len(groups),
                "ds_version": VERSION,
                "param_slice_mappings": offsets,
            }
            prefix = "zero_pp_rank"
            if bf16_optimizer:  # BF16_Optimizer.state_dict's keys only
                prefix = "bf16_zero_pp_rank"
                zero = {k: zero[k] for k in ("clip_grad", "base_optimizer_state",
                                             "single_partition_of_fp32_groups", "group_paddings",
                                             "partition_count", "ds_version",
                                             "param_slice_mappings")}  # fmt: skip
            _save_optimizer(zero, out / f"{prefix}_{rank}_mp_rank_00_optim_states.pt")
    finally:
        for module_name in added:
            sys.modules.pop(module_name, None)
    return out


def _pieces(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """ZeRO-3's partition of one parameter: ``ceil(numel / world)`` elements per rank, the
    last padded with zeros (``zero3_partitioned_param_info``)."""
    flat = tensor.detach().float().reshape(-1)
    piece = -(-flat.numel() // world)
    padded = torch.nn.functional.pad(flat, (0, piece * world - flat.numel()))
    return [padded[r * piece : (r + 1) * piece].clone() for r in range(world)]


def _write_zero3(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world: int,
    step: int, scheduler: torch.optim.lr_scheduler.LRScheduler | None, fused_adam: bool,
    tag: str | None, sub_group_size: int | None,
) -> Path:  # fmt: skip
    """ZeRO-3: stage3's ``_rigid_state_dict`` (``fp32_flat_groups``: each rank's pieces of
    its group's parameters, one after another; the base optimizer's state over them) and one
    model states file per rank (the parameters as empty placeholders, frozen ones as this
    rank's piece). A group whose pieces hold more than ``sub_group_size`` elements is cut
    into sub-groups (``_create_fp16_sub_groups``): one flat group each, listed in its param
    group (``_set_fp32_optimizer_param_groups``)."""
    out = _tag_directory(directory, tag or f"global_step{step}")
    names = {p: n for n, p in model.named_parameters()}
    user_groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    groups, owner = [], []  # the sub-groups, in order, and the param group of each
    for g, params in enumerate(user_groups):
        for sub in _sub_groups(params, world, sub_group_size):
            groups.append(sub)
            owner.append(g)
    added = _as_deepspeed()
    try:
        for rank in range(world):
            flats = [torch.cat([_pieces(p, world)[rank] for p in params]) for params in groups]
            state = {}
            for g, params in enumerate(groups):
                moments = {key: torch.cat([_pieces(optimizer.state[p][key], world)[rank]
                                           for p in params])
                           for key in ("exp_avg", "exp_avg_sq")}  # fmt: skip
                state[g] = _with_step(moments, step, fused_adam)
            listed = [[i for i, o in enumerate(owner) if o == g] for g in range(len(hyper))]
            groups_out = _param_groups(hyper, listed, fused_adam)
            zero = {
                "zero_stage": ZeroStageEnum(3),
                "loss_scaler": DynamicLossScaler(),
                "dynamic_loss_scale": True,
                "overflow": False,
                "partition_count": world,
                "optimizer_state_dict": {"state": state, "param_groups": groups_out},
                "fp32_flat_groups": flats,
            }
            _save_optimizer(zero, out / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            module = OrderedDict()
            for key, value in model.state_dict().items():
                is_param = any(key == n for n, _ in model.named_parameters(remove_duplicate=False))
                module[key] = (torch.empty(0, dtype=torch.float16) if is_param
                               else value.half() if value.is_floating_point() else value)  # fmt: skip
            config = {"zero_optimization": {"stage": 3},
                      **({"optimizer": {"type": "Adam"}} if fused_adam else {})}  # fmt: skip
            shapes = [OrderedDict((names[p], p.shape) for p in params) for params in groups]
            states = _model_states(model, names, module, shapes, step, world, scheduler, config)
            states["frozen_param_shapes"] = OrderedDict((n, p.shape) for n, p in frozen)
            states["frozen_param_fragments"] = OrderedDict(
                (n, _pieces(p, world)[rank].half()) for n, p in frozen
            )
            torch.save(states, out / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    finally:
        for module_name in added:
            sys.modules.pop(module_name, None)
    return out


def edit(path: Path, change) -> None:
    """Load the file ``path`` (this module's classes standing for DeepSpeed's), apply
    ``change`` to what it holds, and save it again: a damaged or hostile variant."""
    added = _as_deepspeed()
    try:
        doc = torch.load(path, weights_only=False)
        change(doc)
        torch.save(doc, path)
    finally:
        for module_name in added:
            sys.modules.pop(module_name, None)


def _sub_groups(
    params: list[torch.Tensor], world: int, size: int | None
) -> list[list[torch.Tensor]]:
    """stage3's ``_create_fp16_sub_groups``: parameters in order, a sub-group closed once
    its pieces hold ``size`` elements or more."""
    pieces = [-(-p.numel() // world) for p in params]
    if size is None or size >= sum(pieces):
        return [params]
    out, current, held = [], [], 0
    for param, piece in zip(params, pieces, strict=True):
        current.append(param)
        held += piece
        if held >= size or param is params[-1]:
            out.append(current)
            current, held = [], 0
    return out


def _tag_directory(directory: Path, tag: str) -> Path:
    """``directory/tag``, made, and ``directory/latest`` naming it (``save_checkpoint``)."""
    out = directory / tag
    out.mkdir(parents=True)
    (directory / "latest").write_text(tag)
    return out


def _model_states(
    model: torch.nn.Module, names: dict[torch.nn.Parameter, str], module: OrderedDict,
    shapes: list[OrderedDict], step: int, world: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, config: dict,
) -> dict:  # fmt: skip
    """``engine._common_checkpoint_state`` of a ZeRO run (no frozen parameters saved: the
    caller adds them where the stage saves them)."""
    shared = {
        n: names[p] for n, p in model.named_parameters(remove_duplicate=False) if names[p] != n
    }  # fmt: skip (_get_shared_params: a tie's other names)
    return {
        "module": module,
        "buffer_names": [n for n, _ in model.named_buffers()],
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None,
        "shared_params": shared,
        "frozen_param_fragments": None,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": step,
        "global_samples": step * 8,
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": config,
        "ds_version": VERSION,
    }


def _param_groups(hyper: list[dict], listed: list[list[int]], fused_adam: bool) -> list[dict]:
    """The base optimizer's param groups, each listing its flat slices: torch's AdamW's
    hyperparameters, or FusedAdam's defaults (its step per parameter, the group's 0)."""
    if not fused_adam:
        return [{**h, "params": listed[g]} for g, h in enumerate(hyper)]
    kept = ("lr", "betas", "eps", "weight_decay")
    return [{**{k: v for k, v in h.items() if k in kept}, "bias_correction": True, "step": 0,
             "params": listed[g]} for g, h in enumerate(hyper)]  # fmt: skip


def _with_step(moments: dict, step: int, fused_adam: bool) -> dict:
    """A slice's optimizer state: FusedAdam's step an int, torch's Adam's a float tensor."""
    return {"step": step if fused_adam else torch.tensor(float(step)), **moments}


def _save_optimizer(zero: dict, path: Path) -> None:
    """``engine._save_zero_checkpoint``: the ZeRO optimizer's state_dict and the config."""
    torch.save({"optimizer_state_dict": zero, "ds_config": {"train_batch_size": 8},
                "ds_version": VERSION}, path)  # fmt: skip
