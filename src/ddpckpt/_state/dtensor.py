"""DTensor state: parameters, buffers and optimizer state that no rank holds whole.

FSDP2's ``fully_shard`` (``Shard(0)`` over a 1-D mesh), HSDP (``Replicate()`` and
``Shard(0)`` over a 2-D mesh) and the DTensor ``replicate()`` hold each parameter, and the
optimizer state shaped like it, as a DTensor: a local tensor on each rank plus the device
mesh and placements that say where it lies in the global tensor. A checkpoint stores each
distinct shard once (:mod:`ddpckpt._format.shards`; replicas are written by one owner,
:func:`ddpckpt._io.shardwrite.plan_shards`) and a load fills each rank's live local tensor
from the pieces that overlap it, whatever mesh and world size it was saved with
(:mod:`ddpckpt._format.reshard`).

Supported: ``Shard(dim)`` (uneven sizes as ``torch.chunk`` splits them, which is what
DTensor does) and ``Replicate()`` on a mesh over every rank of the job. Refused at save,
naming the tensor: ``Partial`` (a reduction still pending), ``_StridedShard`` (FSDP
combined with tensor parallelism) and any other placement, a mesh over only some ranks
(pipeline stages), and a local tensor whose shape is not the one its placements give
(``DTensor.from_local`` with uneven shards of one's own).

Every function here is local to the calling rank.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ddpckpt._format.reshard import Box
from ddpckpt._format.shardgrid import REPLICATE, region_at
from ddpckpt._format.shards import shard_placement
from ddpckpt._state.sharded import MeshLayout, RankOrder, ShardedTensor
from ddpckpt.errors import UnsupportedValueError

if TYPE_CHECKING:
    from ddpckpt._state.snapshot import Snapshot, TensorSource


def is_dtensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a DTensor. Looked up, not imported: a process that made one has
    imported DTensor's module (whose import costs tens of MB a save should not)."""
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None)
    return kind is not None and isinstance(value, kind)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_ORDERS: dict[int, tuple[weakref.ref[Any], RankOrder]] = {}


def rank_order(mesh: Any) -> RankOrder:
    """The ranks of a device mesh, read once per mesh (by identity) and shared by the
    captures of all its tensors: the mesh's N ranks are not listed again for each tensor."""
    found = _ORDERS.get(id(mesh))
    if found is not None and found[0]() is mesh:
        return found[1]
    for key in [k for k, (ref, _) in _ORDERS.items() if ref() is None]:
        del _ORDERS[key]
    order = RankOrder(int(r) for r in mesh.mesh.flatten().tolist())
    _ORDERS[id(mesh)] = (weakref.ref(mesh), order)
    return order


def capture_dtensor(name: str, value: Any) -> ShardedTensor:
    """``value``'s shard and layout; raises :class:`UnsupportedValueError` naming ``name``
    for what a checkpoint cannot restore (see the module docstring)."""
    placements = placement_codes(name, value)
    mesh = value.device_mesh
    ranks = rank_order(mesh)
    rank, world = _world()
    if len(ranks) != world or not ranks.covers_the_job:
        raise UnsupportedValueError(
            f"{name}: a DTensor on a device mesh of ranks {list(ranks)[:16]} of the job's "
            f"{world}; ddpckpt saves DTensors on a mesh over every rank (FSDP2, HSDP, "
            "replicate()), not pipeline stages or sub-meshes. Save each stage with its own "
            "ddpckpt.save_dict, or use torch.distributed.checkpoint"
        )
    layout = MeshLayout(tuple(mesh.shape), ranks, placements)
    local = value.to_local().detach()
    shape = tuple(value.shape)
    expected = layout.region(shape, rank)[1]
    if tuple(local.shape) != expected:
        raise UnsupportedValueError(
            f"{name}: rank {rank}'s local shard has shape {list(local.shape)} where placements "
            f"{list(placements)} over mesh {list(layout.shape)} give {list(expected)} "
            "(torch.chunk sizes); a DTensor built from uneven shards of one's own cannot be "
            "resharded. Redistribute it to Shard/Replicate placements before saving"
        )
    return ShardedTensor(local, shape, layout)


def placement_codes(name: str, value: Any) -> tuple[str, ...]:
    """The DTensor ``value``'s placements as the manifest writes them; raises
    :class:`UnsupportedValueError` naming ``name`` for any but Shard and Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    codes = []
    for placement in value.placements:
        if type(placement) is Shard:
            codes.append(shard_placement(placement.dim % max(value.ndim, 1)))
        elif type(placement) is Replicate:
            codes.append(REPLICATE)
        else:
            raise UnsupportedValueError(_refusal(name, placement))
    return tuple(codes)


def split_sharded(snapshot: Snapshot) -> None:
    """Move the DTensors among ``snapshot``'s shared tensors to ``snapshot.sharded``.

    Raises :class:`UnsupportedValueError` for an unsupported DTensor (see
    :func:`capture_dtensor`) and for one in per-rank state.
    """
    for name, value in list(snapshot.tensors.items()):
        if not is_dtensor(value):
            continue
        snapshot.sharded[name] = capture_dtensor(name, value)
        del snapshot.tensors[name]
        for kind in (snapshot.balanced, snapshot.unverified, snapshot.per_rank):
            kind.discard(name)
    for name, value in snapshot.rank_tensors.items():
        if is_dtensor(value):
            raise UnsupportedValueError(
                f"{name}: per-rank state holding a DTensor; keep per-rank state in plain "
                "tensors (DTensor.to_local()) or save it as shared state"
            )


def _refusal(name: str, placement: Any) -> str:
    kind = type(placement).__name__
    if kind == "_StridedShard":
        what = (
            "a _StridedShard placement: FSDP combined with tensor parallelism, which ddpckpt "
            "does not save; use torch.distributed.checkpoint for such models, or FSDP2/HSDP "
            "without a tensor-parallel mesh dimension"
        )
    elif "Partial" in kind:
        what = (
            f"a {kind} placement: a reduction still pending, whose saved value would be one "
            "rank's partial sum; save after the reduction (dt.redistribute(placements="
            "[Replicate()]) or the step that reduces it)"
        )
    else:
        what = (
            f"a placement of type {kind}; ddpckpt saves DTensors with Shard(dim) and "
            "Replicate() placements only: redistribute it to those before saving"
        )
    return f"{name}: a DTensor with {what}"


def live_region(value: Any, name: str) -> Box:
    """The part of its global tensor the live DTensor ``value`` holds on this rank (for
    the stored tensor ``name``, which messages name)."""
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedValueError(
            f"{name}: the live DTensor's device mesh does not include this rank; ddpckpt "
            "loads DTensors on a mesh over every rank"
        )
    placements = placement_codes(name, value)
    return region_at(tuple(value.shape), tuple(mesh.shape), placements, tuple(coordinate))


def restore_dtensor(target: Any, name: str, source: TensorSource) -> None:
    """Fill the live DTensor ``target``'s local shard with its part of the stored ``name``
    (sharded or whole), in place."""
    with torch.no_grad():
        source.read_region(name, target.to_local(), live_region(target, name))


def new_dtensor_like(
    param: Any, name: str, dtype: torch.dtype, device: torch.device, source: TensorSource
) -> Any:
    """A new DTensor placed as the DTensor ``param``, holding its part of the stored
    ``name`` in ``dtype`` on ``device`` (optimizer state shaped like its parameter)."""
    from torch.distributed.tensor import DTensor

    region = live_region(param, name)
    local = torch.empty(region[1], dtype=dtype, device=device)
    source.read_region(name, local, region)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
        stride=param.stride(),
    )  # fmt: skip
