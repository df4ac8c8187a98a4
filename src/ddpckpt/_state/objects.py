"""Everything in a checkpoint besides the model and its optimizer: schedulers, the
gradient scaler and the user's ``extra`` objects.

Stateful objects (``state_dict()``/``load_state_dict()``) are stored through their state,
encoded without pickle; other ``extra`` values are stored as they are. An ``extra`` object
whose state differs between ranks (a DataLoader, a :class:`PerRank`) is stored per rank.

Every function here is local to the calling rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpckpt._format.codec import JSON, decode, encode
from ddpckpt._format.sections import ExtraEntry, StatefulSection
from ddpckpt._state.snapshot import Snapshot, TensorSource, restoring
from ddpckpt.errors import UnsupportedValueError


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def capture_stateful(prefix: str, obj: Any, snapshot: Snapshot) -> StatefulSection:
    """The section of a scheduler or scaler: ``obj``'s type and state, whose tensors are
    added to ``snapshot`` under ``prefix``."""
    return StatefulSection(
        type(obj).__qualname__, encode(obj.state_dict(), prefix, snapshot.tensors)
    )


def restore_stateful(obj: Any, encoded: JSON, source: TensorSource, where: str) -> None:
    """``obj.load_state_dict`` with the stored state ``encoded``; modules get zero-copy views."""
    # Module.load_state_dict copies into its own tensors; other objects may keep what they get.
    copies_in = isinstance(obj, nn.Module)
    state = decode(
        encoded, lambda n: source.get(n) if copies_in else source.get(n).clone(), where=where
    )
    with restoring(f"{type(obj).__qualname__}.load_state_dict", where):
        obj.load_state_dict(state)


class PerRank:
    """Marks an ``extra`` object whose state differs between ranks, so it is saved per rank.

    ``extra={"state": ddpckpt.PerRank(obj)}``. DataLoaders, torchdata's ``StatefulDataLoader``
    and :class:`~ddpckpt.GradientAccumulation` are recognised without it. A rank that did
    not exist when the checkpoint was saved gets rank 0's state, with a warning.
    """

    def __init__(self, obj: Any) -> None:
        if not is_stateful(obj):
            raise TypeError(
                f"PerRank needs an object with state_dict()/load_state_dict(), got {type(obj).__qualname__}"
            )
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


def extra_kind(obj: Any) -> str:
    """How an ``extra`` entry is stored: ``per_rank``, ``stateful`` (shared) or ``value``.

    A plain ``DataLoader`` becomes tracked here (see :mod:`ddpckpt._training.loader`), so passing it
    to a load tracks it before the loop.
    """
    from ddpckpt._training.loader import adopt_loaders

    adopt_loaders({"": obj})
    if not is_stateful(obj):
        return "value"
    per_rank = isinstance(obj, PerRank) or getattr(type(obj), "ddpckpt_per_rank", False)
    if per_rank or type(obj).__module__.startswith("torchdata.stateful_dataloader"):
        return "per_rank"
    return "stateful"


def capture_extra(extra: Mapping[str, Any], snapshot: Snapshot) -> dict[str, ExtraEntry]:
    """The ``extra`` entries, their tensors added to ``snapshot``; raises for what a resume
    could not restore exactly.

    A module-valued entry (e.g. an EMA copy) is stored once, but nothing keeps it identical
    on every rank: its tensors are verified before writing, never assumed replicated.
    """
    from ddpckpt._training.loader import check_data_extra

    check_data_extra(extra)
    section: dict[str, ExtraEntry] = {}
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"extra keys must be non-empty strings, got {name!r}")
        prefix = f"extra/{name}"
        kind = extra_kind(obj)
        if kind == "per_rank":
            section[name] = ExtraEntry(kind, type(obj).__qualname__)
            own = snapshot.rank_state.setdefault("extra", {})
            own[name] = encode(obj.state_dict(), prefix, snapshot.rank_tensors)
        elif kind == "stateful":
            before = set(snapshot.tensors)
            state = encode(obj.state_dict(), prefix, snapshot.tensors)
            section[name] = ExtraEntry(kind, type(obj).__qualname__, state)
            if isinstance(obj, nn.Module):
                added = set(snapshot.tensors) - before
                snapshot.unverified |= added
                # buffers a module updates on each rank from that rank's batches (BatchNorm
                # statistics, which an EMA copy takes from each rank's model) may differ
                buffers = {f"{prefix}/{name}" for name, _ in obj.named_buffers()}
                snapshot.may_differ |= added & buffers
        elif isinstance(obj, torch.utils.data.Sampler):
            raise UnsupportedValueError(
                f"{prefix}: a {type(obj).__qualname__} has no position of its own to save: "
                "the DataLoader that iterates it knows what training consumed. Put that "
                "loader in extra instead (extra={'loader': loader}); ddpckpt saves and "
                "restores its position exactly"
            )
        else:
            section[name] = ExtraEntry("value", None, encode(obj, prefix, snapshot.tensors))
    return section
