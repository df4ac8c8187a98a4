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
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsupportedValueError

__all__ = ["JSON", "decode", "encode"]

JSON = Any  # a value json.dumps accepts: None, bool, int, float, str, list, dict[str, JSON]

_SCALARS = (type(None), bool, int, str)


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
        pairs = [
            [self.encode(k, f"{path}/<key {k!r}>"), self.encode(v, f"{path}/{k}")]
            for k, v in value.items()
        ]
        return {"$odict" if ordered else "$dict": pairs}

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
            pairs = [(self._decode_key(k), self.decode(v)) for k, v in arg]
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
        raise self._bad(f"unknown tag {tag!r}")

    def _decode_key(self, key: JSON) -> Any:
        value = self.decode(key)
        if isinstance(value, list):  # only hashable values can be keys; a list never is
            raise self._bad("a dict key or set member decodes to a list")
        return value
