"""Checking the live objects against a checkpoint before :func:`ddpckpt.load` changes any of
them: every mismatch is a :class:`StateMismatchError` naming the object and what to do."""

from __future__ import annotations

from typing import Any

from ddpckpt._format.manifest import Manifest
from ddpckpt._format.sections import StateSections
from ddpckpt._format.statelayout import ROLE_KEYS, Layout
from ddpckpt._io.reader import FileSource
from ddpckpt._state.capture import TrainingState
from ddpckpt._state.model import check_model
from ddpckpt._state.objects import extra_kind
from ddpckpt._state.optimizer import check_optimizer, param_names, rebuilt_group_hyper
from ddpckpt._state.zero import optimizer_type
from ddpckpt.errors import StateMismatchError


def _label(layout: Layout, role: str, name: str) -> str:
    """How messages call the object ``name`` of ``role``."""
    single = ROLE_KEYS[role][0]
    if layout.named:
        return f"{single} {name!r}"
    return "the model" if role == "models" else single


def check_state(
    manifest: Manifest, source: FileSource, state: TrainingState, strict: bool, path: str
) -> None:
    """Raise :class:`StateMismatchError` if any object of ``state`` does not fit the
    checkpoint at ``path`` (missing section, other type, keys, shapes, param groups, extra
    kinds), before anything is changed; every rank checks its own objects."""
    stored = StateSections.from_json(manifest.state, path)
    if stored.saved_dict is not None:
        raise StateMismatchError(
            f"{path}: holds a dict saved by ddpckpt.save_dict, not a training state; read "
            "it with ddpckpt.load_dict(path)"
        )
    layout = stored.layout
    for role in ROLE_KEYS:
        for name in getattr(state, role):
            if name not in getattr(stored, role):
                raise StateMismatchError(_absent(path, role, name, stored))
    for role in ("optimizers", "schedulers", "scalers"):
        for name, obj in getattr(state, role).items():
            saved, live = getattr(stored, role)[name].type, type(obj).__qualname__
            if role == "optimizers":  # ZeRO's state is that of its inner optimizer
                live = optimizer_type(obj)
            if saved not in (live, _IMPORTED):
                raise StateMismatchError(
                    f"{path}: the checkpoint's {_label(layout, role, name)} is of type {saved}, "
                    f"the live one of type {live}; pass a {saved}, or leave it out of the load "
                    "to start it fresh"
                )
    names = param_names(state.models, layout)
    for name, model in state.models.items():
        label = _label(layout, "models", name)
        prefix = layout.model_prefix(name)
        check_model(model, stored.models[name], source, path, strict, prefix, label)
    for name, optimizer in state.optimizers.items():
        label = _label(layout, "optimizers", name)
        check_optimizer(optimizer, names, stored.optimizers[name], path, label, source)
    for name, scheduler in state.schedulers.items():
        _check_scheduler_groups(
            scheduler, state, stored, names, path, _label(layout, "schedulers", name), name
        )
    for name, scaler in state.scalers.items():
        if not stored.scalers[name].state and scaler.is_enabled():
            raise StateMismatchError(
                f"{path}: {_label(layout, 'scalers', name)} was saved disabled "
                "(GradScaler(enabled=False) has no state), the live one is enabled; disable it "
                "as when saving, or leave it out of the load to start from its initial scale"
            )
    stored_extra = stored.extra
    for name, obj in state.extra.items():
        if name not in stored_extra:
            held_as = next((r for r in ROLE_KEYS if name in getattr(stored, r)), None)
            saved_as = "" if held_as is None else (
                f"; it holds {name!r} as a {ROLE_KEYS[held_as][0]} of a TrainingState: load it "
                f"with ddpckpt.TrainingState({name}=...)"
            )  # fmt: skip
            raise StateMismatchError(
                f"{path}: extra[{name!r}] is not in the checkpoint (it has: "
                f"{', '.join(sorted(stored_extra)) or 'no extra state'}){saved_as}"
            )
        kind, now = stored_extra[name].kind, extra_kind(obj)
        if kind != now:
            raise StateMismatchError(
                f"{path}: extra[{name!r}] was saved as {_KINDS[kind]}, but the object passed "
                f"now ({type(obj).__qualname__}) is {_KINDS[now]}"
            )


def _absent(path: str, role: str, name: str, stored: StateSections) -> str:
    """The message for an object passed whose section the checkpoint lacks."""
    single = ROLE_KEYS[role][0]
    layout = stored.layout
    if name in stored.extra:  # e.g. an EMA module or a second optimizer saved in extra=
        return (
            f"{path}: the TrainingState takes {name!r} for its {single} (by its type), but the "
            f"checkpoint holds it as an extra object (saved in extra=); load it the same way: "
            f"TrainingState.of(model=..., extra={{{name!r}: ...}}) or ddpckpt.load(path, "
            f"model=..., extra={{{name!r}: ...}})"
        )
    if not layout.named and name == single:  # the shorthand's object
        present = [
            r for r in ("model", "optimizer", "scheduler", "scaler") if getattr(stored, f"{r}s")
        ]
        return (
            f"{path}: you passed {single}= but the checkpoint has no {single} state (it holds: "
            f"{', '.join(present)}); leave {single}= out or load a checkpoint saved with one"
        )
    held = ", ".join(repr(n) for n in getattr(stored, role)) or "none"
    hint = (
        " It was saved with the keyword shorthand: its objects are called 'model', "
        "'optimizer', 'scheduler' and 'scaler'."
        if not layout.named
        else ""
    )
    return (
        f"{path}: the TrainingState has {single} {name!r}, but the checkpoint has no "
        f"{single} of that name (its {role}: {held}); name the objects as when saving, or "
        f"leave {name!r} out.{hint}"
    )


_IMPORTED = "imported"  # the type of sections imported from a torch.save file

_KINDS = {
    "value": "a plain value",
    "stateful": "an object with state_dict() shared by all ranks",
    "per_rank": "per-rank state (PerRank, a StatefulDataLoader ...)",
}


def _check_scheduler_groups(
    scheduler: Any, state: TrainingState, stored: StateSections, names: Any, path: str,
    label: str, name: str,
) -> None:  # fmt: skip
    """A scheduler keeps a learning rate per param group, in the saving run's order. Where
    its optimizer's groups were rebuilt by an import and matched to the live ones by their
    parameters, the live groups must start from those rates in that order: otherwise the
    next ``scheduler.step()`` would give each group another group's rate."""
    optimizer = getattr(scheduler, "optimizer", None)
    owner = next((n for n, o in state.optimizers.items() if o is optimizer), None)
    if owner is None or name not in stored.schedulers:
        return
    hypers = rebuilt_group_hyper(state.optimizers[owner], names, stored.optimizers[owner])
    saved = stored.schedulers[name].state
    base = saved.get("base_lrs") if isinstance(saved, dict) else None
    if hypers is None or not isinstance(base, list):
        return
    starts = [h.get("initial_lr") if isinstance(h, dict) else None for h in hypers]
    if starts != base:
        raise StateMismatchError(
            f"{path}: {label} keeps a learning rate per param group in the saving run's order, "
            f"starting from {base}; the live optimizer's groups, matched to the imported ones "
            f"by their parameters, start from {starts}: build the param groups in the order "
            "and number of the run that saved it, or leave the scheduler out of the load"
        )
