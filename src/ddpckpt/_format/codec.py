"""Pickle-free encoding of nested training state.

A state dict is a tree of dicts, lists, tuples, numbers, strings and tensors. :func:`encode`
turns it into a JSON-able tree in which every tensor is replaced by a reference
``{"$tensor": name}`` and collected into a flat ``{name: tensor}`` table; :func:`decode`
reverses it exactly: a tuple stays a tuple, an ``int`` key stays an ``int``, ``nan`` stays
``nan``.

Only exact built-in types and a few well-known ones are accepted. Anything else raises
:class:`~ddpckpt.errors.UnsupportedValueError` naming the key, because storing it would
need pickle and loading it would run code.

Tags (a JSON object with a single ``$``-key): ``$tensor``, ``$ndarray`` (a numpy array,
stored as a tensor), ``$tuple``, ``$dict`` (keys that are not plain strings),
``$odict``, ``$set``, ``$frozenset``, ``$float`` (nan/inf), ``$complex``, ``$bytes``,
``$npscalar``, ``$dtype``, ``$device``, ``$size``. A plain dict whose keys start with
``$`` is stored as ``$dict`` so it can never be mistaken for a tag.

Format version 2 adds ``$counter`` (``collections.Counter``, e.g. ``MultiStepLR``'s
milestones), ``$defaultdict`` (with a built-in default factory), ``$deque`` and ``$enum``.
Decoding reconstructs only these known types: an enum member is looked up by name in its
class, which must already be imported (loading never imports a module or calls a
constructor that user code could define).
"""

from __future__ import annotations

import base64
import enum
import math
import sys
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpckpt.errors import CorruptCheckpointError, UnsupportedValueError

JSON = Any  # a value json.dumps accepts: None, bool, int, float, str, list, dict[str, JSON]

_SCALARS = (type(None), bool, int, str)

# The only default factories a stored defaultdict may have: built-in types, never a lambda.
_FACTORIES: dict[str, type] = {
    t.__name__: t
    for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
} | {"OrderedDict": OrderedDict, "Counter": Counter, "deque": deque}


def encode(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> JSON:
    """Encode ``value`` as a JSON-able tree, adding its tensors to ``tensors``.

    Tensors are named by their path below ``prefix`` (``"optimizer/state/fc.weight/exp_avg"``);
    a name already in ``tensors`` gets a ``#n`` suffix. Raises
    :class:`UnsupportedValueError` naming the path of the first value that cannot be stored.
    """
    return _Encoder(tensors).encode(value, prefix)


def decode(tree: JSON, tensor: Callable[[str], torch.Tensor], *, where: str = "") -> Any:
    """Rebuild the value :func:`encode` produced; ``tensor(name)`` supplies each tensor.

    ``where`` names the checkpoint in error messages about a malformed tree.
    """
    return _Decoder(tensor, where).decode(tree)


class _Encoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def _add_tensor(self, path: str, tensor: torch.Tensor) -> str:
        name, n = path, 1
        while name in self.tensors:
            name = f"{path}#{n}"
            n += 1
        self.tensors[name] = tensor
        return name

    def encode(self, value: Any, path: str) -> JSON:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is float:
            if math.isfinite(value):
                return value
            return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._add_tensor(path, value)}
        if kind is list:
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if kind is torch.Size:
            return {"$size": list(value)}
        if kind is dict or kind is OrderedDict:
            return self._encode_mapping(value, path, ordered=kind is OrderedDict)
        if kind is Counter:
            return {"$counter": self._encode_pairs(value, path)}
        if kind is defaultdict:
            return {
                "$defaultdict": [self._factory_name(value, path), self._encode_pairs(value, path)]
            }
        if kind is deque:
            items = [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
            return {"$deque": [items, value.maxlen]}
        if isinstance(value, enum.Enum):
            return {"$enum": _enum_reference(value, path)}
        if kind is set or kind is frozenset:
            items = [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
            return {"$set" if kind is set else "$frozenset": items}
        if kind is complex:
            return {"$complex": [self.encode(value.real, path), self.encode(value.imag, path)]}
        if kind is bytes:
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"$device": str(value)}
        if kind.__module__ == "numpy":
            return self._encode_numpy(value, path)
        raise UnsupportedValueError(
            f"{path or '<root>'}: cannot store a value of type {kind.__module__}.{kind.__qualname__} "
            "without pickle. Store tensors, numbers, strings, bools, None, lists, tuples and "
            "dicts; give custom objects state_dict()/load_state_dict() methods that return "
            "such values."
        )

    def _encode_mapping(self, value: Mapping[Any, Any], path: str, ordered: bool) -> JSON:
        plain = not ordered and all(type(k) is str and not k.startswith("$") for k in value)
        if plain:
            return {k: self.encode(v, f"{path}/{k}") for k, v in value.items()}
        return {"$odict" if ordered else "$dict": self._encode_pairs(value, path)}

    def _encode_pairs(self, value: Mapping[Any, Any], path: str) -> JSON:
        return [
            [self.encode(k, f"{path}/<key {k!r}>"), self.encode(v, f"{path}/{k}")]
            for k, v in value.items()
        ]

    @staticmethod
    def _factory_name(value: defaultdict[Any, Any], path: str) -> str | None:
        factory = value.default_factory
        if factory is None:
            return None
        name = getattr(factory, "__name__", None)
        if name in _FACTORIES and _FACTORIES[name] is factory:
            return name
        raise UnsupportedValueError(
            f"{path}: cannot store a defaultdict whose default_factory is {factory!r} without "
            f"pickle; use one of {', '.join(sorted(_FACTORIES))}, or store dict(value) and "
            "rebuild the defaultdict in load_state_dict()."
        )

    def _encode_numpy(self, value: Any, path: str) -> JSON:
        import numpy as np

        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise UnsupportedValueError(
                    f"{path}: numpy arrays of Python objects cannot be stored without pickle"
                )
            array = np.ascontiguousarray(value)
            try:
                as_tensor = torch.from_numpy(array.copy())
            except TypeError as exc:
                raise UnsupportedValueError(
                    f"{path}: numpy dtype {value.dtype} has no torch equivalent ({exc})"
                ) from exc
            return {"$ndarray": self._add_tensor(path, as_tensor)}
        if isinstance(value, np.generic) and value.dtype != object:
            return {"$npscalar": [value.dtype.str, self.encode(value.item(), path)]}
        raise UnsupportedValueError(f"{path}: cannot store numpy value of type {type(value)}")


class _Decoder:
    def __init__(self, tensor: Callable[[str], torch.Tensor], where: str) -> None:
        self.tensor = tensor
        self.where = where

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: malformed state tree: {what}")

    def decode(self, tree: JSON) -> Any:
        kind = type(tree)
        if kind in _SCALARS or kind is float:
            return tree
        if kind is list:
            return [self.decode(v) for v in tree]
        if kind is not dict:
            raise self._bad(f"unexpected JSON value of type {kind.__name__}")
        if len(tree) == 1:
            ((tag, arg),) = tree.items()
            if tag.startswith("$"):
                return self._decode_tag(tag, arg)
        return {k: self.decode(v) for k, v in tree.items()}

    def _decode_tag(self, tag: str, arg: JSON) -> Any:
        if tag == "$tensor":
            return self.tensor(arg)
        if tag == "$tuple":
            return tuple(self.decode(v) for v in arg)
        if tag in ("$dict", "$odict"):
            pairs = self._decode_pairs(arg)
            return OrderedDict(pairs) if tag == "$odict" else dict(pairs)
        if tag == "$float":
            return float(arg)
        if tag == "$set":
            return {self._decode_key(v) for v in arg}
        if tag == "$frozenset":
            return frozenset(self._decode_key(v) for v in arg)
        if tag == "$complex":
            return complex(self.decode(arg[0]), self.decode(arg[1]))
        if tag == "$bytes":
            return base64.b64decode(arg)
        if tag == "$dtype":
            dtype = getattr(torch, arg, None)
            if not isinstance(dtype, torch.dtype):
                raise self._bad(f"unknown torch dtype {arg!r}")
            return dtype
        if tag == "$device":
            return torch.device(arg)
        if tag == "$size":
            return torch.Size(arg)
        if tag == "$ndarray":
            return self.tensor(arg).numpy().copy()
        if tag == "$npscalar":
            import numpy as np

            dtype_str, item = arg
            return np.dtype(dtype_str).type(self.decode(item))
        return self._decode_collection(tag, arg)

    def _decode_collection(self, tag: str, arg: JSON) -> Any:
        if tag == "$counter":
            return Counter(dict(self._decode_pairs(arg)))
        if tag == "$defaultdict":
            factory_name, pairs = arg
            if factory_name is not None and factory_name not in _FACTORIES:
                raise self._bad(f"defaultdict factory {factory_name!r} is not a built-in type")
            factory = None if factory_name is None else _FACTORIES[factory_name]
            return defaultdict(factory, self._decode_pairs(pairs))
        if tag == "$deque":
            items, maxlen = arg
            return deque((self.decode(v) for v in items), maxlen)
        if tag == "$enum":
            return self._decode_enum(*arg)
        raise self._bad(
            f"unknown tag {tag!r}: the checkpoint was written by a newer ddpckpt; upgrade to load it"
        )

    def _decode_pairs(self, pairs: JSON) -> list[tuple[Any, Any]]:
        return [(self._decode_key(k), self.decode(v)) for k, v in pairs]

    def _decode_enum(self, module: str, qualname: str, name: str) -> enum.Enum:
        where = f"{self.where}: " if self.where else ""
        found = _find_enum(module, qualname)
        if found is None:
            raise UnsupportedValueError(
                f"{where}the checkpoint holds a member of the enum {module}.{qualname}, which is "
                f"not defined in this process: import {module} before loading (ddpckpt never "
                "imports modules while loading)."
            )
        member = vars(found)["_member_map_"].get(name)
        if member is None:
            raise UnsupportedValueError(
                f"{where}the enum {module}.{qualname} has no member {name!r} any more: the "
                "checkpoint holds it; restore the member or convert the stored value."
            )
        return member

    def _decode_key(self, key: JSON) -> Any:
        value = self.decode(key)
        if isinstance(value, list):  # only hashable values can be keys; a list never is
            raise self._bad("a dict key or set member decodes to a list")
        return value


def _find_enum(module: str, qualname: str) -> type[enum.Enum] | None:
    """The enum class ``module.qualname`` if already imported; looks only in namespaces.

    ``vars()`` lookups run no module ``__getattr__``, no import and no metaclass code; a
    class with its own metaclass is refused, since its attribute access could run code.
    """
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if found is None:
            return None
        found = vars(found).get(part)
    if isinstance(found, type) and type(found) is enum.EnumMeta and issubclass(found, enum.Enum):
        return found
    return None


def _enum_reference(member: enum.Enum, path: str) -> JSON:
    cls = type(member)
    module, qualname, name = cls.__module__, cls.__qualname__, member.name
    if _find_enum(module, qualname) is not cls or vars(cls)["_member_map_"].get(name) is not member:
        raise UnsupportedValueError(
            f"{path}: cannot store the enum value {member!r}: only members of enums defined at "
            "module level (not inside a function, no custom metaclass, no combined flags) can "
            "be stored without pickle; store member.value or member.name instead."
        )
    return [module, qualname, name]
