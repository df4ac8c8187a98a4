"""A resume on fewer ranks than saved the checkpoint: what it cannot restore, said once.

The opposite change is said where it happens, by each rank the checkpoint has no state for
(:mod:`ddpckpt._io.restore`: it starts from rank 0's). Here nothing fails on any rank: the
ranks that are gone simply are not there to load their own state, so rank 0 says it for
the job, naming what those ranks had stored (the manifest's summary of the rank files,
:func:`~ddpckpt._format.rankparts.rank_has`). Said by :func:`ddpckpt.load`,
:func:`ddpckpt.load_latest` and a Checkpointer's resume (not a read-only one's: an
evaluation job trains nothing on).
"""

from __future__ import annotations

import torch

from ddpckpt._coord.failures import rank_list
from ddpckpt._format.manifest import Manifest, read_manifest
from ddpckpt._format.rankparts import rank_keys
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointError
from ddpckpt.storage._location import locate

_log = get_logger(__name__)


def note_fewer_ranks(info: CheckpointInfo) -> None:
    """Collective (every rank, once the checkpoint ``info`` is restored; local work): on
    rank 0, a WARNING if it was saved by more ranks than this job has (see
    :func:`shrink_notice`)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    rank = torch.distributed.get_rank() if distributed else 0
    if rank != 0 or info.world_size <= world:
        return
    try:
        keys: list[str] | None = stored_sections(read_manifest(locate(info.path)))
    except (OSError, CheckpointError):  # just loaded; if it is gone now, say less
        keys = None
    message = shrink_notice(info.path, info.world_size, world, keys)
    if message is not None:
        _log.warning("%s", message)


def stored_sections(manifest: Manifest) -> list[str]:
    """The per-rank sections any rank stored (``rng``, ``extra/<name>`` ...)."""
    if manifest.rank_keys is not None:
        return list(manifest.rank_keys)
    return sorted({key for part in manifest.ranks for key in rank_keys(part)})  # format <= 2


def shrink_notice(path: str, saved: int, current: int, keys: list[str] | None) -> str | None:
    """The WARNING for the checkpoint at ``path``, saved by ``saved`` ranks and resumed by
    ``current``, whose ranks stored the per-rank sections ``keys`` (``None``: unknown);
    ``None`` unless ``current < saved``."""
    if current >= saved:
        return None
    gone = list(range(current, saved))
    one = len(gone) == 1
    its = "its" if one else "their"
    who = f"rank{'' if one else 's'} {rank_list(gone)}"
    parts = _what_is_lost(keys or [], its)
    if keys is None:
        lost = f"what {who} stored of {its} own (such as {its} RNG streams) is not restored, and "
    elif parts:
        lost = f"what {who} stored of {its} own is not restored ({', '.join(parts)}), and "
    else:
        lost = f"{who} stored no state of {its} own, but "
    return (
        f"{path}: saved with {saved} ranks, resumed with {current}: {lost}with the same batch "
        "size per rank the global batch (world size x batch size) changes by a factor of "
        f"{current}/{saved}. Training goes on from this checkpoint, but "
        f"not exactly as the saved run would have; resume with {saved} ranks to continue it "
        "exactly"
    )


def _what_is_lost(keys: list[str], its: str) -> list[str]:
    """The per-rank sections ``keys`` in words, for the ranks that are gone."""
    parts = [f"{its} RNG streams"] if "rng" in keys else []
    for key in keys:
        section, _, name = key.partition("/")
        if section == "extra" and name:
            parts.append(f"{its} state of extra[{name!r}]")
    if any(k.partition("/")[0] in ("model_buffers", "models_buffers") for k in keys):
        parts.append(f"{its} buffers kept per rank (broadcast_buffers=False)")
    if "own" in keys:
        parts.append(f"{its} own values of the state that differed between ranks")
    return parts
