"""Writing a checkpoint's state into the live objects on one rank, once the collective
:func:`~ddpckpt._io.load.load` has checked them against it: models, optimizers, schedulers,
scalers, extras, and each rank's own state (buffers, per-rank extras, RNG streams; rank 0's,
or a derived RNG state, for a rank the checkpoint has none of)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ddpckpt._format.codec import decode
from ddpckpt._format.manifest import Manifest
from ddpckpt._format.rankparts import rank_has, rank_part
from ddpckpt._format.sections import StateSections
from ddpckpt._format.statelayout import Layout
from ddpckpt._io.reader import CheckpointInfo, FileSource
from ddpckpt._log import get_logger
from ddpckpt._state.capture import TrainingState
from ddpckpt._state.ddp_buckets import restore_buckets
from ddpckpt._state.model import restore_model, restore_rank_buffers
from ddpckpt._state.objects import restore_stateful
from ddpckpt._state.optimizer import param_names, restore_optimizer
from ddpckpt._state.rng import derive_rng, restore_rng
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import Location

_log = get_logger(__name__)


@dataclass
class Began:
    """Whether this rank's restore began writing into the live objects."""

    writing: bool = False


def restore_objects(
    manifest: Manifest,
    source: FileSource,
    state: TrainingState,
    strict: bool,
    location: Location,
    rank: int,
    began: Began,
) -> CheckpointInfo:
    """Write the checkpoint's state (of the checkpoint at ``location``) into the objects of
    ``state``; local. ``began`` says from when a failure leaves them partly restored:
    tensors are read straight into the live ones, and verified as they are read, so from
    the first object on."""
    path = location.path
    stored = StateSections.from_json(manifest.state, path)
    layout = stored.layout
    began.writing = True
    for name, model in state.models.items():
        section = stored.models[name]
        restore_model(model, section, source, path, strict, layout.model_prefix(name))
        _restore_rank_buffers(manifest, layout, name, model, source, location, rank)
        restore_buckets(
            model, section.ddp_buckets, path, f"model {name!r}" if layout.named else "the model"
        )
    names = param_names(state.models, layout)
    for name, optimizer in state.optimizers.items():
        restore_optimizer(optimizer, names, stored.optimizers[name], source, path)
    for role in ("schedulers", "scalers"):
        for name, obj in getattr(state, role).items():
            restore_stateful(obj, getattr(stored, role)[name].state, source, path)
    values: dict[str, Any] = {}
    for name, entry in stored.extra.items():
        if entry.kind == "value":
            values[name] = decode(entry.state, lambda n: source.get(n).clone(), where=path)
    for name, obj in list(state.extra.items()):
        entry = stored.extra[name]
        if entry.kind == "stateful":
            restore_stateful(obj, entry.state, source, path)
        elif entry.kind == "per_rank":
            owner = _per_rank_owner(manifest, name, rank, location)
            own = rank_part(manifest, location, owner)["extra"][name]
            restore_stateful(obj, own, source.for_rank(owner), path)
        else:
            state.set_value(name, values[name])
    if state.rng:
        _restore_rng(manifest, source, location, rank)
    _log.info("loaded checkpoint %s (step %s)", path, manifest.step)
    return CheckpointInfo.from_manifest(path, manifest, values)


def _restore_rank_buffers(
    manifest: Manifest,
    layout: Layout,
    name: str,
    model: nn.Module,
    source: FileSource,
    location: Location,
    rank: int,
) -> None:
    """This rank's own buffers of model ``name``, saved under ``broadcast_buffers=False``."""
    path = location.path
    key = layout.buffers_key + (f"/{name}" if layout.named else "")
    if not rank_has(manifest, key):
        return
    if rank < manifest.world_size:
        encoded = layout.rank_buffers(rank_part(manifest, location, rank), name)
        if encoded is not None:
            restore_rank_buffers(model, encoded, source.for_rank(rank), path)
            return
    _log.warning(
        "%s: saved with %d rank%s and per-rank buffers (broadcast_buffers=False); rank %d "
        "has none stored and starts from rank 0's buffers",
        path,
        manifest.world_size,
        "" if manifest.world_size == 1 else "s",
        rank,
    )


def _per_rank_owner(manifest: Manifest, name: str, rank: int, location: Location) -> int:
    """Whose saved per-rank state ``rank`` loads: its own, or rank 0's if it has none."""
    path = location.path
    if rank < manifest.world_size:
        if name not in rank_part(manifest, location, rank).get("extra", {}):
            raise CorruptCheckpointError(
                f"{path}: no per-rank state of extra[{name!r}] for rank {rank}"
            )
        return rank
    _log.warning(
        "%s: saved with %d rank%s, so rank %d has no extra[%r] state of its own; it starts from rank 0's",
        path,
        manifest.world_size,
        "" if manifest.world_size == 1 else "s",
        rank,
        name,
    )
    return 0


def _restore_rng(manifest: Manifest, source: FileSource, location: Location, rank: int) -> None:
    path = location.path
    if not rank_has(manifest, "rng"):
        _log.warning(
            "%s: the checkpoint holds no RNG state; random generators left as they are", path
        )
        return
    if rank < manifest.world_size:
        mine = rank_part(manifest, location, rank)
        if "rng" not in mine:
            raise CorruptCheckpointError(f"{path}: no RNG state stored for rank {rank}")
        rank_source = source.for_rank(rank)
        state = decode(mine["rng"], lambda n: rank_source.get(n).clone(), where=path)
        restore_rng(state, f"{path} (rank {rank})")
        return
    first = 0 if "rng" in rank_part(manifest, location, 0) else _first_with_rng(manifest, location)
    rank0 = source.for_rank(first)
    base = decode(
        rank_part(manifest, location, first)["rng"], lambda n: rank0.get(n).clone(), where=path
    )
    _log.warning(
        "%s: saved with %d rank%s, so rank %d has no stored RNG state; seeding its generators "
        "deterministically from rank %d's state and its rank number",
        path,
        manifest.world_size,
        "" if manifest.world_size == 1 else "s",
        rank,
        first,
    )
    restore_rng(derive_rng(base, rank), f"{path} (derived for rank {rank})")


def _first_with_rng(manifest: Manifest, location: Location) -> int:
    """The first rank that stored RNG state (rank 0 did not: only in old checkpoints)."""
    return next(r for r in range(manifest.world_size) if "rng" in rank_part(manifest, location, r))
