"""The record of one rank's captured training state, and what restoring reads tensors from.

:mod:`ddpckpt._state.capture` fills a :class:`Snapshot` from live objects (its model,
optimizer and object parts live in :mod:`~ddpckpt._state.model`,
:mod:`~ddpckpt._state.optimizer_capture` and :mod:`~ddpckpt._state.objects`);
:mod:`ddpckpt._io` plans, writes and reads it. Restoring takes tensors from a :class:`TensorSource`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ddpckpt._format.codec import JSON
from ddpckpt._state.sharded import ShardedTensor
from ddpckpt.errors import CheckpointError, StateMismatchError

if TYPE_CHECKING:
    from ddpckpt._format.reshard import Box


class TensorSource(Protocol):
    """Supplies verified tensors by name while restoring."""

    def meta(self, name: str, region: Box | None = None) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape of ``name``, without reading its bytes; given the
        ``region`` that will be read (a load's checks, before anything is written), what
        locates those bytes is read and checked too."""
        ...

    def get(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor called ``name``, on the CPU (or already in ``like``).

        The result may share memory with the checkpoint file: callers copy from it and
        never keep it or write to it. ``like`` is a tensor the caller will copy into; a
        source may fill it directly and return it. A sharded tensor comes whole.
        """
        ...

    def read_region(self, name: str, target: torch.Tensor, region: Box) -> None:
        """Copy the ``region`` (offsets, shape) of the global tensor ``name`` into ``target``
        (a tensor of that shape, any device), reading only what it needs."""
        ...


@dataclass
class Snapshot:
    """One rank's captured training state.

    ``state`` and ``tensors`` are the shared training state (model, optimizer, scheduler,
    scaler, extras): stored once. Only the tensors named in ``balanced`` are identical on
    every rank, so only they may be written by any rank: parameters DDP synchronizes and
    their optimizer state. Tensors in ``unverified`` are assumed identical on every rank
    but nothing guarantees it (a model without DDP, module-valued extras such as an EMA
    copy, optimizer state of parameters outside DDP): :mod:`ddpckpt._coord.consistency`
    compares their digests across ranks, treats the identical ones as ``balanced`` and
    stores the others per rank; those also in ``may_differ`` (the buffers of a module-valued
    extra: an EMA copy's BatchNorm statistics copy each rank's own) do so without a
    warning. ``unsynced`` names, for the unverified tensors of a model whose parameters
    FSDP2 or ``replicate()`` hold, that wrapper: it leaves buffers alone (the warning's
    advice is not DDP's). Tensors in ``per_rank`` differ between ranks by design
    (parameters and buffers DDP ignores, and their optimizer state): stored per rank
    whenever there are several ranks. Every other shared tensor (buffers such as BatchNorm
    statistics, which each rank updates with its own batch until DDP broadcasts rank 0's
    at the next forward) is stored as rank 0 holds it.

    ``rank_state`` and ``rank_tensors`` are this rank's own (RNG, buffers under
    ``broadcast_buffers=False``, and, under ``rank_state["own"]``, this rank's values of
    shared tensors that differ between ranks; see :meth:`keep_per_rank`): stored per rank.
    ``stepped_by`` maps a shared tensor to the optimizers whose ``step()`` writes it (for
    the overlap mode, which may copy such tensors until the first of those steps);
    ``written_in_forward`` names those that a module's forward also writes in place (an
    ``nn.Embedding`` with ``max_norm``: :mod:`ddpckpt._state.inplace`).
    Tensors are referenced from the trees by name.

    Sharded state: ``sharded`` holds the DTensors among the shared tensors, as this rank's
    shard and where the shards lie (:mod:`ddpckpt._state.dtensor`), each distinct shard
    written once. ``owned`` holds tensors only this rank has (the optimizer state of the
    parameters a ``ZeroRedundancyOptimizer`` assigns to it, :mod:`ddpckpt._state.zero`),
    written by this rank; ``owned_state`` the encoded state they belong to, by the path of
    its optimizer section in ``state`` (each rank's merged into it when the manifest is
    written).
    """

    state: dict[str, JSON] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    balanced: set[str] = field(default_factory=set)
    unverified: set[str] = field(default_factory=set)
    per_rank: set[str] = field(default_factory=set)
    may_differ: set[str] = field(default_factory=set)  # unverified, apart by design: no warning
    unsynced: dict[str, str] = field(default_factory=dict)  # unverified -> its DTensor wrapper
    rank_state: dict[str, JSON] = field(default_factory=dict)
    rank_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stepped_by: dict[str, list[torch.optim.Optimizer]] = field(default_factory=dict)
    written_in_forward: set[str] = field(default_factory=set)
    sharded: dict[str, ShardedTensor] = field(default_factory=dict)
    owned: dict[str, torch.Tensor] = field(default_factory=dict)
    owned_state: dict[str, dict[str, JSON]] = field(default_factory=dict)

    def keep_per_rank(self, names: Iterable[str]) -> None:
        """Store this rank's values of the shared tensors ``names`` in its own file too.

        The shared copy keeps rank 0's values (what a rank that did not exist at save time
        loads); :func:`ddpckpt._io.load.load` gives every other rank its own.
        """
        names = list(names)
        if not names:  # no section at all: a rank that did not exist is told only of real ones
            return
        own = self.rank_state.setdefault("own", {})
        for name in names:
            self.balanced.discard(name)
            self.unverified.discard(name)
            self.rank_tensors[f"own/{name}"] = self.tensors[name]
            own[name] = f"own/{name}"


@contextmanager
def restoring(what: str, where: str) -> Iterator[None]:
    """Report a live object's ``load_state_dict`` refusing the state a checkpoint holds
    (``what`` names the object, ``where`` the checkpoint) as a
    :class:`~ddpckpt.errors.StateMismatchError` naming both, the object's error chained: a
    checkpoint whose checksums hold can still hold a state the object does not accept
    (written by other code, or crafted)."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        raise StateMismatchError(
            f"{where}: {what} rejected the state the checkpoint holds for it "
            f"({type(exc).__name__}: {exc}); the checkpoint does not hold a state it accepts"
        ) from exc
