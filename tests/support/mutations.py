"""Mutations of real checkpoints and torch.save files, and the property every one must keep.

Shared by the hypothesis tests run in CI (``tests/test_fuzz.py``) and the long-running
atheris target (``tests/fuzz/fuzz_checkpoints.py``): each drives the same mutations through
a :class:`Chooser` (hypothesis draws, or atheris' fuzzed bytes).

Property (:func:`check_checkpoint`, :func:`check_torch_file`): a mutated input either loads
(into fresh objects, exactly the original data when the mutation left every checksum as it
was) or raises one of the documented errors; within a time and a memory bound; opening no
path outside the checkpoint (an ``open`` audit hook witnesses every file opened) and
starting no process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import shutil
import struct
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

import ddpckpt
from ddpckpt._cli.tools import summary
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PartiallyRestoredError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from hostile import (
    MANIFEST,
    manifest_doc,
    opened_paths,
    outside,
    refresh_file,
    split_header,
    write_header,
    write_manifest,
)

SECONDS = 20.0  # per call, on a busy CI machine (each takes milliseconds)
MEMORY = 512 << 20  # peak resident memory any example may add
# What a checkpoint whose checksums the attacker recomputed may raise: it is damaged, or
# it describes other objects than the live ones (a self-consistent checkpoint may).
DOCUMENTED = (CorruptCheckpointError, CheckpointNotFoundError, StateMismatchError,
              UnsupportedValueError, PartiallyRestoredError)  # fmt: skip
# What damage that leaves checksums as they were may raise (a load that found it after
# writing into the objects says they are partly restored).
DAMAGED = (CorruptCheckpointError, CheckpointNotFoundError, PartiallyRestoredError)

HOSTILE_NAMES = ["../model-00000.safetensors", "/etc/passwd", "model-00000.safetensors/../x",
                 "", ".", "..", "model-1.safetensors", ".next-a/../../x", "rank-00000.safetensors",
                 "state-00000.safetensors", "a" * 300, "model-00000.safetensors\0"]  # fmt: skip
HOSTILE_STRINGS = [*HOSTILE_NAMES, "$tensor", "$tuple", "$float", "nan", "F32", "BOOL",
                   "cuda:99", "step-00000001", "\udcff", "\U0001f4a5"]  # fmt: skip
HOSTILE_INTS = [0, 1, -1, 7, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 10**30]
TAGS = ["$tensor", "$ndarray", "$tuple", "$dict", "$odict", "$set", "$frozenset", "$float",
        "$complex", "$bytes", "$npscalar", "$dtype", "$device", "$size", "$counter",
        "$defaultdict", "$deque", "$enum", "$unknown"]  # fmt: skip
OPCODES = [b"(", b".", b"0", b"1", b"2", b"K\xff", b"M\xff\xff", b"J\xff\xff\xff\x7f", b"N", b"R",
           b"]", b"}", b"a", b"e", b"s", b"u", b"t", b")", b"\x85", b"\x86", b"\x87", b"h\x00",
           b"j\xff\xff\x00\x00", b"q\x00", b"r\xff\xff\xff\x7f", b"b", b"\x81", b"Q", b"X\xff\xff\xff\x7f",
           b"ctorch._utils\n_rebuild_tensor_v2\n", b"cos\nsystem\n", b"c__builtin__\neval\n",
           b"ccollections\nOrderedDict\n", b"\x80\x02", b"\x94", b"\x95" + b"\xff" * 8]  # fmt: skip


class Chooser(Protocol):
    """Where a mutation's choices come from: hypothesis draws or atheris' bytes."""

    def integer(self, lo: int, hi: int) -> int: ...

    def raw(self, at_most: int) -> bytes: ...


def choice(chooser: Chooser, items: list[Any]) -> Any:
    return items[chooser.integer(0, len(items) - 1)]


def json_value(chooser: Chooser, depth: int = 0) -> Any:
    """A JSON value of the kinds that have broken parsers: odd numbers, hostile strings,
    tags, and containers (rarely nested past every cap)."""
    kind = chooser.integer(0, 9 if depth < 3 else 5)
    if kind == 0:
        return choice(chooser, HOSTILE_INTS)
    if kind == 1:
        return choice(chooser, [0.5, -0.0, 1e308, -1e308, 5e-324, 3.0])
    if kind == 2:
        return choice(chooser, HOSTILE_STRINGS)
    if kind == 3:
        return choice(chooser, [None, True, False])
    if kind == 4:
        return chooser.raw(12).decode("latin-1")
    if kind == 5:
        return choice(chooser, [[], {}, [1, 2], {"a": 1}])
    if kind == 6:
        return [json_value(chooser, depth + 1) for _ in range(chooser.integer(0, 3))]
    if kind == 7:
        return {choice(chooser, HOSTILE_STRINGS): json_value(chooser, depth + 1)}
    if kind == 8:
        return {choice(chooser, TAGS): json_value(chooser, depth + 1)}
    nested: Any = choice(chooser, [0, "x", {}])
    for _ in range(choice(chooser, [3, 200, 300, 900])):
        nested = [nested] if chooser.integer(0, 1) else {"k": nested}
    return nested


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a node of a JSON document (the root included)."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _paths(value, (*prefix, index))


def mutate_json(chooser: Chooser, doc: Any, within: tuple[Any, ...] = ()) -> Any:
    """``doc`` with one node (below ``within``) replaced, removed, renamed or tweaked."""
    base = doc
    for key in within:
        base = base[key]
    paths = list(_paths(base))
    path = choice(chooser, paths[1:] if len(paths) > 1 else paths)
    full = (*within, *path)
    if not full:
        return json_value(chooser)
    parent = doc
    for key in full[:-1]:
        parent = parent[key]
    last, value = full[-1], parent[full[-1]]
    op = chooser.integer(0, 4)
    if op == 0 or (not isinstance(parent, dict) and op in (1, 2)):
        parent[last] = json_value(chooser)
    elif op == 1:
        del parent[last]
    elif op == 2:
        parent[choice(chooser, HOSTILE_STRINGS)] = parent.pop(last)
    elif op == 3 and type(value) is int:
        parent[last] = choice(chooser, [value + 1, value - 1, -value, value * 2**32, 0])
    elif isinstance(value, list) and value:
        parent[last] = [*value[: chooser.integer(0, len(value) - 1)], json_value(chooser)]
    else:
        parent[last] = json_value(chooser)
    return doc


# --------------------------------------------------------------------- checkpoints


def _data_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".safetensors"))


def _index_files(ckpt: Path) -> list[str]:
    """The shard indexes of a sharded checkpoint (format 6)."""
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("shards-"))


def _mutate_index(chooser: Chooser, ckpt: Path) -> bool:
    """A shard index changed as an attacker would: its digest recomputed in the manifest."""
    name = choice(chooser, _index_files(ckpt))
    doc = json.loads((ckpt / name).read_text())
    within = choice(chooser, [(), ("pieces",)])
    (ckpt / name).write_text(json.dumps(mutate_json(chooser, doc, within)))
    refresh_file(ckpt, name)
    return True


def _mutate_table(chooser: Chooser, ckpt: Path) -> bool:
    """A file table changed as an attacker would: its digest recomputed in the manifest."""
    name = choice(chooser, sorted(p.name for p in ckpt.iterdir() if p.name.startswith("files-")))
    doc = json.loads((ckpt / name).read_text())
    within = choice(chooser, [(), ("files",)])
    (ckpt / name).write_text(json.dumps(mutate_json(chooser, doc, within)))
    refresh_file(ckpt, name)
    return True


def _mutate_manifest(chooser: Chooser, ckpt: Path) -> bool:
    doc = manifest_doc(ckpt)
    within = choice(
        chooser,
        [(), ("files",), ("file_tables",), ("tensors",), ("state",), ("metrics",), ("shards",),
         ("meshes",)],
    )  # fmt: skip
    write_manifest(
        ckpt, mutate_json(chooser, doc, within if within[0:1] and within[0] in doc else ())
    )
    return True


def _mutate_header(chooser: Chooser, ckpt: Path) -> bool:
    name = choice(chooser, _data_files(ckpt))
    header, _ = split_header((ckpt / name).read_bytes())
    write_header(ckpt, name, mutate_json(chooser, header))
    return True


def _mutate_rank_state(chooser: Chooser, ckpt: Path) -> bool:
    name = "rank-00000.safetensors"
    header, _ = split_header((ckpt / name).read_bytes())
    key = "ddpckpt.rank_state"
    state = json.loads(header["__metadata__"][key])
    header["__metadata__"][key] = json.dumps(mutate_json(chooser, {"s": state}, ("s",))["s"])
    write_header(ckpt, name, header)
    return True


def _mutate_length(chooser: Chooser, ckpt: Path) -> bool:
    """A header length that lies (the file's digest recomputed)."""
    name = choice(chooser, _data_files(ckpt))
    data = bytearray((ckpt / name).read_bytes())
    data[:8] = struct.pack("<Q", choice(chooser, [0, 1, 7, len(data), 2**63, 2**40, 99_999_999]))
    (ckpt / name).write_bytes(bytes(data))
    refresh_file(ckpt, name)
    return True


def _damage_bytes(chooser: Chooser, ckpt: Path) -> bool:
    """Flipped bits, a truncation or appended bytes; no checksum recomputed."""
    name = choice(chooser, [MANIFEST, *_data_files(ckpt), *_index_files(ckpt)])
    data = bytearray((ckpt / name).read_bytes())
    op = chooser.integer(0, 2)
    if op == 0:
        for _ in range(chooser.integer(1, 3)):
            data[chooser.integer(0, len(data) - 1)] ^= 1 << chooser.integer(0, 7)
    elif op == 1:
        del data[chooser.integer(0, len(data) - 1) :]
    else:
        data += chooser.raw(16) or b"\0"
    (ckpt / name).write_bytes(bytes(data))
    return False


def _special_file(chooser: Chooser, ckpt: Path) -> bool:
    """A FIFO, a link to /dev/zero or outside, a link loop or a directory as a file."""
    name = choice(chooser, [MANIFEST, *_data_files(ckpt), *_index_files(ckpt)])
    path = ckpt / name
    path.unlink()
    kind = chooser.integer(0, 4)
    if kind == 0:
        os.mkfifo(path)
    elif kind == 1:
        os.symlink("/dev/zero", path)
    elif kind == 2:
        os.symlink(path.name, path)
    elif kind == 3:
        os.symlink(os.path.abspath(ckpt / ".." / "outside"), path)
    else:
        path.mkdir()
    return False


_LAST = (_special_file, _damage_bytes, _mutate_length)
MUTATIONS: list[Callable[[Chooser, Path], bool]] = [
    _mutate_manifest, _mutate_header, _mutate_rank_state, _mutate_length, _damage_bytes,
    _special_file,
]  # fmt: skip


def seed_checkpoint(path: Path) -> dict[str, Any]:
    """A small checkpoint of every kind of state (model, Adam, scheduler, scaler, plain
    and tagged extras, per-rank RNG in a rank file); returns what it holds."""
    torch.manual_seed(0)
    model, optimizer, scheduler = _objects()
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    extra = {"note": [1, (2.5, "x"), {3: None}], "seen": {1, 2}, "big": float("inf")}
    ddpckpt.save(path, model=model, optimizer=optimizer, scheduler=scheduler, step=2,
                 extra=dict(extra), metrics={"loss": 0.25})  # fmt: skip
    (path.parent / "outside").write_bytes(b"not part of the checkpoint")
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)


SHARDED_SEED = Path(__file__).parent.parent / "data" / "format-v7-hsdp"
SHARDED_MUTATIONS = [*MUTATIONS, _mutate_index, _mutate_index, _mutate_table, _mutate_table]


def seed_sharded(path: Path) -> dict[str, torch.Tensor]:
    """The committed format-7 HSDP checkpoint (2 x 2, shards in 4 index files, the files
    of ranks 0-1 and 2-3 in 2 file tables) at ``path``; returns its tensors."""
    from safetensors.torch import load_file

    shutil.copytree(SHARDED_SEED, path)
    (path.parent / "outside").write_bytes(b"not part of the checkpoint")
    return load_file(f"{SHARDED_SEED}-expected.safetensors")


def _sharded_objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    lin = torch.nn.Linear
    model = torch.nn.Sequential(
        lin(16, 33), torch.nn.ReLU(), lin(33, 7), torch.nn.ReLU(), lin(7, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def check_sharded(ckpt: Path, intact: bool, expected: dict[str, torch.Tensor]) -> None:
    """The property for a mutated sharded checkpoint, loaded into a plain model in one
    process (which reads every writer's index)."""
    model, optimizer = _sharded_objects()
    allowed = DAMAGED if intact else DOCUMENTED
    with bounded(ckpt):
        if _outcome(lambda: ddpckpt.load(ckpt, model=model, optimizer=optimizer, rng=False),
                    allowed) and intact:  # fmt: skip
            for name, param in model.named_parameters():
                assert torch.equal(param.detach(), expected[f"model/{name}"]), name
        _outcome(lambda: ddpckpt.verify(ckpt), allowed)
        _outcome(lambda: summary(ckpt), allowed)


def mutated_checkpoint(
    chooser: Chooser,
    seed: Path,
    work: Path,
    mutations: list[Callable[[Chooser, Path], bool]] = MUTATIONS,
) -> tuple[Path, bool]:
    """A copy of ``seed`` under ``work`` with one to three of ``mutations``; whether every
    checksum was left as it was (so only exactly the original data may load)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(seed.parent, work, symlinks=True)
    ckpt = work / seed.name
    intact = True
    for _ in range(chooser.integer(1, 3)):
        mutation = choice(chooser, mutations)
        try:
            intact = not mutation(chooser, ckpt) and intact
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
            break  # an earlier mutation left what this one cannot parse: keep it as it is
        if mutation in _LAST:
            break  # what they leave may not parse, or be a FIFO: nothing follows them
    return ckpt, intact


def check_checkpoint(ckpt: Path, intact: bool, original: dict[str, Any]) -> None:
    """The property (see the module), for ``load``, ``load_latest``, ``verify`` and
    ``inspect``'s summary of the checkpoint ``ckpt``."""
    model, optimizer, scheduler = _objects()
    extra: dict[str, Any] = {"note": None, "seen": None, "big": None}

    def load() -> Any:
        return ddpckpt.load(ckpt, model=model, optimizer=optimizer, scheduler=scheduler,
                            extra=extra)  # fmt: skip

    allowed = DAMAGED if intact else DOCUMENTED
    with bounded(ckpt):
        if _outcome(load, allowed) and intact:
            _assert_same(model.state_dict(), original["model"])
            _assert_same(optimizer.state_dict()["state"], original["optimizer"]["state"])
            assert extra == original["extra"], extra
        _outcome(lambda: ddpckpt.verify(ckpt), allowed)
        _outcome(lambda: summary(ckpt), allowed)
        _outcome(lambda: ddpckpt.load_latest(ckpt.parent, model=_objects()[0]), allowed)


def _outcome(call: Callable[[], Any], allowed: tuple[type[BaseException], ...]) -> bool:
    """Run ``call`` within the time bound: True if it succeeded, False if it raised one of
    ``allowed``; anything else fails the property."""
    started = time.monotonic()
    try:
        call()
        succeeded = True
    except allowed:
        succeeded = False
    elapsed = time.monotonic() - started
    assert elapsed < SECONDS, f"took {elapsed:.1f} s"
    return succeeded


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    else:
        assert a == b


@contextlib.contextmanager
def bounded(root: Path) -> Iterator[None]:
    """Fail if what runs inside opens a path outside ``root``, starts a process, or raises
    the process's peak resident memory by more than ``MEMORY``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with opened_paths() as opened, _no_processes():
        yield
    assert outside(opened, root) == [], outside(opened, root)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    assert grown < MEMORY, f"peak memory grew by {grown >> 20} MiB"


_spawned: list[str] = []
_SPAWNING = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "subprocess.Popen")


def _spawn_witness(event: str, args: tuple[Any, ...]) -> None:
    if event.startswith(_SPAWNING):
        _spawned.append(event)


@contextlib.contextmanager
def _no_processes() -> Iterator[None]:
    if _spawn_witness not in _hooks:
        sys.addaudithook(_spawn_witness)
        _hooks.append(_spawn_witness)
    _spawned.clear()
    yield
    assert _spawned == [], f"started a process: {_spawned}"


_hooks: list[Any] = []


# --------------------------------------------------------------------- torch.save files


def seed_torch_file(path: Path) -> None:
    """A torch.save file as the usual recipes write it (model, optimizer, epoch, extras)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
                "args": {"lr": 0.1, "layers": [3, 2]}}, path)  # fmt: skip


def mutated_torch_file(chooser: Chooser, seed: Path, target: Path) -> None:
    """``seed`` with its pickle's opcodes or its zip's bytes changed."""
    with zipfile.ZipFile(seed) as archive:
        records = [(info, archive.read(info.filename)) for info in archive.infolist()]
    op = chooser.integer(0, 3)
    if op == 3:  # raw bytes of the whole file
        data = bytearray(seed.read_bytes())
        for _ in range(chooser.integer(1, 4)):
            data[chooser.integer(0, len(data) - 1)] ^= 1 << chooser.integer(0, 7)
        target.write_bytes(bytes(data))
        return
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info, data in records:
            if info.filename.endswith("data.pkl"):
                data = _mutate_pickle(chooser, bytearray(data), op)
            elif "/data/" in info.filename and op == 2 and chooser.integer(0, 3) == 0:
                data = data[: chooser.integer(0, len(data))]
            archive.writestr(info, data)
    target.write_bytes(out.getvalue())


def _mutate_pickle(chooser: Chooser, data: bytearray, op: int) -> bytes:
    for _ in range(chooser.integer(1, 3)):
        at = chooser.integer(0, len(data) - 1)
        if op == 0:
            data[at:at] = choice(chooser, OPCODES)
        elif op == 1:
            data[at] ^= 1 << chooser.integer(0, 7)
        else:
            del data[at : at + chooser.integer(1, 8)]
    return bytes(data)


def check_torch_file(path: Path, out: Path) -> None:
    """The property for ``import`` (of a file or a DCP directory): a checkpoint that
    verifies, or a refusal."""
    if out.exists():
        shutil.rmtree(out)
    with bounded(path.parent):
        if _outcome(lambda: import_checkpoint(path, out),
                    (CorruptCheckpointError, UnsafeCheckpointError)):  # fmt: skip
            assert ddpckpt.verify(out)


def seed_dcp_directories(root: Path) -> list[Path]:
    """DCP directories as ``dcp.save`` writes them in one process: the tutorial's
    ``{"app": {"model": ..., "optim": ...}}`` of ``get_state_dict``, and the plain recipe's
    ``{"model": ..., "optimizer": opt.state_dict(), "epoch": 3}``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, _ = _objects()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"app": {"model": model_state, "optim": optim_state}},
                 checkpoint_id=str(root / "tutorial"))  # fmt: skip
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3},
                 checkpoint_id=str(root / "plain"))  # fmt: skip
    return [root / "tutorial", root / "plain"]


def mutated_dcp_directory(chooser: Chooser, seed: Path, target: Path) -> None:
    """``seed`` with its ``.metadata`` pickle's opcodes changed or cut short, or its data
    file's bytes changed or cut short."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(seed, target)
    metadata = target / ".metadata"
    (data,) = target.glob("*.distcp")
    op = chooser.integer(0, 5)
    if op <= 2:
        metadata.write_bytes(_mutate_pickle(chooser, bytearray(metadata.read_bytes()), op))
    elif op == 5:
        raw = metadata.read_bytes()
        metadata.write_bytes(raw[: chooser.integer(0, len(raw))])
    elif op == 3:
        raw = bytearray(data.read_bytes())
        for _ in range(chooser.integer(1, 4)):
            raw[chooser.integer(0, len(raw) - 1)] ^= 1 << chooser.integer(0, 7)
        data.write_bytes(bytes(raw))
    else:
        raw = data.read_bytes()
        data.write_bytes(raw[: chooser.integer(0, len(raw))])


def seed_hf_directories(root: Path) -> list[Path]:
    """A Trainer ``checkpoint-N`` of two processes, an Accelerate ``save_state`` and a sharded
    save of DCP's HuggingFaceStorageWriter, each file written as those packages write it
    (without them: the same calls on the same values)."""
    import numpy as np
    from safetensors.torch import save_file

    model, optimizer, scheduler = _objects()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    trainer, accelerate = root / "checkpoint-2", root / "state"
    for directory in (trainer, accelerate):
        directory.mkdir(parents=True)
        save_file(model.state_dict(), directory / "model.safetensors", metadata={"format": "pt"})
    streams = {"python": random.getstate(), "numpy": np.random.get_state(),
               "cpu": torch.get_rng_state()}  # fmt: skip
    torch.save(optimizer.state_dict(), trainer / "optimizer.pt")
    torch.save(scheduler.state_dict(), trainer / "scheduler.pt")
    for rank in range(2):
        torch.save(streams, trainer / f"rng_state_{rank}.pth")
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 2, "epoch": 0.5}))
    (trainer / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    torch.save(optimizer.state_dict(), accelerate / "optimizer.bin")
    torch.save(scheduler.state_dict(), accelerate / "scheduler.bin")
    torch.save({"random_state": streams["python"], "numpy_random_seed": streams["numpy"],
                "torch_manual_seed": streams["cpu"], "step": 0},
               accelerate / "random_states_0.pkl")  # fmt: skip
    torch.save({"n": 3}, accelerate / "custom_checkpoint_0.pkl")
    # DCP's HuggingFaceStorageWriter, sharded: each rank's file a row chunk of each tensor
    sharded = root / "safetensors"
    sharded.mkdir()
    for rank in range(2):
        chunks = {k: v[rank * 2 : rank * 2 + 2].contiguous() for k, v in model.state_dict().items()}
        info = {k: {"saved_offsets": [rank * 2] + [0] * (v.dim() - 1)} for k, v in chunks.items()}
        save_file(chunks, sharded / f"shard-{rank:05d}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": json.dumps(info)})  # fmt: skip
    return [trainer, accelerate, sharded]


def seed_deepspeed_directories(root: Path) -> list[Path]:
    """DeepSpeed ZeRO-2 and ZeRO-3 checkpoints of 2 ranks (deepspeed_layout.py): their tag
    directories."""
    from deepspeed_layout import write

    model, optimizer, scheduler = _objects()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return [write(root / f"zero{stage}", model, optimizer, world=2, step=1,
                  scheduler=scheduler, stage=stage) for stage in (2, 3)]  # fmt: skip


def mutated_hf_directory(chooser: Chooser, seed: Path, target: Path) -> None:
    """``seed`` with one file's pickle, zip, safetensors or JSON bytes changed or cut short."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(seed, target)
    path = target / choice(chooser, sorted(os.listdir(target)))
    if zipfile.is_zipfile(path) and chooser.integer(0, 1) == 0:
        mutated_torch_file(chooser, path, path)
        return
    raw = bytearray(path.read_bytes())
    if chooser.integer(0, 1) == 0:
        for _ in range(chooser.integer(1, 4)):
            raw[chooser.integer(0, len(raw) - 1)] ^= 1 << chooser.integer(0, 7)
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(bytes(raw[: chooser.integer(0, len(raw))]))


class RandomChooser:
    """Choices from a seeded ``random.Random`` (for quick runs without a fuzzer)."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self._random.randint(lo, hi)

    def raw(self, at_most: int) -> bytes:
        return bytes(self._random.getrandbits(8) for _ in range(self._random.randint(0, at_most)))


def example(kind: str, root: Path) -> Callable[[Chooser], None]:
    """One check of the property on an input of ``kind`` (``checkpoint``, ``torchfile``,
    ``dcp``, ``deepspeed`` or ``hf``: a Trainer checkpoint or an Accelerate save_state) mutated by a chooser's choices; the seed input is made under ``root`` first."""
    if kind == "dcp":
        seeds = seed_dcp_directories(root / "seeds")

        def one_directory(chooser: Chooser) -> None:
            mutated_dcp_directory(chooser, choice(chooser, seeds), root / "mutated")
            check_torch_file(root / "mutated", root / "out")

        return one_directory
    if kind == "hf":
        directories = seed_hf_directories(root / "seeds")

        def one_hf(chooser: Chooser) -> None:
            seed = choice(chooser, directories)
            mutated_hf_directory(chooser, seed, root / "mutated" / seed.name)
            check_torch_file(root / "mutated" / seed.name, root / "mutated" / "out")

        return one_hf
    if kind == "deepspeed":
        tags = seed_deepspeed_directories(root / "seeds")

        def one_deepspeed(chooser: Chooser) -> None:
            tag = choice(chooser, tags)
            mutated_hf_directory(chooser, tag, root / "mutated" / tag.name)
            check_torch_file(root / "mutated" / tag.name, root / "mutated" / "out")

        return one_deepspeed
    if kind == "sharded":
        seed = root / "seed" / "run" / "ckpt"
        expected = seed_sharded(seed)

        def one_sharded(chooser: Chooser) -> None:
            mutated, intact = mutated_checkpoint(
                chooser, seed, root / "work" / "run", SHARDED_MUTATIONS
            )
            check_sharded(mutated, intact, expected)

        return one_sharded
    if kind == "checkpoint":
        seed = root / "seed" / "run" / "ckpt"
        original = seed_checkpoint(seed)

        def one(chooser: Chooser) -> None:
            mutated, intact = mutated_checkpoint(chooser, seed, root / "work" / "run")
            check_checkpoint(mutated, intact, original)

        return one
    legacy = root / "seed.pt"
    seed_torch_file(legacy)

    def one_file(chooser: Chooser) -> None:
        mutated_torch_file(chooser, legacy, root / "mutated.pt")
        check_torch_file(root / "mutated.pt", root / "out")

    return one_file
