"""The training state a checkpoint holds: named models, optimizers, schedulers, scalers,
extra objects and values, and whether each rank's random generators go with them.

A :class:`TrainingState` is what :func:`ddpckpt.save`, :func:`ddpckpt.load` and
:class:`ddpckpt.Checkpointer` take. Built from a mapping of names to objects, each object
gets the role its type says (a module is a model, an optimizer an optimizer ...); the
keyword shorthand of those functions (``model=``, ``optimizer=``, ``scheduler=``,
``scaler=``, ``extra=``, ``rng=``) builds one with :meth:`TrainingState.of`.

Constructing one is local and touches no tensor; a DataLoader in it is tracked from then on
(:mod:`ddpckpt._training.loader`), so build it before the training loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ddpckpt.errors import InexactResumeError

ROLES = ("models", "optimizers", "schedulers", "scalers", "extra")
# The names the keyword shorthand gives its objects; a state holding at most one object
# of each role under these names is written in the single-model layout (format 2).
SHORTHAND_NAMES = {"models": "model", "optimizers": "optimizer", "schedulers": "scheduler",
                   "scalers": "scaler"}  # fmt: skip


def role_of(obj: object) -> str:
    """Which part of a :class:`TrainingState` ``obj`` belongs to, by its type."""
    if isinstance(obj, nn.Module):
        return "models"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizers"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return "schedulers"
    if isinstance(obj, torch.amp.GradScaler):
        return "scalers"
    return "extra"


class TrainingState(Mapping[str, Any]):
    """Named training objects, checkpointed together; a read-only mapping name -> object.

    The one way to name what a checkpoint holds when there is more than one model (or any
    time); the keyword shorthand ``model=``, ``optimizer=`` ... of :func:`ddpckpt.save`,
    :func:`ddpckpt.load` and :class:`~ddpckpt.Checkpointer` describes the one-model
    case. Built locally, the same on every rank, e.g.
    ``TrainingState(G=generator, D=discriminator, opt_G=opt_g, opt_D=opt_d, loader=loader)``
    (models, optimizers, schedulers and scalers are recognised by type; anything else is an
    extra), then passed to ``save``, ``load`` or a ``Checkpointer`` (a complete GAN script:
    the "Save and resume" guide).

    Every model gets what ``model=`` gets (canonical keys, tied weights, DDP replication),
    and every optimizer's state is keyed by the names its parameters have in the models of
    the state (``"G/fc.weight"``); a parameter in no model of the state is an error at
    save. Schedulers (``LRScheduler``) and scalers (``GradScaler``) are stored through
    ``state_dict()``; any other object is an ``extra`` entry as in :func:`ddpckpt.save`: a
    stateful object, a :class:`~ddpckpt.PerRank` one, or a plain value, which
    :func:`ddpckpt.load` writes back into this state (``state["epoch_seen"]``) and into the
    mapping it was built from, if that mapping can be written.

    Args:
        objects: Names mapped to objects (positional only), e.g. an existing dict.
        rng: Save and restore every rank's random generators.
        **named: More names and objects. Names are non-empty strings without ``/``.
    """

    def __init__(
        self, objects: Mapping[str, Any] | None = None, /, *, rng: bool = True, **named: Any
    ) -> None:
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.scalers: dict[str, Any] = {}
        self.extra: MutableMapping[str, Any] = {}
        self.rng = bool(rng)
        self._source: MutableMapping[str, Any] | None = None
        if objects is not None and named:
            both = set(objects) & set(named)
            if both:
                raise ValueError(f"TrainingState: {sorted(both)} named twice")
        if isinstance(objects, MutableMapping):
            self._source = objects
        for name, obj in {**(objects or {}), **named}.items():
            _check_name(name)
            getattr(self, role_of(obj))[name] = obj
        self._check_distinct_models()
        self._check_schedulers()
        _adopt_loaders(self.extra)

    @classmethod
    def of(
        cls,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: MutableMapping[str, Any] | None = None,
        rng: bool = True,
    ) -> TrainingState:
        """The state the keyword shorthand describes, written in today's single-model layout.

        ``extra`` is kept as the mapping passed (plain values loaded are written into it),
        its objects keep the ``extra`` role whatever their type (an optimizer there is a
        generic object, stored by position), and its names may repeat the shorthand's.
        """
        if model is None:
            raise TypeError("model= is required (or pass a TrainingState)")
        _refuse_several(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        state = cls(rng=rng)
        state.models["model"] = model
        for role, obj in (("optimizers", optimizer), ("schedulers", scheduler),
                          ("scalers", scaler)):  # fmt: skip
            if obj is not None:
                getattr(state, role)[SHORTHAND_NAMES[role]] = obj
        if extra is not None:
            state.extra = extra
        state._check_distinct_models()
        state._check_schedulers()
        _adopt_loaders(state.extra)
        return state

    @classmethod
    def coerce(cls, state: TrainingState | None, **shorthand: Any) -> TrainingState:
        """``state``, or the one the keyword shorthand describes; never both.

        ``rng=None`` in the shorthand means "as the state says" (``True`` without one).
        """
        given = [k for k, v in shorthand.items() if v is not None]
        if state is None:
            rng = shorthand.pop("rng", None)
            return cls.of(**shorthand, rng=True if rng is None else rng)
        if not isinstance(state, TrainingState):
            raise TypeError(
                f"state must be a ddpckpt.TrainingState, got {type(state).__qualname__}; wrap a "
                "mapping of names to objects as ddpckpt.TrainingState(mapping)"
            )
        if given:
            raise TypeError(
                f"pass either a TrainingState or {', '.join(f'{k}=' for k in given)}, not both"
            )
        return state

    @property
    def single_model_layout(self) -> bool:
        """Whether this state fits the format-2 layout: one model called ``model`` and at
        most one object of each other role, under the shorthand's names."""
        if list(self.models) != ["model"]:
            return False
        return all(
            set(getattr(self, role)) <= {name}
            for role, name in SHORTHAND_NAMES.items()
            if role != "models"
        )

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer of the state, including those kept as ``extra`` objects."""
        extras = [o for o in self.extra.values() if isinstance(o, torch.optim.Optimizer)]
        return [*self.optimizers.values(), *extras]

    def set_value(self, name: str, value: Any) -> None:
        """Write a loaded plain ``extra`` value back (here and in the source mapping)."""
        self.extra[name] = value
        if self._source is not None:
            self._source[name] = value

    def _check_distinct_models(self) -> None:
        from ddpckpt._training.wrappers import unwrap_model

        seen: dict[int, str] = {}
        for name, model in self.models.items():
            root = id(unwrap_model(model))
            if root in seen:
                raise ValueError(
                    f"TrainingState: models {seen[root]!r} and {name!r} are the same module "
                    "(one may wrap the other); keep one of them"
                )
            seen[root] = name

    def _check_schedulers(self) -> None:
        """A scheduler's learning rates live in its optimizer's param groups: without that
        optimizer a resume restores the scheduler's position but not the rates it set."""
        groups = {id(g) for opt in self.all_optimizers() for g in opt.param_groups}
        in_extra = {n: o for n, o in self.extra.items() if role_of(o) == "schedulers"}
        for name, scheduler in {**self.schedulers, **in_extra}.items():
            optimizer = getattr(scheduler, "optimizer", None)
            if not isinstance(optimizer, torch.optim.Optimizer):
                continue  # another library's scheduler may keep something else there
            if all(id(g) in groups for g in optimizer.param_groups):
                continue
            raise InexactResumeError(
                f"TrainingState: scheduler {name!r} adjusts a {type(optimizer).__qualname__} "
                "that is not in the state, so a resume would restore the scheduler but not the "
                "learning rates it set; add that optimizer (optimizer=..., or a named entry)"
            )

    def _items(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for role in ROLES:
            for name, obj in getattr(self, role).items():
                merged.setdefault(name, obj)
        return merged

    def __getitem__(self, name: str) -> Any:
        for role in ROLES:
            part = getattr(self, role)
            if name in part:
                return part[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        parts = [f"{role}={list(getattr(self, role))}" for role in ROLES if getattr(self, role)]
        return f"TrainingState({', '.join(parts)}, rng={self.rng})"


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"TrainingState names must be non-empty strings without '/', got {name!r}")


def _adopt_loaders(extra: Mapping[str, Any]) -> None:
    """Track the DataLoaders of ``extra`` now, before the loop iterates them (see
    :mod:`ddpckpt._training.loader`); one already partway through a pass makes its save raise."""
    from ddpckpt._training.loader import adopt_loaders

    adopt_loaders(extra, idle_only=True)


def _refuse_several(**shorthand: Any) -> None:
    """Each keyword of the shorthand names one object: a list of them (two optimizers) would
    otherwise fail later as an AttributeError that does not say what to do."""
    for keyword, obj in shorthand.items():
        if isinstance(obj, (list, tuple)):
            raise TypeError(
                f"{keyword}= takes one object, got a {type(obj).__name__} of {len(obj)}; name "
                "each one in a ddpckpt.TrainingState instead, e.g. TrainingState(model=model, "
                "opt_body=opt_body, opt_head=opt_head, sched_body=..., sched_head=...), and "
                "pass it where the keywords went"
            )
