"""Per-rank state in each rank's own file, so the manifest does not grow with it (format 3).

Every rank writes ``rank-<rank>.safetensors``: its per-rank tensors (RNG state, per-rank
extras, its own copies of state that differed between ranks) and, in the file's
safetensors metadata under :data:`RANK_STATE_KEY`, its encoded per-rank state. The
manifest lists the file (size and checksum, like every file) and ``rank_keys``, the union
of the sections any rank stored (``rng``, ``own``, ``extra/<name>`` ...): a constant-size
summary whatever the number of ranks. A loading rank reads only its own rank file
(:func:`rank_part`), checks it against the manifest's checksum, and adds its tensors to
the manifest's index.

Checkpoints of format 2 and older hold every rank's state in the manifest's ``ranks``;
:func:`rank_part` reads them from there.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import xxhash

from ddpckpt._format.boundary import load_json, read_listed
from ddpckpt._format.manifest import Manifest
from ddpckpt._format.tensorfile import TensorEntry, read_header
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import Location

RANK_STATE_KEY = "ddpckpt.rank_state"
_NAMED = ("extra", "models_buffers")  # per-rank sections keyed by object name


def rank_file_name(rank: int) -> str:
    """The name of ``rank``'s file in a checkpoint directory."""
    return f"rank-{rank:05d}.safetensors"


def kept_ranks(manifest: Manifest) -> list[int]:
    """The ranks whose own files this copy of a checkpoint lists: every rank's, except in
    a node's copy written with partners (the fast tier: :class:`ddpckpt.FastTier`; its
    manifest's ``copy`` says ``partners``), which keeps its own ranks' files and those of
    the partner nodes before it."""
    if manifest.rank_keys is None or "partners" not in manifest.copy:
        return list(range(manifest.world_size))
    listed = manifest.files.readable([])  # a damaged file table's ranks: not kept here
    found = (_RANK_FILE.fullmatch(name.rpartition("/")[2]) for name in listed)
    return sorted(r for r in (int(m[1]) for m in found if m) if r < manifest.world_size)


def file_rank(rank: int, world_size: int) -> int:
    """Whose own file ``rank`` loads from a checkpoint of ``world_size`` ranks: its own, or
    rank 0's for a rank the checkpoint did not have."""
    return rank if rank < world_size else 0


_RANK_FILE = re.compile(r"rank-([0-9]{5,10})\.safetensors", re.ASCII)


def rank_keys(state: dict[str, Any]) -> list[str]:
    """The sections of one rank's per-rank ``state``, as the manifest's ``rank_keys`` lists them."""
    named = (f"{section}/{name}" for section in _NAMED for name in state.get(section, {}))
    return sorted({*state, *named})


def rank_has(manifest: Manifest, key: str) -> bool:
    """Whether any rank stored the per-rank section ``key`` (``"rng"``, ``"extra/<name>"`` ...)."""
    if manifest.rank_keys is not None:
        return key in manifest.rank_keys
    section, _, name = key.partition("/")
    return any(section in r and (not name or name in r[section]) for r in manifest.ranks)


def rank_part(manifest: Manifest, location: Location, rank: int) -> dict[str, Any]:
    """``rank``'s per-rank state in the checkpoint at ``location`` (``rank`` < its world
    size).

    With per-rank files, reads ``rank``'s file once (verified against the manifest's
    checksum) and adds its tensors to ``manifest.tensors``. Raises
    :class:`CorruptCheckpointError` naming the file if it is missing or damaged.
    """
    path = location.path
    if manifest.rank_keys is None:
        if rank >= len(manifest.ranks):
            raise CorruptCheckpointError(f"{path}: the manifest holds no state for rank {rank}")
        return _checked(manifest.ranks[rank], f"{path}: rank {rank}'s state")
    if rank not in manifest.rank_parts:
        state, entries = _read_rank_file(manifest, location, rank)
        manifest.tensors.update((e.key, e) for e in entries)
        manifest.rank_parts[rank] = state
    return manifest.rank_parts[rank]


def fill_rank_parts(manifest: Manifest, location: Location) -> list[str]:
    """Read every rank's part into ``manifest.ranks`` and ``manifest.tensors`` (tools that
    show or compare whole checkpoints); returns the problems found instead of raising."""
    if manifest.rank_keys is None:
        return []
    problems, parts = [], []
    kept = set(kept_ranks(manifest))
    for rank in range(manifest.world_size):
        try:
            parts.append(rank_part(manifest, location, rank) if rank in kept else {})
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            parts.append({})
    manifest.ranks = parts
    return problems


def _listed_name(manifest: Manifest, base: str) -> str | None:
    """The name under which the manifest lists the file ``base``: ``base`` itself, or
    ``<prefix>/<base>`` where an overwrite on an object store committed the replacement
    under a prefix (:mod:`ddpckpt.storage._base`); ``None`` if it lists neither."""
    return manifest.files.find(base)


def _checked(state: Any, where: str) -> dict[str, Any]:
    """One rank's state, its sections of the shapes the loaders read: ``own`` maps names
    to names, ``extra`` and the per-model buffers map names to encoded values."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: per-rank state is no JSON object")
    own = state.get("own", {})
    if not isinstance(own, dict) or not all(isinstance(v, str) for v in own.values()):
        raise CorruptCheckpointError(f"{where}: per-rank state: 'own' maps to something else")
    for section in _NAMED:
        if not isinstance(state.get(section, {}), dict):
            raise CorruptCheckpointError(f"{where}: per-rank state: {section!r} is no JSON object")
    return state


def _read_rank_file(
    manifest: Manifest, location: Location, rank: int
) -> tuple[dict, list[TensorEntry]]:
    name = _listed_name(manifest, rank_file_name(rank))
    if name is None:
        raise CorruptCheckpointError(
            f"{location}: the manifest lists no file {rank_file_name(rank)} for rank {rank}"
        )
    at = location.join(name)
    where = at.path
    listed = manifest.files[name]
    try:
        data = read_listed(at, listed.size, listed.digest, f"rank {rank}'s file")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: rank {rank}'s file is missing") from None
    header = read_header(lambda at, n: data[at : at + n], len(data), where, name)
    if RANK_STATE_KEY not in header.metadata:
        raise CorruptCheckpointError(f"{where}: damaged rank file header: no {RANK_STATE_KEY}")
    state = _checked(load_json(header.metadata[RANK_STATE_KEY], where, "per-rank state"), where)
    own = f"rank{rank}/"
    entries = []
    for entry in header.entries:
        if not entry.key.startswith(own):
            raise CorruptCheckpointError(
                f"{where}: rank {rank}'s file holds the tensor {entry.key[:200]!r}, which is "
                f"not rank {rank}'s"
            )
        # the file's checksum holds, so each tensor's own digest is computed here
        digest = xxhash.xxh3_64(data[entry.begin : entry.end]).hexdigest()
        entries.append(dataclasses.replace(entry, file=name, digest=digest))
    return state, entries
