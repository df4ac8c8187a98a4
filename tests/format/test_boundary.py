"""Checkpoints written by someone else: what the trust boundary refuses, and how.

Every case was seen in the wild or crafted as an attacker would (every checksum an attacker
can recompute is recomputed): before the boundary each one read a file outside the
checkpoint, hung, allocated what the file does not hold, or raised a raw exception. Now each
is one CorruptCheckpointError naming the file and the field, at once.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt._cli.tools import summary
from ddpckpt._format.boundary import check_file_name, load_json
from ddpckpt.errors import CorruptCheckpointError
from hostile import (
    edit_header,
    edit_manifest,
    manifest_doc,
    opened_paths,
    outside,
    rename_file,
    split_header,
    write_header,
)

MODEL_FILE = "model-00000.safetensors"
STATE_FILE = "state-00000.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a small model and a stepped Adam, as ``ddpckpt.save`` writes it."""
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    train_steps(model, optimizer)
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    ddpckpt.save(path, model=model, optimizer=optimizer, step=3, extra={"note": [1, (2, 3)]})
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of the saved checkpoint, for one test to damage."""
    path = tmp_path / "run" / "ckpt"
    shutil.copytree(saved, path)
    return path


def load_into_fresh(path) -> ddpckpt.CheckpointInfo:
    model = make_mlp(seed=1)
    return ddpckpt.load(path, model=model, optimizer=torch.optim.Adam(model.parameters()))


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_file_named_outside_the_checkpoint_is_refused_and_never_opened(ckpt, where) -> None:
    """A manifest naming ../x (or /abs/x), checksums recomputed: load() read the model from
    outside the checkpoint and verify() said OK (or told the size of any file named)."""
    target = ckpt.parent / MODEL_FILE  # the attacker's copy next to the checkpoint
    shutil.copy(ckpt / MODEL_FILE, target)
    name = f"../{MODEL_FILE}" if where == "parent" else str(target)
    edit_manifest(ckpt, lambda doc: rename_file(doc, MODEL_FILE, name))
    with opened_paths() as opened:
        with pytest.raises(CorruptCheckpointError, match="no name ddpckpt writes") as raised:
            load_into_fresh(ckpt)
        assert name in str(raised.value) and str(ckpt) in str(raised.value)
        with pytest.raises(CorruptCheckpointError, match="no name ddpckpt writes"):
            ddpckpt.verify(ckpt)
        with pytest.raises(CorruptCheckpointError, match="no name ddpckpt writes"):
            summary(ckpt)
    assert outside(opened, ckpt) == []
    assert ddpckpt.latest(ckpt.parent) is None  # skipped as damaged, with a warning


@pytest.mark.parametrize(
    "name",
    [MODEL_FILE, f".next-0a1b2c/{STATE_FILE}", "rank-1234567.safetensors"],
)
def test_the_names_ddpckpt_writes_pass(name) -> None:
    assert check_file_name(name, "here") == name


@pytest.mark.parametrize(
    "name",
    ["../model-00000.safetensors", "/etc/passwd", "model-00000.safetensors/..", "a/../b",
     "model-0.safetensors", ".next-x/../model-00000.safetensors", "model-00000.safetensors\0",
     "MODEL-00000.safetensors", "model-\u0660\u0660\u0660\u0660\u0660.safetensors", 7, None],
)  # fmt: skip
def test_every_other_name_is_refused(name) -> None:
    with pytest.raises(CorruptCheckpointError, match="no name ddpckpt writes"):
        check_file_name(name, "here")


def _fifo(path) -> None:
    os.mkfifo(path)


def _dev_zero(path) -> None:
    os.symlink("/dev/zero", path)


def _loop(path) -> None:
    os.symlink(path.name, path)  # a link to itself


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [_fifo, _dev_zero, _loop], ids=["fifo", "dev-zero", "loop"])
@pytest.mark.parametrize("file", ["manifest.json", MODEL_FILE])
def test_a_fifo_device_or_link_loop_in_a_checkpoint_is_refused_without_blocking(
    ckpt, make, file, caplog
) -> None:
    """A FIFO hung load, verify, inspect and latest() forever; a link to /dev/zero ended in
    MemoryError; a link loop raised a raw OSError."""
    (ckpt / file).unlink()
    make(ckpt / file)
    calls = [load_into_fresh, ddpckpt.verify] + ([summary] if file == "manifest.json" else [])
    for call in calls:  # (inspect reads no data file)
        with pytest.raises(CorruptCheckpointError) as raised:
            call(ckpt)
        assert str(ckpt / file) in str(raised.value)
        assert "refused" in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ddpckpt.latest(ckpt.parent) is None
    assert str(ckpt) in caplog.text


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


def _tensor(field, value, name="model/0.weight"):
    return lambda doc: doc["tensors"][name].__setitem__(field, value)


LYING_MANIFESTS = {
    "step is text": (_set("step", "abc"), "field 'step' is the string 'abc'"),
    "world size is a list": (_set("world_size", [1]), "field 'world_size' is a list"),
    "files is a list": (_set("files", []), "field 'files' is a list"),
    "negative offsets": (_tensor("offsets", [-8, 0]), "'offsets' is -8"),
    "a range shorter than the shape": (_tensor("shape", [8, 5]), "'offsets' is .* where F32"),
    "a huge shape": (_tensor("shape", [2**40, 2**20]), r"'shape' of F32 spans 2\*\*62 bytes"),
    "an unknown dtype": (_tensor("dtype", "F128"), "unknown dtype 'F128'"),
    "a digest of another kind": (_tensor("xxh3_64", "x" * 16), "not an xxh3-64 digest"),
    "a range past the file": (_tensor("offsets", [10**9, 10**9 + 128]), "out of range"),
    "no manifest object": (lambda doc: doc.clear(), "not a ddpckpt manifest"),
    "an optimizer state that is a number": (  # found by the fuzzer: AttributeError
        lambda doc: doc["state"]["optimizer"]["state"].__setitem__("0.weight", 5),
        "'state' maps to something else than a JSON object per parameter",
    ),
}


@pytest.mark.parametrize("case", list(LYING_MANIFESTS))
def test_a_lying_manifest_is_a_corrupt_checkpoint_naming_the_field(ckpt, case) -> None:
    edit, message = LYING_MANIFESTS[case]
    edit_manifest(ckpt, edit)
    with pytest.raises(CorruptCheckpointError, match=message) as raised:
        load_into_fresh(ckpt)
    assert str(ckpt) in str(raised.value)
    with pytest.raises(CorruptCheckpointError, match=message):
        ddpckpt.verify(ckpt)


def test_nan_and_deep_nesting_in_a_manifest_are_refused_before_anything_recurses(ckpt) -> None:
    """NaN made the checksum raise "ValueError: Out of range float"; deep nesting a
    RecursionError (the attacker needs no valid checksum for either)."""
    text = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(text.replace('"step": 3', '"step": NaN', 1))
    with pytest.raises(CorruptCheckpointError, match="NaN is not a JSON number"):
        load_into_fresh(ckpt)
    deep = "[" * 100_000 + "]" * 100_000
    (ckpt / "manifest.json").write_text(text.replace('"step": 3', f'"step": {deep}', 1))
    with pytest.raises(CorruptCheckpointError, match="nests deeper than 256 levels"):
        load_into_fresh(ckpt)
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        load_json(b"[1e999]", "here", "header")


LYING_HEADERS = {
    "negative offsets": (
        lambda h: h["0.weight"].__setitem__("data_offsets", [-4, 44]),
        "is -4, out of range",
    ),
    "a shape the range does not hold": (
        lambda h: h["0.weight"].__setitem__("shape", [100, 100]),
        "takes 40000",
    ),
    "overlapping tensors": (lambda h: h["0.bias"].__setitem__("data_offsets", [0, 32]), "overlap"),
    "a header that is a list": (lambda h: [h], "safetensors header: is a list"),
}


@pytest.mark.parametrize("case", list(LYING_HEADERS))
def test_a_lying_safetensors_header_is_a_corrupt_checkpoint(ckpt, case) -> None:
    """A header that is a JSON list raised TypeError, negative offsets ValueError, a range
    shorter than the shape "RuntimeError: shape ... is invalid"."""
    change, message = LYING_HEADERS[case]
    header, _ = split_header((ckpt / MODEL_FILE).read_bytes())
    write_header(ckpt, MODEL_FILE, change(header) or header)
    with pytest.raises(CorruptCheckpointError, match=message) as raised:
        load_into_fresh(ckpt)
    assert str(ckpt / MODEL_FILE) in str(raised.value)


def test_an_optimizer_moment_of_another_shape_than_its_parameter_is_refused(ckpt) -> None:
    """exp_avg recorded as [32] for a [8, 4] parameter loaded, and the next
    optimizer.step() failed far from the cause."""
    name = "optimizer/state/0.weight/exp_avg"
    key = manifest_doc(ckpt)["tensors"][name]["key"]
    edit_header(ckpt, STATE_FILE, lambda header: header[key].__setitem__("shape", [32]))
    edit_manifest(ckpt, _tensor("shape", [32], name))
    with pytest.raises(CorruptCheckpointError, match=r"'exp_avg' of '0.weight' has shape \[32\]"):
        load_into_fresh(ckpt)


def test_a_run_directory_or_a_plain_directory_is_named_so_not_an_unfinished_save(tmp_path) -> None:
    """load(), load_state_dict() and verify() said "the save that created it did not
    finish" of any directory without a manifest."""
    run = tmp_path / "run"
    with ddpckpt.Checkpointer(run, model=make_mlp()) as ckpt:
        ckpt.save(1)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    for call in (load_into_fresh, ddpckpt.load_state_dict, ddpckpt.verify):
        with pytest.raises(ddpckpt.CheckpointNotFoundError, match="a run directory, not a"):
            call(run)
        with pytest.raises(ddpckpt.CheckpointNotFoundError, match="not a ddpckpt checkpoint"):
            call(tmp_path / "plain")


def test_what_could_not_be_read_back_is_not_written(tmp_path, monkeypatch) -> None:
    """The writers keep within the reader's caps: a value nested deeper than a load reads
    is refused at the save, naming its key, and so is a manifest over its size cap."""
    deep: list = []
    for _ in range(150):
        deep = [deep]
    extra = {"deep": deep}
    ddpckpt.save(tmp_path / "ok", model=make_mlp(), extra=extra)
    back = {"deep": None}
    ddpckpt.load(tmp_path / "ok", model=make_mlp(), extra=back)
    assert back == extra
    for _ in range(100):
        deep = [deep]
    with pytest.raises(
        ddpckpt.errors.UnsupportedValueError, match=r"extra/deep/0/0.*nested deeper"
    ):
        ddpckpt.save(tmp_path / "deep", model=make_mlp(), extra={"deep": deep})
    monkeypatch.setattr("ddpckpt._format.manifest.MAX_MANIFEST_BYTES", 10_000)
    with pytest.raises(
        ddpckpt.errors.UnsupportedValueError, match=r"big: the manifest would be .* as tensors"
    ):
        ddpckpt.save(tmp_path / "big", model=make_mlp(), extra={"ids": list(range(5000))})
    assert not (tmp_path / "deep").exists() and not (tmp_path / "big").exists()
