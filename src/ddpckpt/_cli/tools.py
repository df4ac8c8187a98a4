"""Read-only tools over checkpoints: summarise, compare (exporting: :mod:`ddpckpt._cli.export`).
All local (one process).

Each takes a checkpoint directory; given anything else (a run directory, an empty or
unrelated directory) it raises :class:`~ddpckpt.errors.CheckpointNotFoundError` saying what
the path is and what was expected.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpckpt._format.codec import JSON
from ddpckpt._format.manifest import Manifest, read_manifest
from ddpckpt._format.rankparts import fill_rank_parts
from ddpckpt._format.sections import StateSections
from ddpckpt._format.shards import Piece, ShardedEntry
from ddpckpt._format.statelayout import ROLE_KEYS
from ddpckpt._io.reader import FileSource, all_pieces, find_problems
from ddpckpt._run.rundir import size_problems
from ddpckpt.errors import (
    CorruptCheckpointError,
)
from ddpckpt.storage._location import Location, locate


def open_manifest(location: Location) -> Manifest:
    """The manifest of the checkpoint at ``location``, with every rank's state read (a path
    that is no checkpoint at all gets a :class:`CheckpointNotFoundError` naming what it
    is, from :func:`read_manifest`)."""
    path = location.path
    manifest = read_manifest(location)
    problems = fill_rank_parts(manifest, location)  # every rank's state, for showing it
    if problems:
        raise CorruptCheckpointError(f"{path}: " + "; ".join(problems))
    return manifest


def summary(path: str | os.PathLike[str], *, tensors: bool = True) -> dict[str, Any]:
    """A JSON-able description of a checkpoint: metadata, sections and (with ``tensors``)
    every tensor, a sharded one with its shards (read from the index files: format 6)."""
    location = locate(path)
    path = location.path
    manifest = open_manifest(location)
    sections = _section_types(StateSections.from_json(manifest.state, path))
    return {
        "path": path,
        "id": manifest.id,
        "step": manifest.step,
        "epoch": manifest.epoch,
        "metrics": {k: _plain(v) for k, v in manifest.metrics.items()},
        "created": manifest.created,
        "host": manifest.host,
        "library_version": manifest.library_version,
        "torch_version": manifest.torch_version,
        "format_version": manifest.format_version,
        "world_size": manifest.world_size,
        "copy": manifest.copy,
        "bytes": manifest.nbytes,
        "files": len(manifest.files),
        "tensor_count": len(manifest.tensors) + len(manifest.shards),
        "sections": sections,
        "tensors": sorted(
            [
                {
                    "name": name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "file": t.file,
                }
                for name, t in manifest.tensors.items()
            ]
            + [
                _sharded_summary(name, manifest.shards[name], pieces)
                for name, pieces in all_pieces(location, manifest).items()
            ],
            key=lambda t: not t["name"].startswith("model/"),  # the model first, as saved
        )
        if tensors
        else [],
    }


def _sharded_summary(name: str, record: ShardedEntry, pieces: list[Piece]) -> dict[str, Any]:
    """A sharded tensor as ``summary`` lists it: its placement in ``file``, and every shard."""
    return {
        "name": name,
        "dtype": record.dtype,
        "shape": list(record.shape),
        "bytes": record.nbytes,
        "file": record.describe(),
        "placement": {"mesh": list(record.mesh), "placements": list(record.placements)},
        "shards": [
            {"offsets": list(p.offsets), "shape": list(p.shape), "file": p.entry.file}
            for p in pieces
        ],
    }


def _section_types(stored: StateSections) -> dict[str, Any]:
    """Each section's type by name (as ``summary`` reports them), and the param groups."""
    found: dict[str, Any] = {}
    for role, (single, _) in ROLE_KEYS.items():
        for name, section in getattr(stored, role).items():
            kind = section.type
            if getattr(section, "wrapped_by", None) is not None:
                kind += f" ({section.wrapped_by})"
            if getattr(section, "zero", None) is not None:
                kind += f" (ZeroRedundancyOptimizer over {section.zero.world_size} ranks)"
            found[single if not stored.layout.named else f"{single} {name}"] = kind
    if stored.saved_dict is not None:
        found["dict"] = "save_dict"
    if stored.extra:
        found["extra"] = {k: v.type or v.kind for k, v in stored.extra.items()}
    for name, optimizer in stored.optimizers.items():
        key = "optimizer_groups" if not stored.layout.named else f"optimizer_groups {name}"
        found[key] = [{k: _plain(v) for k, v in g.hyper.items()} for g in optimizer.groups]
    return found


def _plain(value: JSON) -> Any:
    """A tagged tree value made readable (tuples as lists, nan as a string)."""
    if isinstance(value, dict) and len(value) == 1:
        ((tag, arg),) = value.items()
        if tag == "$tuple":
            return [_plain(v) for v in arg]
        if tag == "$float":
            return arg
        if tag == "$tensor":
            return f"<tensor {arg}>"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@dataclass
class TensorDiff:
    """How one tensor differs between two checkpoints."""

    name: str
    status: str  # "only in A", "only in B", "shape", "dtype", "values"
    detail: str = ""
    max_abs: float | None = None
    mismatched: int | None = None


@dataclass
class DiffReport:
    """What :func:`diff` found. ``header``/``state`` hold ``(where, a, b)``; differences in
    ignored sections are only counted, in ``ignored`` (section -> count)."""

    a: str
    b: str
    header: list[tuple[str, Any, Any]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    state: list[tuple[str, Any, Any]] = field(default_factory=list)
    identical_tensors: int = 0
    verified: bool = False
    ignored: dict[str, int] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not (self.header or self.tensors or self.state)

    def by_section(self) -> dict[str, int]:
        """How many differences each section has (``step``, ``optimizer``, ``rng``, ...)."""
        counts: dict[str, int] = {}
        wheres = [w for w, _, _ in self.header + self.state] + [t.name for t in self.tensors]
        for where in wheres:
            section = section_of(where)
            counts[section] = counts.get(section, 0) + 1
        return counts


_HEADER_FIELDS = ("step", "epoch", "metrics", "world_size")
_RANK_TENSOR = re.compile(r"^rank\d+$")
_CHECKSUMS_FAIL = "its bytes no longer match its checksums"
_SIZES_WRONG = "files are missing or not the size its manifest records (the data was not read)"


def section_of(where: str) -> str:
    """The section a difference lies in: a header field (``step``), a state section
    (``model``, ``optimizer``, ``extra/ema``, ...) or a per-rank one (``rng``)."""
    parts = where.split("/")
    if parts[0] == "state":  # state/<section>/...
        parts = parts[1:]
    elif parts[0] == "ranks":  # ranks/<rank>/<section>/...
        parts = parts[2:]
    elif _RANK_TENSOR.match(parts[0]):  # the tensor rank<r>/<section>/...
        parts = parts[1:]
    if not parts:
        return where
    if parts[0] == "extra" and len(parts) > 1:
        return f"extra/{parts[1]}"
    return parts[0]


def _sections(manifest: Manifest) -> set[str]:
    found = {"rng", *_HEADER_FIELDS, *(section_of(f"state/{name}") for name in manifest.state)}
    found |= {f"extra/{name}" for name in manifest.state.get("extra", {})}
    found |= {section_of(name) for name in manifest.tensors}
    for rank in manifest.ranks:
        found |= {section_of(f"ranks/0/{key}") for key in rank}
        found |= {f"extra/{name}" for name in rank.get("extra", {})}
    return found


def _check_intact(problems: list[tuple[str, list[str]]], what: str) -> None:
    """Raise if any checkpoint of ``problems`` (path, its problems) has one; ``what`` says
    what the problems are."""
    bad = [(path, found) for path, found in problems if found]
    if bad:
        lines = [problem for _, found in bad for problem in found]
        raise CorruptCheckpointError(
            f"cannot compare: {' and '.join(path for path, _ in bad)} "
            f"{'is' if len(bad) == 1 else 'are'} corrupt; {what}:\n  " + "\n  ".join(lines)
        )


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    ignore: Iterable[str] = (),
    verify: bool = True,
) -> DiffReport:
    """Compare two checkpoints: metadata, non-tensor state, and every tensor's values.

    With ``verify`` (the default) every byte of both is checked against its checksums first
    and a corrupt side raises :class:`CorruptCheckpointError`; tensors with equal checksums
    are then equal. Without it, the recorded checksums are trusted (nothing is read for equal
    ones) and only the files' sizes are checked, so a file altered in place since it was
    written can compare as identical (a missing or truncated one raises). Differing
    tensors are compared element-wise (count of differing elements, max absolute difference).

    ``ignore`` names sections whose differences are only counted: header fields (``step``,
    ``epoch``, ``metrics``, ``world_size``), state sections (``model``, ``optimizer``,
    ``scheduler``, ``scaler``, ``extra`` or ``extra/NAME``) and ``rng`` (every rank's
    generators). An unknown name raises :class:`ValueError` listing the known ones.
    """
    la, lb = locate(a), locate(b)
    a, b = la.path, lb.path
    ma, mb = open_manifest(la), open_manifest(lb)
    ignore = set(ignore)
    known = _sections(ma) | _sections(mb)
    unknown = ignore - known - {k.split("/")[0] for k in known}
    if unknown:
        raise ValueError(
            f"nothing called {', '.join(sorted(unknown))} to ignore; these checkpoints have: "
            f"{', '.join(sorted(known))}"
        )
    if verify:
        _check_intact([(a, find_problems(la)), (b, find_problems(lb))], _CHECKSUMS_FAIL)
    else:  # no data read, but a missing or truncated file is one size away
        _check_intact([(a, size_problems(la, ma)), (b, size_problems(lb, mb))], _SIZES_WRONG)
    report = DiffReport(a, b, verified=verify)

    def kept(where: str) -> bool:
        section = section_of(where)
        if any(section == name or section.startswith(f"{name}/") for name in ignore):
            report.ignored[section] = report.ignored.get(section, 0) + 1
            return False
        return True

    for name in _HEADER_FIELDS:
        va, vb = getattr(ma, name), getattr(mb, name)
        if va != vb and kept(name):
            report.header.append((name, va, vb))
    state = list(_tree_diff("state", ma.state, mb.state))
    state += list(_tree_diff("ranks", ma.ranks, mb.ranks))
    report.state = [item for item in state if kept(item[0])]
    sa, sb = FileSource(la, ma), FileSource(lb, mb)
    stored_a, stored_b = _stored(la, ma), _stored(lb, mb)
    for name in sorted(set(stored_a) | set(stored_b)):
        ta, tb = stored_a.get(name), stored_b.get(name)
        if ta is not None and ta == tb:
            report.identical_tensors += 1
            continue
        if not kept(name):
            continue
        if ta is None or tb is None:
            report.tensors.append(TensorDiff(name, "only in B" if ta is None else "only in A"))
        elif ta.shape != tb.shape:
            report.tensors.append(
                TensorDiff(name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}")
            )
        elif ta.dtype != tb.dtype:
            report.tensors.append(TensorDiff(name, "dtype", f"{ta.dtype} vs {tb.dtype}"))
        else:
            report.tensors.append(_value_diff(name, sa.get(name), sb.get(name)))
    return report


@dataclass(frozen=True)
class _Stored:
    """A tensor as a manifest describes it: equal records mean equal bytes."""

    shape: tuple[int, ...]
    dtype: str
    digests: tuple[Any, ...]  # the tensor's digest, or each shard's place and digest


def _stored(location: Location, manifest: Manifest) -> dict[str, _Stored]:
    """Every tensor of ``manifest``, whole or sharded (read one at a time when compared)."""
    found = {n: _Stored(t.shape, t.dtype, (t.digest,)) for n, t in manifest.tensors.items()}
    for name, pieces in all_pieces(location, manifest).items():
        record = manifest.shards[name]
        digests = tuple((p.offsets, p.shape, p.entry.digest) for p in pieces)
        found[name] = _Stored(record.shape, record.dtype, digests)
    return found


def _value_diff(name: str, x: torch.Tensor, y: torch.Tensor) -> TensorDiff:
    differs = x != y
    if x.is_floating_point() or x.is_complex():
        differs &= ~(torch.isnan(x) & torch.isnan(y))
    mismatched = int(differs.sum())
    if mismatched == 0:  # equal values, different bits (e.g. -0.0 and 0.0, nan payloads)
        return TensorDiff(name, "bits", "equal values, different bytes", 0.0, 0)
    max_abs = None
    if x.is_floating_point():
        delta = (x.double() - y.double()).abs()
        finite = delta[torch.isfinite(delta)]
        max_abs = float(finite.max()) if finite.numel() else math.inf
    detail = f"{mismatched} of {x.numel()} elements differ"
    if max_abs is not None:
        detail += f", max |A-B| = {max_abs:.6g}"
    return TensorDiff(name, "values", detail, max_abs, mismatched)


def _tree_diff(path: str, a: JSON, b: JSON) -> Iterator[tuple[str, Any, Any]]:
    """Paths where two encoded trees differ, ignoring tensor references (compared apart)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if "$tensor" in a and "$tensor" in b:
            return
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                yield f"{path}/{key}", a.get(key, "<absent>"), b.get(key, "<absent>")
            else:
                yield from _tree_diff(f"{path}/{key}", a[key], b[key])
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _tree_diff(f"{path}/{i}", x, y)
    elif a != b:
        yield path, _plain(a), _plain(b)
