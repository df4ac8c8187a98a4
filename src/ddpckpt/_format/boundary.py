"""The trust boundary: what ddpckpt reads from a checkpoint or a run directory passes here
before anything uses it.

A checkpoint may come from anywhere (downloaded, copied between clusters, damaged by a
file system, crafted), so its bytes are untrusted input, parsed with explicit limits:

* files are opened only when they are regular files (a symbolic link, FIFO or device is
  refused by the storage without blocking, :class:`~ddpckpt.storage._errors.NotRegularFileError`),
  and small ones (manifest, ``latest``, ``run.json``, ``.lock``) are read only up to a cap
  checked against the opened file's size before reading (:func:`read_small`);
* JSON is parsed with caps on its size and nesting depth and with finite numbers only
  (:func:`load_json`);
* the names of a checkpoint's files follow the grammar of the names ddpckpt writes, so no
  name reaches outside the checkpoint directory (:func:`check_file_name`); every read and
  every write under such a name goes through it;
* fields are read with their types and ranges checked (:class:`Fields`).

Every violation raises :class:`~ddpckpt.errors.CorruptCheckpointError` naming the file and
the field. The writers keep within the same limits, so what ddpckpt writes it reads back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import xxhash

from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._errors import NotRegularFileError
from ddpckpt.storage._location import Location

MAX_MANIFEST_BYTES = 256 << 20
MAX_HEADER_BYTES = 100_000_000  # a safetensors header (the safetensors library's own cap)
MAX_RUN_FILE_BYTES = 1 << 20  # latest, run.json, .lock
MAX_JSON_DEPTH = 256  # nesting levels of any JSON document read
MAX_VALUE_DEPTH = 200  # of one encoded value (the rest is the manifest's own nesting)
MAX_INT = 2**63 - 1
MAX_RANKS = 1 << 20
MAX_DIMS = 64

_DATA_FILE = re.compile(
    r"(?:\.next-[0-9A-Za-z_-]{1,64}/)?"
    r"(?:(?:model|state|rank)-[0-9]{5,10}\.safetensors|(?:shards|files)-[0-9]{5,10}\.json)",
    re.ASCII,
)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"\\')
_NESTING = [{ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}.get(b, 0) for b in range(256)]


def check_file_name(name: object, where: str) -> str:
    """``name`` if it is a data file name ddpckpt writes (``model-00000.safetensors``,
    ``state-...``, ``rank-...``, a shard index ``shards-00000.json``, a file table
    ``files-00000.json``, optionally under an
    object store's ``.next-<token>/``);
    else :class:`CorruptCheckpointError`: nothing absolute, no ``..``, no other separator."""
    if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
        raise CorruptCheckpointError(
            f"{where}: the manifest names a file {str(name)[:200]!r}, which is no name ddpckpt "
            "writes (model-, state- or rank-NNNNN.safetensors, shards- or files-NNNNN.json, inside the "
            "checkpoint); refused"
        )
    return name


def read_small(location: Location, limit: int, what: str) -> bytes:
    """The bytes of the small file at ``location`` (``what`` names it in errors).

    Raises :class:`FileNotFoundError` if it is missing, :class:`CorruptCheckpointError` if
    it is no regular file or larger than ``limit`` bytes (checked before reading).
    """
    try:
        return read_bounded(location, limit, what)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{location}: the {what} is {exc.kind}; refused") from None


def read_listed(
    location: Location, size: int, digest: str, what: str, limit: int | None = None
) -> bytes:
    """The bytes of a file a manifest lists with ``size`` and xxh3-64 ``digest``, read as
    :func:`read_small` does (at most ``limit`` bytes, by default its listed size) and
    checked against both: :class:`CorruptCheckpointError` if they differ."""
    data = read_small(location, size if limit is None else min(size, limit), what)
    if len(data) != size or xxhash.xxh3_64(data).hexdigest() != digest:
        raise CorruptCheckpointError(f"{location}: file checksum mismatch (corrupt)")
    return data


def read_bounded(location: Location, limit: int, what: str) -> bytes:
    """As :func:`read_small`, but a location that is no regular file raises the storage's
    :class:`~ddpckpt.storage._errors.NotRegularFileError` (an :class:`OSError`): for files
    whose readers report I/O errors as such (the run's lock)."""
    reader = location.storage.open(location.path)
    try:
        if reader.size > limit:
            raise CorruptCheckpointError(
                f"{location}: the {what} is {reader.size} bytes, more than the {limit} a "
                f"{what} may have; refused"
            )
        return reader.read_all()
    finally:
        reader.close()


def open_checked(location: Location, what: str) -> Any:
    """A storage reader of the data file at ``location``; :class:`CorruptCheckpointError`
    if it is no regular file, :class:`FileNotFoundError` if it is missing."""
    try:
        return location.storage.open(location.path)
    except NotRegularFileError as exc:
        raise CorruptCheckpointError(f"{location}: the {what} is {exc.kind}; refused") from None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _depth(raw: bytes) -> int:
    """How deep the JSON text ``raw`` nests (brackets in strings ignored): one linear pass
    of C iterators, so a hostile document is measured without recursing into it (about
    25 ns a byte)."""
    # Only brackets, quotes and backslashes matter: dropped first (in C, fast), what is left
    # of strings after that (quotes and escapes) is then removed, then brackets are counted.
    brackets = _STRING.sub(b"", raw.translate(None, _NOT_STRUCTURE))
    return max(accumulate(map(_NESTING.__getitem__, brackets)), default=0)


def load_json(raw: bytes | str, where: str, what: str, *, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """Parse the JSON document ``raw`` (``what`` in ``where``) within the caps: size,
    nesting depth, finite numbers, integers of at most 4300 digits."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > limit:
        raise CorruptCheckpointError(
            f"{where}: the {what} is {len(data)} bytes, more than the {limit} allowed; refused"
        )
    if _depth(data) > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(
            f"{where}: the {what} nests deeper than {MAX_JSON_DEPTH} levels; refused"
        )
    try:
        return json.loads(data, parse_float=_finite, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(f"{where}: the {what} is not valid JSON ({exc})") from None


_REQUIRED: Any = object()


class Fields:
    """Reads the fields of one JSON object read from a file, checking types and ranges.

    ``where`` names the file, ``what`` the object in it (``"manifest"``, ``"tensor
    'fc.weight'"``, or a function giving it, called only for an error); every error names
    both and the field.
    """

    def __init__(self, doc: Any, where: str, what: str | Callable[[], str]) -> None:
        self.where, self.what = where, what
        if not isinstance(doc, dict):
            raise self.error(f"is {_kind(doc)}, not a JSON object")
        self.doc: dict[str, Any] = doc

    def error(self, problem: str, key: str | None = None) -> CorruptCheckpointError:
        field = f" field {key!r}" if key is not None else ""
        what = self.what() if callable(self.what) else self.what
        return CorruptCheckpointError(f"{self.where}: malformed {what}:{field} {problem}")

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of ``key``, of any type: ``default`` if absent (a missing field
        without one is :class:`CorruptCheckpointError` naming the file and the field)."""
        return self._get(key, default)

    def _get(self, key: str, default: Any) -> Any:
        if key not in self.doc:
            if default is _REQUIRED:
                raise self.error("is missing", key)
            return default
        return self.doc[key]

    def integer(
        self, key: str, lo: int = 0, hi: int = MAX_INT, default: Any = _REQUIRED, *,
        optional: bool = False,
    ) -> Any:  # fmt: skip
        """An int in ``[lo, hi]`` (``None`` too if ``optional``)."""
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if value is None and optional:
            return None
        return check_int(value, lo, hi, lambda p: self.error(p, key))

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        """A finite int or float."""
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.error(f"is {_kind(value)}, not a finite number", key)
        return float(value)

    def text(self, key: str, default: Any = _REQUIRED, max_length: int = 4096) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, str):
            raise self.error(f"is {_kind(value)}, not a string", key)
        if len(value) > max_length:
            raise self.error(f"is {len(value)} characters long (at most {max_length})", key)
        return value

    def mapping(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, dict, "a JSON object", default)

    def sequence(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, list, "a list", default)

    def _typed(self, key: str, kind: type, name: str, default: Any) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, kind):
            raise self.error(f"is {_kind(value)}, not {name}", key)
        return value


def check_int(value: Any, lo: int, hi: int, error: Callable[[str], Exception]) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``; else ``error(problem)``."""
    if type(value) is not int:
        raise error(f"is {_kind(value)}, not an integer")
    if not lo <= value <= hi:
        raise error(f"is {value}, out of range [{lo}, {hi}]")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"the number {value!r:.40}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return _CONTAINER_KINDS.get(type(value), type(value).__name__)


_CONTAINER_KINDS: dict[type, str] = {dict: "a JSON object", list: "a list"}


# ---- check-resume's records (ddpckpt._resumecheck.records) read their fields with these


def describe(value: Any) -> str:
    """How an error names ``value``: ``null``, ``the string 'x'``, ``a list``, ..."""
    return _kind(value)


def field_value(fields: Fields, key: str, *, optional: bool) -> Any:
    """The value of ``key`` in ``fields`` (``None`` if ``optional`` and absent); a missing
    required field is :class:`CorruptCheckpointError` naming the file and the field."""
    return fields.value(key, None if optional else _REQUIRED)
