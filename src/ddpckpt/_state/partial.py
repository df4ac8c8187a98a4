"""Objects a failed load left partly restored, and the refusal to save them.

A load reads tensors straight into the live ones (no second copy of the state), so one
that fails after it began writing leaves the objects holding part of a checkpoint's state.
:func:`mark` records them (by identity: an object that is not hashable by value, or that
cannot be weakly referenced, is recorded too); :func:`refuse_marked`, which every capture
runs first, raises :class:`~ddpckpt.errors.PartiallyRestoredError` for a save of any of
them, until a load into them succeeds and :func:`clear` forgets them. Local: the collective
load decides, the same on every rank, whether its objects are marked (see
:mod:`ddpckpt._io.load`), and a save runs the capture in a collective step, so every rank
refuses together.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ddpckpt._state.training_state import TrainingState
from ddpckpt._training.wrappers import is_stateful, unwrap_model
from ddpckpt.errors import PartiallyRestoredError


@dataclass(frozen=True)
class _Mark:
    """One partly restored object: how to reach it (without keeping it alive where it can
    be weakly referenced), what it is, and the checkpoint whose load failed."""

    target: Callable[[], object | None]
    label: str
    checkpoint: str


_MARKS: dict[int, _Mark] = {}  # by id(); an entry is dropped when its object is collected
_LOCK = threading.RLock()  # a collected object's callback may run while it is held


def objects_of(state: TrainingState) -> Iterator[tuple[object, str]]:
    """Every object of ``state`` a load writes into, with a label naming it: models (also
    the module inside DDP or ``torch.compile``, which a later save may be given instead),
    optimizers, schedulers, scalers and stateful ``extra`` objects."""
    for role in ("models", "optimizers", "schedulers", "scalers"):
        for name, obj in getattr(state, role).items():
            label = f"{role[:-1]} {name!r}"
            yield obj, label
            if role == "models":
                inner = unwrap_model(obj)
                if inner is not obj:
                    yield inner, label
    for name, obj in state.extra.items():
        if is_stateful(obj):
            yield obj, f"extra[{name!r}]"
            held = getattr(obj, "obj", None)  # a PerRank wraps the user's object
            if held is not None and is_stateful(held):
                yield held, f"extra[{name!r}]"


def mark(state: TrainingState, checkpoint: str) -> None:
    """Record the objects of ``state`` as partly restored from ``checkpoint``; local."""
    with _LOCK:
        for obj, label in objects_of(state):
            _MARKS[id(obj)] = _Mark(_reference(obj), label, checkpoint)


def clear(state: TrainingState) -> None:
    """Forget the marks of the objects of ``state`` (a load into them succeeded); local."""
    with _LOCK:
        for obj, _ in objects_of(state):
            found = _MARKS.get(id(obj))
            if found is not None and found.target() is obj:
                del _MARKS[id(obj)]


def marked(state: TrainingState) -> list[_Mark]:
    """The marks of the objects of ``state`` (empty when none is partly restored)."""
    found = []
    with _LOCK:
        for obj, _ in objects_of(state):
            entry = _MARKS.get(id(obj))
            if entry is not None and entry.target() is obj:
                found.append(entry)
    return found


def refuse_marked(state: TrainingState) -> None:
    """Raise :class:`PartiallyRestoredError` if an object of ``state`` is partly restored;
    local (a save calls it in a collective step: the marks are the same on every rank)."""
    found = marked(state)
    if not found:
        return
    labels = ", ".join(dict.fromkeys(m.label for m in found))
    checkpoints = list(dict.fromkeys(m.checkpoint for m in found))
    source = (
        checkpoints[0] if len(checkpoints) == 1 else "the checkpoints " + ", ".join(checkpoints)
    )
    raise PartiallyRestoredError(
        f"refusing to save {labels}: a load from {source} failed after it "
        "began writing into them, so they hold part of that checkpoint's state, a state no "
        "checkpoint holds. Load a checkpoint into them first (the previous one, e.g. with "
        "ddpckpt.load_latest() or Checkpointer.resume(), which fall back past a damaged one); "
        "saving works again once a load into them succeeds"
    )


def _reference(obj: object) -> Callable[[], object | None]:
    """A callable returning ``obj`` while it lives: a weak reference that also drops the
    mark when ``obj`` is collected, or, for an object that has none, ``obj`` itself."""
    key = id(obj)

    def forget(ref: weakref.ref[object]) -> None:
        with _LOCK:
            found = _MARKS.get(key)
            if found is not None and found.target is ref:
                del _MARKS[key]

    try:
        return weakref.ref(obj, forget)
    except TypeError:  # no weak references (__slots__ without __weakref__): held until cleared
        return lambda: obj
