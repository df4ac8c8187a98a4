"""``ddpckpt export``: a checkpoint's model weights as one file or a Hugging Face directory.

Local, one process. The weights are written one tensor at a time: each is read (a sharded
one assembled from its pieces, :class:`~ddpckpt._io.reader.FileSource`), written and dropped
before the next, so memory holds one tensor, never the model. Keys are the canonical ones
(no ``module.``, ``_orig_mod.``, FSDP2 or DDP prefixes). The output appears whole or not at
all: it is written under a temporary name and renamed into place.

* ``OUT.safetensors`` or ``OUT.pt``: one file (``.pt`` goes through ``torch.save``, which
  needs the state dict in memory).
* ``OUT`` without a suffix (or ending in ``/``): a directory in Hugging Face's layout, ``model.safetensors`` or, above
  ``max_shard_size``, ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``
  (split as ``huggingface_hub.split_torch_state_dict_into_shards`` splits them).
"""

from __future__ import annotations

import json
import os
import re
from fractions import Fraction

import torch

from ddpckpt._cli.tools import open_manifest
from ddpckpt._format.manifest import Manifest
from ddpckpt._format.sections import ModelSection, StateSections
from ddpckpt._format.tensorwrite import write_file
from ddpckpt._io.reader import FileSource, chosen_model, load_state_dict
from ddpckpt.errors import UnsupportedValueError
from ddpckpt.storage import Storage, Writer
from ddpckpt.storage._layout import new_token, temp_name
from ddpckpt.storage._location import Location, locate

FILE_SUFFIXES = (".safetensors", ".pt", ".pth")
DEFAULT_SHARD_SIZE = "5GB"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_METADATA = {"format": "pt", "exported_by": "ddpckpt"}  # "pt": what transformers requires
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # Hugging Face's (decimal)
MAX_SHARD_SIZE = 1 << 62  # bytes: beyond any file, within every size torch and the OS count
_SIZE_HELP = "pass 1 to 2**62 bytes, or e.g. '5GB' or '500MB' (KB, MB, GB, TB; decimal)"


def export(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    model: str | None = None,
    max_shard_size: int | str | None = None,
) -> str:
    """Write a checkpoint's model weights to ``out``: a ``.safetensors`` or ``.pt`` file, or
    a name without a suffix (or ending in ``/``), a Hugging Face directory (see the module).
    Returns ``out``.

    The result is a plain state dict under canonical keys, for inference code:
    ``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` read a file,
    ``huggingface_hub.load_torch_model`` or ``from_pretrained`` (with a ``config.json``
    beside) a directory. A checkpoint of several models (a ``TrainingState``) needs
    ``model``, the name of the one to write. ``max_shard_size`` (bytes, or ``"5GB"``,
    ``"500MB"``: decimal units, as Hugging Face's) is for directories; default 5GB.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is not set.
        ValueError: ``out`` has another suffix; ``max_shard_size`` is not a size, or is
            given for a file.
        UnsupportedValueError: The model has non-tensor extra state (for safetensors).
        CheckpointError: The checkpoint is missing or damaged.
    """
    path, out = os.fspath(path), os.fspath(out)
    directory = out.endswith("/") or not os.path.splitext(out)[1]
    if not directory and not out.endswith(FILE_SUFFIXES):
        raise ValueError(
            f"{out}: name the output *.safetensors or *.pt, or a directory (no suffix, or "
            "ending in /) for Hugging Face's layout"
        )
    if max_shard_size is not None and not directory:
        raise ValueError(f"{out}: max_shard_size is for a directory; {out} names one file")
    try:
        limit = parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    except ValueError as exc:
        raise ValueError(f"max_shard_size (--max-shard-size): {exc}") from None
    location = locate(path)
    manifest = open_manifest(location)
    model = chosen_model(path, StateSections.from_json(manifest.state, path), model)
    store = locate(out).storage
    if store.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    tmp = temp_name(out.rstrip("/"), new_token())
    try:
        if directory:
            _write_directory(_Weights(location, manifest, model), Location(store, tmp), limit)
        elif out.endswith(".safetensors"):
            weights = _Weights(location, manifest, model)
            weights.write(Location(store, tmp), list(weights.keys))
        else:
            with store.create(tmp) as writer:
                # torch.save takes any object with write(); its stubs say IO[bytes]
                torch.save(
                    load_state_dict(path, model=model),
                    _TorchSink(writer),  # type: ignore[arg-type]
                )
                writer.sync()
        put_in_place(store, tmp, out.rstrip("/"), directory)
    finally:
        if store.exists(tmp):
            store.delete_tree(tmp)
    return out


def parse_size(size: int | str) -> int:
    """Bytes from ``size``: an integer, or a string such as ``"5GB"`` (KB, MB, GB, TB,
    decimal), from 1 byte to :data:`MAX_SHARD_SIZE`; :class:`ValueError` naming the range
    otherwise (never an overflow: the number is read exactly, its length capped)."""
    if isinstance(size, int) and not isinstance(size, bool):
        bytes_ = size
    else:
        text = str(size)
        found = re.fullmatch(r"\s*(\d{1,30})(?:\.(\d{1,30}))?\s*([KMGT]B)?\s*", text, re.I | re.A)
        if found is None:
            raise ValueError(f"{text[:60]!r} is not a shard size: {_SIZE_HELP}")
        unit = _UNITS[found[3].upper()] if found[3] else 1
        bytes_ = int(Fraction(f"{found[1]}.{found[2] or 0}") * unit)
    if not 1 <= bytes_ <= MAX_SHARD_SIZE:
        shown = size if isinstance(size, str) else bytes_
        raise ValueError(f"{str(shown)[:60]!r} is not a shard size: {_SIZE_HELP}")
    return bytes_


class _Weights:
    """One model's weights in a checkpoint, by canonical key (tied aliases included), read
    one tensor at a time."""

    def __init__(self, location: Location, manifest: Manifest, name: str) -> None:
        path = location.path
        stored = StateSections.from_json(manifest.state, path)
        section: ModelSection = stored.models[name]
        if section.extra_keys:
            raise UnsupportedValueError(
                f"{path}: the model has non-tensor extra state "
                f"({', '.join(section.extra_keys)}), which safetensors cannot hold; export to "
                ".pt instead"
            )
        self.prefix = stored.layout.model_prefix(name)
        self.source = FileSource(location, manifest)
        self.keys = {key: key for key in section.keys} | dict(section.aliases)  # key -> stored

    def nbytes(self, key: str) -> int:
        dtype, shape = self.source.meta(self.prefix + self.keys[key])
        return torch.Size(shape).numel() * dtype.itemsize

    def write(self, file: Location, keys: list[str]) -> None:
        """Write the tensors ``keys`` to the safetensors file ``file``, one at a time."""

        def placeholder(key: str) -> torch.Tensor:  # what write_file lays out before any data
            dtype, shape = self.source.meta(self.prefix + self.keys[key])
            return torch.empty(shape, dtype=dtype, device="meta")

        def produce(key: str) -> torch.Tensor:  # read into a buffer of its own, not mapped:
            name = self.prefix + self.keys[key]  # the pages of a mapped file would stay
            dtype, shape = self.source.meta(name)  # resident (on S3: the whole file read)
            return self.source.get(name, like=torch.empty(shape, dtype=dtype))

        write_file(file, [(key, placeholder(key)) for key in keys], writer=0, metadata=_METADATA,
                   produce=produce)  # fmt: skip


def shard_keys(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """The keys of each file, in order: a new file when the next tensor would take the current
    one over ``limit``, a tensor larger than ``limit`` alone (Hugging Face's split)."""
    files: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for key, size in sizes.items():
        if size > limit:
            files.append([key])
            continue
        if current and filled + size > limit:
            files.append(current)
            current, filled = [], 0
        current.append(key)
        filled += size
    return [*files, current] if current or not files else files


def _write_directory(weights: _Weights, where: Location, limit: int) -> None:
    """The Hugging Face directory of ``weights`` at ``where`` (made here)."""
    store, directory = where.storage, where.path
    store.make_dirs(directory)
    sizes = {key: weights.nbytes(key) for key in weights.keys}
    files = shard_keys(sizes, limit)
    if len(files) == 1:
        weights.write(where.join(WEIGHTS_NAME), files[0])
    else:
        weight_map = {}
        for i, keys in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            weights.write(where.join(name), keys)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        store.write_new(os.path.join(directory, INDEX_NAME), text.encode())
    store.sync_dir(directory)


def put_in_place(store: Storage, tmp: str, out: str, directory: bool) -> None:
    """Rename ``tmp`` to ``out``; an existing directory ``out`` (overwrite) is first renamed
    aside, then deleted: never a mix of the two under ``out``."""
    if directory and store.exists(out):
        aside = temp_name(out, new_token())
        store.rename(out, aside)
        store.rename(tmp, out)
        store.delete_tree(aside)
    else:
        store.rename(tmp, out)
    store.sync_dir(store.parent(out))


class _TorchSink:
    """The file-like object ``torch.save`` writes to, over a storage writer."""

    def __init__(self, writer: Writer) -> None:
        self._writer = writer

    def write(self, data: bytes) -> int:
        self._writer.write(data)
        return len(data)

    def flush(self) -> None:
        """Nothing buffered here; the writer syncs when the export is complete."""
