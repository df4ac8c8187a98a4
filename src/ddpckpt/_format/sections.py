"""A manifest's ``state``, typed: each object's section (a model's, an optimizer's, a
scheduler's or scaler's, an ``extra`` entry, a saved dict) read from its JSON with every
field checked, in either layout of :mod:`ddpckpt._format.statelayout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._format.codec import JSON
from ddpckpt._format.statelayout import (
    DICT_KEY,
    ROLE_KEYS,
    SINGLE,
    Layout,
    layout_of,
    named_sections,
)
from ddpckpt.errors import CorruptCheckpointError

_REQUIRED = object()


class _Reader:
    """Reads fields of a section, raising :class:`CorruptCheckpointError` naming where."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where}: malformed manifest: not a JSON object")
        self.doc, self.where = doc, where

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        if key not in self.doc:
            if default is _REQUIRED:
                raise CorruptCheckpointError(f"{self.where}: malformed manifest: no {key!r}")
            return default
        value = self.doc[key]
        if not isinstance(value, kind):
            raise CorruptCheckpointError(
                f"{self.where}: malformed manifest: {key!r} is a {type(value).__name__}"
            )
        return value

    def strings(self, key: str, default: Any = _REQUIRED) -> Any:
        """A list of strings."""
        value = self.get(key, list, default)
        if value is not default and not all(isinstance(v, str) for v in value):
            raise CorruptCheckpointError(
                f"{self.where}: malformed manifest: {key!r} holds something else than strings"
            )
        return value

    def mapping_of(self, key: str, check: Any, what: str, default: Any = _REQUIRED) -> Any:
        """A dict whose values pass ``check`` (``what`` says what they must be)."""
        value = self.get(key, dict, default)
        if value is not default and not all(check(v) for v in value.values()):
            raise CorruptCheckpointError(
                f"{self.where}: malformed manifest: {key!r} maps to something else than {what}"
            )
        return value


def _is_device(value: Any) -> bool:
    """Whether ``value`` names a device (``"cuda:1"``; this machine may lack it)."""
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return isinstance(value, str)


def _is_plain_object(value: Any) -> bool:
    """A JSON object the codec decodes as a dict of string keys (no ``$``-tag)."""
    return isinstance(value, dict) and not any(k.startswith("$") for k in value)


def _is_shape(value: Any) -> bool:
    return value is None or (
        isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)
    )


BUCKET_STATES = ("none", "initial", "rebuilt", "unsettled")


@dataclass
class DDPBuckets:
    """How DDP grouped a model's gradients into all-reduce buckets when it was saved.

    ``state`` is ``"none"`` (no DDP reducer: a plain model), ``"initial"`` (the layout DDP
    builds at construction, which a new DDP reproduces), ``"rebuilt"`` (``buckets``: each
    bucket's parameters by canonical name, in their order in the bucket),
    ``"unsettled"`` (DDP had begun its first steps but not yet rebuilt its buckets: not
    reproducible), or ``"unrecorded"`` (a checkpoint written before ddpckpt recorded it;
    never written). ``grad_views``: under ``gradient_as_bucket_view=True``, every gradient
    was a view into the buckets (they stay so under ``zero_grad(set_to_none=False)``).
    See :mod:`ddpckpt._state.ddp_buckets`.
    """

    state: str
    buckets: list[list[str]] = field(default_factory=list)
    grad_views: bool = False

    def to_json(self) -> dict[str, JSON]:
        doc: dict[str, JSON] = {"state": self.state}
        if self.state == "rebuilt":
            doc["buckets"] = self.buckets
        if self.grad_views:
            doc["grad_views"] = True
        return doc

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> DDPBuckets:
        r = _Reader(doc, where)
        state = r.get("state", str)
        if state not in BUCKET_STATES:
            raise CorruptCheckpointError(f"{where}: malformed manifest: unknown state {state!r}")
        buckets = r.get("buckets", list, []) if state == "rebuilt" else []
        if not all(isinstance(b, list) and all(isinstance(n, str) for n in b) for b in buckets):
            raise CorruptCheckpointError(f"{where}: malformed manifest: buckets not name lists")
        return cls(state, [list(b) for b in buckets], bool(r.get("grad_views", bool, False)))


@dataclass
class ModelSection:
    """A model: its class (the user's, not FSDP2's dynamic subclass), stored keys, tied
    aliases, module versions, non-tensor extra state, the DDP gradient bucket layout it
    trained with, and what made its parameters DTensors (``"FSDP2"``, ``"replicate()"``)."""

    type: str
    keys: list[str]
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> key stored
    versions: dict[str, int] = field(default_factory=dict)  # module path -> version
    extra_keys: list[str] = field(default_factory=list)
    extra_state: JSON | None = None  # the encoded values of ``extra_keys``
    ddp_buckets: DDPBuckets = field(default_factory=lambda: DDPBuckets("unrecorded"))
    wrapped_by: str | None = None

    def to_json(self) -> dict[str, JSON]:
        doc: dict[str, JSON] = {"type": self.type, "keys": self.keys, "aliases": self.aliases,
                                "versions": self.versions, "extra_keys": self.extra_keys}  # fmt: skip
        if self.extra_state is not None:
            doc["extra_state"] = self.extra_state
        if self.ddp_buckets.state != "unrecorded":
            doc["ddp_buckets"] = self.ddp_buckets.to_json()
        if self.wrapped_by is not None:
            doc["wrapped_by"] = self.wrapped_by
        return doc

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> ModelSection:
        r = _Reader(doc, where)
        buckets = r.get("ddp_buckets", dict, None)
        return cls(r.get("type", str), list(r.strings("keys")),
                   dict(r.mapping_of("aliases", lambda v: isinstance(v, str), "names")),
                   dict(r.mapping_of("versions", lambda v: type(v) is int, "integers")),
                   list(r.strings("extra_keys")), r.get("extra_state", object, None),
                   DDPBuckets("unrecorded") if buckets is None else DDPBuckets.from_json(
                       buckets, f"{where} (ddp_buckets)"),
                   r.get("wrapped_by", str, None))  # fmt: skip


@dataclass
class ParamGroup:
    """One optimizer param group: its parameters' names and its encoded hyperparameters."""

    params: list[str]
    hyper: JSON


@dataclass
class ZeroPartition:
    """How a ``ZeroRedundancyOptimizer`` split its parameters when saved: ``ranks[g][i]``
    owned parameter ``i`` of param group ``g`` (informative: loading follows the live
    partition)."""

    world_size: int
    ranks: list[list[int]]

    def to_json(self) -> dict[str, JSON]:
        return {"world_size": self.world_size, "ranks": self.ranks}

    @classmethod
    def from_json(cls, doc: JSON, groups: list[ParamGroup], where: str) -> ZeroPartition:
        r = _Reader(doc, where)
        world, ranks = r.get("world_size", int), r.get("ranks", list)
        fits = len(ranks) == len(groups) and all(
            isinstance(owners, list)
            and len(owners) == len(group.params)
            and all(type(o) is int and 0 <= o < world for o in owners)
            for owners, group in zip(ranks, groups, strict=False)
        )
        if type(world) is not int or world < 1 or not fits:
            raise CorruptCheckpointError(
                f"{where}: malformed manifest: the ZeRO partition does not fit the param groups"
            )
        return cls(world, [list(owners) for owners in ranks])


@dataclass
class OptimizerSection:
    """An optimizer: param groups and per-parameter state, keyed by parameter name.

    ``state`` is encoded (:mod:`ddpckpt._format.codec`); ``placement`` and ``own_dtype``
    say where its tensors lived (absent before format 2); ``by_position`` marks state
    imported from a ``torch.save`` file, keyed by position; ``zero`` the partition of a
    ``ZeroRedundancyOptimizer``, whose ``type`` is its local optimizer's; ``groups_rebuilt``
    marks param groups an import rebuilt from each parameter's hyperparameters (torchtitan's
    flattened state records no group order): they are matched to the live optimizer's groups
    by their parameters, not by position.
    """

    type: str
    groups: list[ParamGroup]
    state: JSON
    shapes: dict[str, list[int] | None]
    placement: dict[str, str] | None = None
    own_dtype: list[str] | None = None
    by_position: bool = False
    zero: ZeroPartition | None = None
    groups_rebuilt: bool = False

    def to_json(self) -> dict[str, JSON]:
        doc: dict[str, JSON] = {
            "type": self.type,
            "groups": [{"params": g.params, "hyper": g.hyper} for g in self.groups],
            "state": self.state,
            "shapes": self.shapes,
        }
        if self.placement is not None:
            doc["placement"] = self.placement
        if self.own_dtype is not None:
            doc["own_dtype"] = self.own_dtype
        if self.by_position:
            doc["by_position"] = True
        if self.zero is not None:
            doc["zero"] = self.zero.to_json()
        if self.groups_rebuilt:
            doc["groups_rebuilt"] = True
        return doc

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> OptimizerSection:
        r = _Reader(doc, where)
        groups = []
        for g, group in enumerate(r.get("groups", list)):
            gr = _Reader(group, f"{where} (param group {g})")
            groups.append(ParamGroup(list(gr.strings("params")), gr.get("hyper", dict)))
        per_parameter = r.mapping_of("state", _is_plain_object, "a JSON object per parameter")
        shapes = dict(r.mapping_of("shapes", _is_shape, "shapes"))
        if any(p not in shapes for g in groups for p in g.params):
            raise CorruptCheckpointError(f"{where}: malformed manifest: a parameter has no shape")
        zero = r.get("zero", dict, None)
        return cls(r.get("type", str), groups, per_parameter, shapes,
                   r.mapping_of("placement", lambda v: v in ("param", "host"), "places", None),
                   r.strings("own_dtype", None),
                   bool(r.get("by_position", bool, False)),
                   None if zero is None else ZeroPartition.from_json(zero, groups, where),
                   bool(r.get("groups_rebuilt", bool, False)))  # fmt: skip


@dataclass
class StatefulSection:
    """A scheduler or scaler: its type and encoded ``state_dict()``."""

    type: str
    state: JSON

    def to_json(self) -> dict[str, JSON]:
        return {"type": self.type, "state": self.state}

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> StatefulSection:
        r = _Reader(doc, where)
        return cls(r.get("type", str), r.get("state", object))


EXTRA_KINDS = ("value", "stateful", "per_rank")


@dataclass
class ExtraEntry:
    """One ``extra`` entry: a plain value, a shared stateful object, or per-rank state
    (whose state is in each rank's part of the manifest)."""

    kind: str  # one of EXTRA_KINDS
    type: str | None = None  # the object's type; a plain value has none
    state: JSON = None  # the encoded value or state_dict(); none for per_rank

    def to_json(self) -> dict[str, JSON]:
        doc: dict[str, JSON] = {"kind": self.kind}
        if self.type is not None:
            doc["type"] = self.type
        if self.kind != "per_rank":
            doc["state"] = self.state
        return doc

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> ExtraEntry:
        r = _Reader(doc, where)
        kind = r.get("kind", str)
        if kind not in EXTRA_KINDS:
            raise CorruptCheckpointError(f"{where}: malformed manifest: unknown kind {kind!r}")
        state = None if kind == "per_rank" else r.get("state", object)
        return cls(kind, r.get("type", str, None), state)


@dataclass
class DictSection:
    """A dict saved by :func:`ddpckpt.save_dict`: the encoded tree and the device each
    tensor was saved from (only those not on the CPU)."""

    tree: JSON
    devices: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSON]:
        return {"tree": self.tree, "devices": self.devices}

    @classmethod
    def from_json(cls, doc: JSON, where: str) -> DictSection:
        r = _Reader(doc, where)
        devices = r.mapping_of("devices", _is_device, "device names")
        return cls(r.get("tree", object), dict(devices))


_TYPES: dict[str, Any] = {"models": ModelSection, "optimizers": OptimizerSection,
                          "schedulers": StatefulSection, "scalers": StatefulSection}  # fmt: skip


@dataclass
class StateSections:
    """A manifest's ``state``, typed: each role's sections by name, ``extra`` entries, or
    the one dict of :func:`ddpckpt.save_dict`; ``layout`` says how it is written."""

    layout: Layout = SINGLE
    models: dict[str, ModelSection] = field(default_factory=dict)
    optimizers: dict[str, OptimizerSection] = field(default_factory=dict)
    schedulers: dict[str, StatefulSection] = field(default_factory=dict)
    scalers: dict[str, StatefulSection] = field(default_factory=dict)
    extra: dict[str, ExtraEntry] = field(default_factory=dict)
    saved_dict: DictSection | None = None

    def to_json(self) -> dict[str, JSON]:
        """The manifest's ``state`` (see :mod:`ddpckpt._format.statelayout` for both
        layouts)."""
        doc: dict[str, JSON] = {}
        if self.saved_dict is not None:
            doc[DICT_KEY] = self.saved_dict.to_json()
        if self.layout.named:
            doc["models"] = {}  # present even when empty: it marks the layout
        for role, (single, named) in ROLE_KEYS.items():
            for name, section in getattr(self, role).items():
                if self.layout.named:
                    doc.setdefault(named, {})[name] = section.to_json()
                else:
                    doc[single] = section.to_json()
        if self.extra:
            doc["extra"] = {name: entry.to_json() for name, entry in self.extra.items()}
        return doc

    @classmethod
    def from_json(cls, state: Mapping[str, Any], where: str) -> StateSections:
        """Parse a manifest's ``state``; raises :class:`CorruptCheckpointError` naming the
        malformed section."""
        layout = layout_of(state)
        sections = cls(layout)
        for role, (single, named) in ROLE_KEYS.items():
            parse = _TYPES[role].from_json
            if layout.named and not isinstance(state.get(named, {}), dict):
                raise CorruptCheckpointError(f"{where}: malformed manifest: {named} not a dict")
            found = named_sections(state, role)
            parsed = {n: parse(doc, f"{where}: {single} {n!r}") for n, doc in found.items()}
            setattr(sections, role, parsed)
        extra = state.get("extra", {})
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{where}: malformed manifest: extra not a dict")
        sections.extra = {n: ExtraEntry.from_json(e, f"{where}: extra[{n!r}]")
                          for n, e in extra.items()}  # fmt: skip
        if DICT_KEY in state:
            sections.saved_dict = DictSection.from_json(state[DICT_KEY], f"{where}: dict")
        return sections

    def place(self, role: str, name: str, section: Any) -> None:
        """Add the section of the object ``name`` of ``role``."""
        getattr(self, role)[name] = section
