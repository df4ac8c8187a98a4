"""Checking, before a save writes anything, that state stored once is the same on every rank.

ddpckpt writes a replicated tensor once, from one rank. That is right only if every rank
holds the same bytes, so :func:`check_replicated` (collective, every rank calls it from
:func:`ddpckpt._io.planning.plan_write`) compares xxh3 digests across ranks, one small list
per rank through the store:

* tensors nothing keeps identical (``Snapshot.unverified``: a model without DDP, a
  module-valued extra such as an EMA copy, optimizer state of parameters outside DDP) are
  hashed on every rank (:func:`differing_unverified`; an asynchronous save hashes its host
  copies in the background);
* of the tensors DDP keeps identical (``Snapshot.balanced``) only the smallest are hashed,
  up to :data:`CANARY_BYTES` in all: a desynchronized DDP run (a rank whose updates went
  astray) differs in every parameter, biases and norms included. If one of them differs,
  every replicated tensor is hashed and compared.

Tensors that differ are stored per rank (``Snapshot.keep_per_rank``), with a warning on
rank 0, rather than refused: every rank's resume stays exact whatever the cause (ranks
training their own models, an EMA updated on rank 0 only), while the warning says what
to fix. Refusing would turn a save into a crash for set-ups that are legitimate.
Tensors that differ by design (``Snapshot.per_rank``: what DDP ignores) are stored per
rank without a check; those that may (``Snapshot.may_differ``: the buffers of a module in
``extra``, such as an EMA copy's BatchNorm statistics, which ``AveragedModel`` copies from
each rank's own model) are checked and stored per rank where they differ, without a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Set

import torch
import xxhash

from ddpckpt._coord.comm import Comm
from ddpckpt._format.tensorfile import byte_view, host_contiguous, tensor_nbytes
from ddpckpt._log import get_logger
from ddpckpt._state.snapshot import Snapshot
from ddpckpt.errors import StateMismatchError

_log = get_logger(__name__)
CANARY_BYTES = 1 << 20
_warned: set[tuple[str, ...]] = set()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The xxh3-64 digest of a tensor's bytes (copied off its device first)."""
    host = host_contiguous(tensor)  # kept alive: byte_view does not hold it
    return xxhash.xxh3_64(byte_view(host)).hexdigest()


def _canaries(snapshot: Snapshot) -> list[str]:
    """The smallest replicated tensors, up to ``CANARY_BYTES`` (at least one)."""
    chosen: list[str] = []
    total = 0
    for name in sorted(snapshot.balanced, key=lambda n: (tensor_nbytes(snapshot.tensors[n]), n)):
        total += tensor_nbytes(snapshot.tensors[name])
        if chosen and total > CANARY_BYTES:
            break
        chosen.append(name)
    return sorted(chosen)


def _differing(
    comm: Comm, tensors: Mapping[str, torch.Tensor], call: str, names: list[str]
) -> set[str]:
    """The ``names`` whose digests are not the same on every rank; collective."""

    def differing(gathered: list[list[str]]) -> list[int]:  # on rank 0
        return [i for i in range(len(names)) if len({g[i] for g in gathered}) > 1]

    digests = lambda: [tensor_digest(tensors[n]) for n in names]  # noqa: E731
    return {names[i] for i in comm.run_reduce(call, digests, differing)}


def check_replicated(comm: Comm, snapshot: Snapshot) -> None:
    """Decide, the same way on every rank, which shared tensors DDP keeps replicated are
    stored once; collective.

    Raises :class:`StateMismatchError` if the ranks' shared tensors differ in names,
    shapes or dtypes. Afterwards ``snapshot.balanced`` holds the replicated tensors any
    rank may write, the diverged ones and those that differ by design are in this rank's
    own state, and ``snapshot.unverified`` still holds the tensors that nothing keeps
    identical: compare them with :func:`differing_unverified` (once they are copied, for
    an asynchronous save).
    """
    if comm.world_size == 1:
        snapshot.balanced |= snapshot.unverified | snapshot.per_rank
        snapshot.unverified.clear()
        snapshot.per_rank.clear()
        return
    shared = sorted((n, str(t.dtype), list(t.shape)) for n, t in snapshot.tensors.items())
    sharded = [[n, *s.fingerprint()] for n, s in sorted(snapshot.sharded.items())]
    layout = [*shared, *sharded, sorted(snapshot.owned_state)]
    mine = [sorted(snapshot.unverified), sorted(snapshot.per_rank), _canaries(snapshot)]
    fingerprint = xxhash.xxh3_64(json.dumps([layout, mine]).encode()).hexdigest()
    mismatched = comm.run_reduce(
        "layout", lambda: fingerprint, lambda fps: [r for r, f in enumerate(fps) if f != fps[0]]
    )
    if mismatched:
        raise StateMismatchError(
            f"ranks {mismatched} hold training state whose tensors differ (names, shapes, "
            "dtypes, how DDP wraps the model, or DTensor meshes and placements) from rank 0's. "
            "ddpckpt.save stores replicated state once and sharded state (FSDP2, ZeRO) shard by "
            "shard, so every rank must hold the same model, optimizer, scheduler, scaler and "
            "extra objects; pipeline stages (a different part of the model on each rank) are "
            "not supported"
        )
    canaries = mine[2]
    diverged = _differing(comm, snapshot.tensors, "digests", canaries) if canaries else set()
    if diverged:  # DDP's replicas went apart: find every tensor that did
        diverged = _differing(comm, snapshot.tensors, "all-digests", sorted(snapshot.balanced))
        _warn(comm, sorted(diverged), diverged=True)
    snapshot.keep_per_rank(sorted(diverged | snapshot.per_rank))
    snapshot.per_rank.clear()


def differing_unverified(
    comm: Comm,
    tensors: Mapping[str, torch.Tensor],
    names: list[str],
    call: str = "unverified",
    may_differ: Set[str] = frozenset(),
    unsynced: Mapping[str, str] | None = None,
) -> set[str]:
    """Of ``names`` (unverified tensors, the same on every rank), those whose values in
    ``tensors`` (live, or this rank's copies) differ between ranks; collective. Rank 0
    warns about them, except those in ``may_differ``: they are stored per rank. The
    warning's advice follows ``unsynced`` (a tensor's name -> the DTensor wrapper of its
    model, which leaves it unsynchronized: ``Snapshot.unsynced``)."""
    if comm.world_size == 1 or not names:
        return set()
    apart = _differing(comm, tensors, call, names)
    if apart - may_differ:
        _warn(comm, sorted(apart - may_differ), diverged=False, unsynced=unsynced or {})
    return apart


def _advice(diverged: bool, wrapper: str | None) -> str:
    """What to do about replicated state that differs between ranks."""
    if diverged:
        return (
            "DistributedDataParallel should keep them identical: the ranks' replicas have "
            "diverged (a rank that skipped a step, or changed weights outside the optimizer)"
        )
    if wrapper is None:
        return (
            "if the model should be replicated, wrap it in DistributedDataParallel (an EMA "
            "copy: update it on every rank)"
        )
    applied = "fully_shard" if wrapper == "FSDP2" else wrapper
    return (
        f"{wrapper} does not synchronize buffers, so each rank's BatchNorm statistics follow "
        "its own batches and every rank resumes exactly from its own; for statistics shared "
        "by all ranks, convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm "
        f"before {applied}"
    )


def _warn(
    comm: Comm, names: list[str], *, diverged: bool, unsynced: Mapping[str, str] | None = None
) -> None:
    """Warn on rank 0, once per set of tensors and wrapper, that state stored once would be
    wrong; one warning per advice (the tensors of an FSDP2 model apart from an EMA copy's)."""
    if comm.rank != 0:
        return
    groups: dict[str | None, list[str]] = {}
    for name in names:
        groups.setdefault((unsynced or {}).get(name), []).append(name)
    for wrapper, group in groups.items():
        key = (str(wrapper), *group)
        if key in _warned:
            continue
        _warned.add(key)
        shown = ", ".join(group[:8]) + (f", ... ({len(group)} in all)" if len(group) > 8 else "")
        _log.warning(
            "%s: %d tensor(s) stored once for all ranks differ between ranks: %s. They are "
            "stored per rank and each rank loads its own; %s",
            comm.path,
            len(group),
            shown,
            _advice(diverged, wrapper),
        )
