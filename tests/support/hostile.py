"""Checkpoints made hostile or damaged on purpose, and a witness of the files a call opens.

The edits recompute every checksum an attacker can recompute (the manifest's own, the
files' sizes and digests), so what they change reaches the parsers instead of failing a
checksum first. ``opened_paths`` records every path opened through Python's ``open`` audit
event (``open()``, ``os.open``, ``io.open``): the witness the properties check, not the code.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

from ddpckpt._format.manifest import _CHECKSUM_KEY, _with_checksum

MANIFEST = "manifest.json"


def manifest_doc(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text())


def write_manifest(ckpt: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as the manifest with its checksum recomputed."""
    doc = {k: v for k, v in doc.items() if k != _CHECKSUM_KEY}
    (ckpt / MANIFEST).write_text(_with_checksum(doc))


def edit_manifest(ckpt: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    doc = manifest_doc(ckpt)
    edit(doc)
    write_manifest(ckpt, doc)


def rename_file(doc: dict[str, Any], old: str, new: str) -> None:
    """Make the manifest ``doc`` call the file ``old`` ``new`` (its tensors too)."""
    doc["files"] = {new if k == old else k: v for k, v in doc["files"].items()}
    for tensor in doc["tensors"].values():
        if tensor["file"] == old:
            tensor["file"] = new


def refresh_file(ckpt: Path, name: str) -> None:
    """Record the file's current size and digest where it is listed (as an attacker
    would): in the manifest, or in the file table that lists it (format 7), then that
    table's in the manifest."""
    data = (ckpt / name).read_bytes()
    doc = manifest_doc(ckpt)
    if name not in doc["files"]:
        for table in doc.get("file_tables", {}).get("tables", {}):
            if not (ckpt / str(table)).is_file():
                continue  # a name an earlier mutation of the manifest left
            listed = json.loads((ckpt / table).read_text())
            if name in listed.get("files", {}):
                entry = listed["files"][name]
                change = len(data) - entry["size"]
                entry.update(size=len(data), xxh3_64=xxhash.xxh3_64(data).hexdigest())
                (ckpt / table).write_text(json.dumps(listed))
                doc["file_tables"]["tables"][table]["bytes"] += change
                write_manifest(ckpt, doc)
                return refresh_file(ckpt, table)
    doc["files"][name].update(size=len(data), xxh3_64=xxhash.xxh3_64(data).hexdigest())
    write_manifest(ckpt, doc)
    return None


def split_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_header(header: Any, body: bytes, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # as ddpckpt pads it: the data stays aligned
    return struct.pack("<Q", len(text)) + text + body


def write_header(ckpt: Path, name: str, header: Any) -> None:
    """Give the data file ``name`` this safetensors ``header`` (any JSON); the manifest's
    offsets of its tensors follow the header's new length, sizes and digests recomputed."""
    path = ckpt / name
    _, body = split_header(path.read_bytes())
    data = join_header(header, body)
    shift = len(data) - len(body) - (path.stat().st_size - len(body))
    path.write_bytes(data)

    def moved(doc: dict[str, Any]) -> None:
        for tensor in doc["tensors"].values():
            if tensor["file"] == name:
                tensor["offsets"] = [o + shift for o in tensor["offsets"]]

    edit_manifest(ckpt, moved)
    refresh_file(ckpt, name)


def edit_header(ckpt: Path, name: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Edit the safetensors header of the data file ``name`` in place (see write_header)."""
    header, _ = split_header((ckpt / name).read_bytes())
    edit(header)
    write_header(ckpt, name, header)


# ------------------------------------------------------------------ the open witness

_recording: list[list[str]] = []
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _recording[-1].append(os.path.abspath(os.fsdecode(args[0])))


@contextlib.contextmanager
def opened_paths() -> Iterator[list[str]]:
    """The paths opened inside the ``with`` block (an audit hook: it sees every ``open``)."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)  # cannot be removed: it records only inside the block
        _hooked = True
    found: list[str] = []
    _recording.append(found)
    try:
        yield found
    finally:
        _recording.pop()


_RUNTIME = tuple(
    os.path.abspath(p) + os.sep
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
)


# What a call reads besides the checkpoint: the kernel's boot id (which node this is).
_SYSTEM = ("/proc/",)


def outside(opened: list[str], root: Path) -> list[str]:
    """The opened paths outside ``root`` other than Python's own files (lazy imports) and
    the kernel's information about this machine."""
    inside = os.path.abspath(root)
    allowed = (inside + os.sep, *_RUNTIME, *_SYSTEM)
    return [p for p in opened if p != inside and not p.startswith(allowed)]
