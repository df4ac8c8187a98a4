"""Read-only tools over checkpoints: summarise, compare, export. All local (one process)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import FileSource, load_state_dict
from .errors import UnsupportedValueError
from .manifest import Manifest, read_manifest
from .storage import new_token, temp_dir_for
from .tensorfile import write_file
from .tree import JSON

__all__ = ["TensorDiff", "diff", "export", "summary"]


def summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able description of a checkpoint: metadata, sections and every tensor."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    sections: dict[str, Any] = {}
    for name, section in manifest.state.items():
        if name == "extra":
            sections[name] = {k: v.get("type", v["kind"]) for k, v in section.items()}
        else:
            sections[name] = section.get("type", "") if isinstance(section, dict) else ""
    if "optimizer" in manifest.state:
        groups = manifest.state["optimizer"].get("groups", [])
        sections["optimizer_groups"] = [
            {k: _plain(v) for k, v in g.get("hyper", {}).items()} for g in groups
        ]
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
        "sections": sections,
        "tensors": [
            {
                "name": name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "file": t.file,
            }
            for name, t in manifest.tensors.items()
        ],
    }


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
    a: str
    b: str
    header: list[tuple[str, Any, Any]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    state: list[tuple[str, Any, Any]] = field(default_factory=list)
    identical_tensors: int = 0

    @property
    def same(self) -> bool:
        return not (self.header or self.tensors or self.state)


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> DiffReport:
    """Compare two checkpoints: metadata, non-tensor state, and every tensor's values.

    Tensors with equal checksums are not read; others are compared element-wise
    (max absolute difference for floating tensors, count of differing elements).
    """
    a, b = os.fspath(a), os.fspath(b)
    ma, mb = read_manifest(a), read_manifest(b)
    report = DiffReport(a, b)
    for name in ("step", "epoch", "metrics", "world_size"):
        va, vb = getattr(ma, name), getattr(mb, name)
        if va != vb:
            report.header.append((name, va, vb))
    report.state = list(_tree_diff("state", ma.state, mb.state))
    report.state += list(_tree_diff("ranks", ma.ranks, mb.ranks))
    sa, sb = FileSource(a, ma), FileSource(b, mb)
    for name in sorted(set(ma.tensors) | set(mb.tensors)):
        ta, tb = ma.tensors.get(name), mb.tensors.get(name)
        if ta is None or tb is None:
            report.tensors.append(TensorDiff(name, "only in B" if ta is None else "only in A"))
        elif ta.shape != tb.shape:
            report.tensors.append(
                TensorDiff(name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}")
            )
        elif ta.dtype != tb.dtype:
            report.tensors.append(TensorDiff(name, "dtype", f"{ta.dtype} vs {tb.dtype}"))
        elif ta.digest == tb.digest:
            report.identical_tensors += 1
        else:
            report.tensors.append(_value_diff(name, sa.get(name), sb.get(name)))
    return report


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


def export(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
) -> str:
    """Write a checkpoint's model weights to ``out`` (``.safetensors`` or ``.pt``).

    The result is a plain state dict under canonical keys, for inference code:
    ``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` read it. The file
    is written to a temporary name and renamed into place. Returns ``out``.
    """
    path, out = os.fspath(path), os.fspath(out)
    if not out.endswith((".safetensors", ".pt", ".pth")):
        raise ValueError(f"{out}: name the output *.safetensors or *.pt")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    tmp = temp_dir_for(out, new_token())
    try:
        if out.endswith(".safetensors"):
            manifest = read_manifest(path)
            _export_safetensors(path, manifest, tmp)
        else:
            torch.save(load_state_dict(path), tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _export_safetensors(path: str, manifest: Manifest, tmp: str) -> None:
    section = manifest.state["model"]
    if section.get("extra_keys"):
        raise UnsupportedValueError(
            f"{path}: the model has non-tensor extra state ({', '.join(section['extra_keys'])}), "
            "which safetensors cannot hold; export to .pt instead"
        )
    source = FileSource(path, manifest)
    items = [(key, source.get(f"model/{key}")) for key in section["keys"]]
    items += [(alias, source.get(f"model/{key}")) for alias, key in section["aliases"].items()]
    write_file(tmp, items, writer=0, metadata={"format": "pt", "exported_by": "ddpckpt"})
