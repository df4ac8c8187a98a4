"""The collective save: refusals before anything is written, failures leave nothing."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt import CheckpointWriteError
from ddpckpt.errors import CheckpointExistsError, UnsupportedValueError
from ddpckpt.storage import storage_for
from io_helpers import names_in, parent_of
from launch import forked_ranks


@pytest.fixture
def ckpt_dir(ckpt_root) -> str:
    """Where each test saves: on disk, then in memory (``ckpt_root``)."""
    return os.fspath(ckpt_root / "ckpt")


def test_existing_checkpoint_is_not_overwritten_unless_asked(ckpt_dir) -> None:
    first = make_mlp(seed=1)
    ddpckpt.save(ckpt_dir, model=first, step=1)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ddpckpt.save(ckpt_dir, model=make_mlp(seed=2), step=2)
    assert ddpckpt.verify(ckpt_dir).step == 1
    second = make_mlp(seed=2)
    ddpckpt.save(ckpt_dir, model=second, step=2, overwrite=True)
    assert ddpckpt.verify(ckpt_dir).step == 2
    assert names_in(parent_of(ckpt_dir)) == ["ckpt"]  # no temporaries left


def test_unstorable_value_fails_the_save_naming_key_and_leaves_nothing(ckpt_dir) -> None:
    with pytest.raises(UnsupportedValueError, match="extra/hook/fn"):
        ddpckpt.save(ckpt_dir, model=make_mlp(), extra={"hook": {"fn": len}})
    assert names_in(parent_of(ckpt_dir)) == []


def test_a_parent_directory_that_cannot_be_created_is_a_write_error(tmp_path, monkeypatch) -> None:
    """save() into a directory that cannot be created (a read-only mount) raised mkdir's bare
    OSError, not the CheckpointWriteError naming the checkpoint that every other storage
    failure of a save raises."""
    from ddpckpt.storage._posix import PosixStorage

    def read_only(self, location: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", location)

    monkeypatch.setattr(PosixStorage, "make_dirs", read_only)
    path = os.fspath(tmp_path / "new" / "step-1")
    with pytest.raises(CheckpointWriteError, match=f"{path}: writing the checkpoint failed"):
        ddpckpt.save(path, model=make_mlp())


def test_failed_write_leaves_no_checkpoint_and_no_temporary(ckpt_dir, monkeypatch) -> None:
    import ddpckpt._io.writing as checkpoint

    real = checkpoint.write_file
    calls = []

    def failing(path, items, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        return real(path, items, **kwargs)

    monkeypatch.setattr(checkpoint, "write_file", failing)
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    with pytest.raises(ddpckpt.CheckpointWriteError, match="No space left") as caught:
        ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    assert caught.value.errno == 28 and isinstance(caught.value, OSError)
    assert names_in(parent_of(ckpt_dir)) == []


def test_invalid_metadata_is_refused_before_anything_is_written(ckpt_dir) -> None:
    with pytest.raises(TypeError, match="step must be a non-negative int"):
        ddpckpt.save(ckpt_dir, model=make_mlp(), step=-1)
    with pytest.raises(UnsupportedValueError, match="metrics"):
        ddpckpt.save(ckpt_dir, model=make_mlp(), metrics={"loss": [1, 2]})
    assert not storage_for(ckpt_dir).exists(ckpt_dir)


MEMORY_PROBE = """
import os, resource, sys, torch, ddpckpt
params = [torch.nn.Parameter(torch.randn(4 << 20)) for _ in range(8)]  # 128 MiB
model = torch.nn.ParameterList(params)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ddpckpt.save(sys.argv[1], model=model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, sum(p.numel() * 4 for p in params))
"""


@pytest.mark.long
@pytest.mark.disk_only("measured in a child process, which sees no memory:// store")
def test_saving_streams_with_bounded_extra_memory(ckpt_dir) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, ckpt_dir],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    extra, state = map(int, result.stdout.split())
    assert extra < state * 0.15, f"peak RSS grew by {extra} bytes saving {state} bytes"


def test_each_ranks_own_file_is_streamed_not_built_in_memory(ckpt_dir, monkeypatch) -> None:
    """A rank's own state (its RNG, its values of state that differs between ranks: an EMA
    kept per rank can be model-sized) goes to its file as the other files do, piece by
    piece, rather than into one bytes object first."""
    import ddpckpt._format.tensorwrite as tensorwrite

    into: dict[str, str] = {}
    real = tensorwrite._emit

    def emit(name, items, writer, metadata, sink, *args):
        into[name] = type(getattr(sink, "__self__", sink)).__name__
        return real(name, items, writer, metadata, sink, *args)

    monkeypatch.setattr(tensorwrite, "_emit", emit)
    ddpckpt.save(ckpt_dir, model=make_mlp())
    assert into["rank-00000.safetensors"] not in ("bytearray", "BytesIO"), into
    assert into["rank-00000.safetensors"] == into["model-00000.safetensors"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 600 KiB tmpfs mounted for the test (needs root, as in CI)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", os.fspath(mount)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs here (not root?): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", os.fspath(mount)], check=False)


@pytest.mark.long
def test_a_full_disk_is_one_message_without_internals_and_small_saves_fit(
    tiny_disk, tmp_path
) -> None:
    # 4 ranks save ~50 KiB into 600 KiB (refused by a fixed 1 MiB reserve before), then the
    # disk fills and the next save fails on every rank.
    launch = forked_ranks(
        "full", tmp_path / "out", nproc=4, args=["--dir", os.fspath(tiny_disk)],
        worker=Path(__file__).parents[1] / "support" / "full_disk_worker.py", timeout=180,
        env={"DDPCKPT_LOG_ALL_RANKS": "0"},
    )  # fmt: skip
    assert launch.returncode != 0
    assert sorted(launch.results) == [0, 1, 2, 3], launch.output[-4000:]
    lines = launch.output.splitlines()
    reports = [line for line in lines if "InsufficientSpaceError" in line]
    # Python prints the uncaught error once per process; ddpckpt adds nothing to it: one
    # text, no copy chained on rank 0, no ddpckpt log lines, no frames of its internals.
    assert len(reports) == 4, "\n".join(reports)
    assert len({line.split(":", 1)[1] for line in reports}) == 1, "\n".join(reports)
    assert not [line for line in lines if line.startswith("ddpckpt ")]
    assert not [line for line in lines if "direct cause" in line or "/_coord/" in line]
    text = reports[0]
    assert f"{tiny_disk / 'second'}: the checkpoint needs " in text
    assert re.search(
        r"only [0-9,]+ bytes \([0-9.]+ KiB\) are free in " + re.escape(str(tiny_disk)), text
    )
    assert "free space there" in text
