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
import binascii
import enum
import math
import sys
import types
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping, Sized
from typing import Any

import torch

from ddpckpt._format.boundary import MAX_VALUE_DEPTH
from ddpckpt.errors import CorruptCheckpointError, UnsupportedValueError

JSON = Any  # a value json.dumps accepts: None, bool, int, float, str, list, dict[str, JSON]

_SCALARS = (type(None), bool, int, str)
# Containers and the JSON levels each puts around its items: {"$tuple": [...]} is two,
# {"$dict": [[key, value], ...]} three (a plain dict with string keys, like a list, one).
_CONTAINERS: dict[type, int] = {
    list: 1, tuple: 2, dict: 3, OrderedDict: 3, Counter: 3, defaultdict: 4, deque: 3,
    set: 2, frozenset: 2, complex: 2,
}  # fmt: skip
_MAPPINGS = (dict, OrderedDict, Counter, defaultdict, complex)

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
    return _Decoder(tensor, lambda name: tensor(name).numpy().copy(), where).decode(tree)


class TensorRef(str):
    """A tensor's name in a tree :func:`decode_refs` rebuilt: the caller reads it later."""


def decode_refs(tree: JSON, array: Callable[[str], Any], *, where: str = "") -> Any:
    """:func:`decode`, each tensor left as a :class:`TensorRef` for the caller to read once
    it knows where (one at a time, into its destination); a numpy array's values are part of
    the value rebuilt, so ``array(name)`` reads them now."""
    return _Decoder(TensorRef, array, where).decode(tree)


class _Encoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.depth = 0  # JSON containers around the value being encoded

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
        if kind in _CONTAINERS:
            return self._encode_container(value, kind, path)
        if kind is torch.Size:
            return {"$size": list(value)}
        if isinstance(value, enum.Enum):
            return {"$enum": _enum_reference(value, path)}
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

    def _encode_container(self, value: Any, kind: type, path: str) -> JSON:
        """A container, nested at most ``MAX_VALUE_DEPTH`` JSON levels deep (what a load
        reads back)."""
        plain = kind is dict and all(type(k) is str and not k.startswith("$") for k in value)
        levels = 1 if plain or kind is list else _CONTAINERS[kind]
        self.depth += levels
        if self.depth > MAX_VALUE_DEPTH:
            raise UnsupportedValueError(
                f"{path}: nested deeper than the {MAX_VALUE_DEPTH} levels a checkpoint holds; "
                "flatten the value, or store it as a tensor"
            )
        items = (
            []
            if kind in _MAPPINGS
            else [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        )
        if plain:
            encoded: JSON = {k: self.encode(v, f"{path}/{k}") for k, v in value.items()}
        elif kind is list:
            encoded = items
        elif kind is tuple:
            encoded = {"$tuple": items}
        elif kind in (dict, OrderedDict):
            encoded = {
                "$odict" if kind is OrderedDict else "$dict": self._encode_pairs(value, path)
            }
        elif kind is Counter:
            encoded = {"$counter": self._encode_pairs(value, path)}
        elif kind is defaultdict:
            encoded = {
                "$defaultdict": [self._factory_name(value, path), self._encode_pairs(value, path)]
            }
        elif kind is deque:
            encoded = {"$deque": [items, value.maxlen]}
        elif kind is complex:
            encoded = {"$complex": [self.encode(value.real, path), self.encode(value.imag, path)]}
        else:  # set, frozenset
            encoded = {"$set" if kind is set else "$frozenset": items}
        self.depth -= levels
        return encoded

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
    """Rebuilds a tree read from a checkpoint: every tag's argument is checked for the shape
    :class:`_Encoder` gives it, so a malformed tree raises :class:`CorruptCheckpointError`
    naming the checkpoint, never another error; nesting is capped (``MAX_VALUE_DEPTH``
    containers), so the recursion is bounded whatever the tree."""

    def __init__(
        self, tensor: Callable[[str], object], array: Callable[[str], Any], where: str
    ) -> None:
        self.tensor = tensor
        self.array = array
        self.where = where
        self.depth = 0

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: malformed state tree: {what}")

    def decode(self, tree: JSON) -> Any:
        kind = type(tree)
        if kind in _SCALARS or kind is float:
            return tree
        if kind is not list and kind is not dict:
            raise self._bad(f"unexpected JSON value of type {kind.__name__}")
        self.depth += 1
        if self.depth > MAX_VALUE_DEPTH:
            raise self._bad(f"nested deeper than {MAX_VALUE_DEPTH} levels")
        try:
            if kind is list:
                return [self.decode(v) for v in tree]
            if len(tree) == 1:
                ((tag, arg),) = tree.items()
                if tag.startswith("$"):
                    return self._decode_tag(tag, arg)
            return {k: self.decode(v) for k, v in tree.items()}
        finally:
            self.depth -= 1

    def _arg(self, tag: str, arg: JSON, kind: type[Sized], length: int | None = None) -> Any:
        """``arg`` if it is a ``kind`` (of ``length`` items, for a list)."""
        if type(arg) is not kind or (length is not None and len(arg) != length):
            shape = f"a {kind.__name__}" + (f" of {length}" if length is not None else "")
            raise self._bad(f"{tag} holds {type(arg).__name__}, not {shape}")
        return arg

    def _decode_tag(self, tag: str, arg: JSON) -> Any:
        scalar = _SCALAR_TAGS.get(tag)
        if scalar is not None:
            return scalar(self, tag, arg)
        if tag == "$tensor":
            return self.tensor(self._arg(tag, arg, str))
        if tag == "$tuple":
            return tuple(self.decode(v) for v in self._arg(tag, arg, list))
        if tag in ("$dict", "$odict"):
            pairs = self._decode_pairs(tag, arg)
            return OrderedDict(pairs) if tag == "$odict" else dict(pairs)
        if tag == "$set":
            return {self._decode_key(tag, v) for v in self._arg(tag, arg, list)}
        if tag == "$frozenset":
            return frozenset(self._decode_key(tag, v) for v in self._arg(tag, arg, list))
        if tag == "$complex":
            real, imag = (self.decode(v) for v in self._arg(tag, arg, list, 2))
            if not all(type(v) in (int, float) for v in (real, imag)):
                raise self._bad("$complex holds parts that are no numbers")
            return complex(real, imag)
        if tag == "$ndarray":
            return self.array(self._arg(tag, arg, str))
        if tag == "$npscalar":
            return self._decode_npscalar(tag, arg)
        return self._decode_collection(tag, arg)

    def _decode_npscalar(self, tag: str, arg: JSON) -> Any:
        import numpy as np

        dtype_str, item = self._arg(tag, arg, list, 2)
        try:
            dtype = np.dtype(self._arg(tag, dtype_str, str))
        except (TypeError, ValueError):
            raise self._bad(f"$npscalar names no numpy dtype ({dtype_str[:40]!r})") from None
        value = self.decode(item)
        if dtype.shape or not isinstance(value, _NUMPY_ITEMS.get(dtype.kind, ())):
            raise self._bad(f"$npscalar holds a {type(value).__name__} as a {dtype}")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError):
            raise self._bad(f"$npscalar: {value!r:.40} is no {dtype}") from None

    def _decode_collection(self, tag: str, arg: JSON) -> Any:
        if tag == "$counter":
            return Counter(dict(self._decode_pairs(tag, arg)))
        if tag == "$defaultdict":
            factory_name, pairs = self._arg(tag, arg, list, 2)
            if factory_name is not None and factory_name not in _FACTORIES:
                raise self._bad(
                    f"defaultdict factory {str(factory_name)[:40]!r} is not a built-in type"
                )
            factory = None if factory_name is None else _FACTORIES[factory_name]
            return defaultdict(factory, self._decode_pairs(tag, pairs))
        if tag == "$deque":
            items, maxlen = self._arg(tag, arg, list, 2)
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise self._bad(f"$deque has a maxlen of {maxlen!r:.40}")
            return deque((self.decode(v) for v in self._arg(tag, items, list)), maxlen)
        if tag == "$enum":
            parts = self._arg(tag, arg, list, 3)
            if not all(type(p) is str for p in parts):
                raise self._bad("$enum names its class and member with something else than strings")
            return self._decode_enum(*parts)
        raise self._bad(
            f"unknown tag {tag[:40]!r}: the checkpoint was written by a newer ddpckpt; upgrade to "
            "load it"
        )

    def _decode_pairs(self, tag: str, pairs: JSON) -> list[tuple[Any, Any]]:
        decoded = []
        for pair in self._arg(tag, pairs, list):
            key, value = self._arg(tag, pair, list, 2)
            decoded.append((self._decode_key(tag, key), self.decode(value)))
        return decoded

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

    def _decode_key(self, tag: str, key: JSON) -> Any:
        value = self.decode(key)
        try:
            hash(value)
        except TypeError:  # a list or dict: only hashable values can be keys or members
            raise self._bad(f"a {tag} key or member decodes to a {type(value).__name__}") from None
        return value


def _float(decoder: _Decoder, tag: str, arg: JSON) -> float:
    if arg not in ("nan", "inf", "-inf"):
        raise decoder._bad(f"$float holds {arg!r:.40}, not nan, inf or -inf")
    return float(arg)


def _bytes(decoder: _Decoder, tag: str, arg: JSON) -> bytes:
    try:
        return base64.b64decode(decoder._arg(tag, arg, str), validate=True)
    except binascii.Error:
        raise decoder._bad("$bytes holds no base64 text") from None


def _dtype(decoder: _Decoder, tag: str, arg: JSON) -> torch.dtype:
    dtype = _TORCH_DTYPES.get(decoder._arg(tag, arg, str))
    if dtype is None:
        raise decoder._bad(f"unknown torch dtype {arg[:40]!r}")
    return dtype


def _device(decoder: _Decoder, tag: str, arg: JSON) -> torch.device:
    try:
        return torch.device(decoder._arg(tag, arg, str))
    except RuntimeError:
        raise decoder._bad(f"$device holds {arg[:40]!r}, no device") from None


def _size(decoder: _Decoder, tag: str, arg: JSON) -> torch.Size:
    dims = decoder._arg(tag, arg, list)
    if not all(type(d) is int and 0 <= d < 2**63 for d in dims):
        raise decoder._bad("$size holds something else than sizes")
    return torch.Size(dims)


_SCALAR_TAGS: dict[str, Callable[[_Decoder, str, JSON], Any]] = {
    "$float": _float, "$bytes": _bytes, "$dtype": _dtype, "$device": _device, "$size": _size,
}  # fmt: skip
# The Python values a numpy scalar of each kind is rebuilt from (never an object, a void of
# a size the checkpoint chooses, or a sub-array).
_NUMPY_ITEMS: dict[str, tuple[type, ...]] = {
    "b": (bool,), "i": (int,), "u": (int,), "f": (int, float), "c": (int, float, complex),
    "U": (str,), "S": (bytes,),
}  # fmt: skip
# Looked up in torch's namespace only: getattr(torch, name) could import a lazy submodule.
_TORCH_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def _find_enum(module: str, qualname: str) -> type[enum.Enum] | None:
    """The enum class ``module.qualname`` if already imported; looks only in namespaces.

    ``vars()`` lookups run no module ``__getattr__``, no import and no metaclass code; a
    class with its own metaclass is refused, since its attribute access could run code.
    """
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if not isinstance(found, (type, types.ModuleType)):
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
