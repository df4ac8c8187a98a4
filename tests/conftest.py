"""Shared fixtures: small models, a one-process gloo group, seeded RNG."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

# Helpers shared by the tests (launchers, worker scripts, servers) live in tests/support and
# are imported by module name, as the worker scripts import each other.
sys.path.insert(0, str(Path(__file__).with_name("support")))
# Fixtures of one subpackage's tests live there too, as plugins: a second conftest.py would
# take the module name "conftest" that the tests import the helpers below from.
pytest_plugins = ["check_recorder", "scratch", "shared_storages", "tiers", "warm_start"]

# c10d's TCPStore looks up the name of each peer's address as it connects (for its log lines,
# even when they are not printed), and the IPv4-mapped loopback it sees is in no hosts file:
# glibc asks the DNS server. Where that server drops a query, glibc waits its default 5 s
# before asking again, and every rank of the launch waits with it (up to a third of some
# files' time). One second, set here for the test processes and everything they start; a
# value the shell set is kept.
os.environ.setdefault("RES_OPTIONS", "timeout:1")


class TiedLM(nn.Module):
    """An embedding tied to the output layer, plus a norm with buffers."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3, scheduler=None
) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-rank gloo group on loopback, so DDP can wrap a module in-process."""
    # the store binds a port the system picks: never a port picked free, then taken
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _checkpointers_closed() -> Iterator[None]:
    """Closes the Checkpointers a test left open: an open one keeps refreshing its lock from a
    thread, and a later test on the same worker would see it (the fuzz suite's guard on the
    paths a load opens did, as a flake). No ``monkeypatch`` here: it would be the test's own,
    set up before the test's other fixtures and so undone only after their clean-up."""
    with closing_checkpointers():
        yield


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def ckpt_dir(tmp_path) -> str:
    return os.fspath(tmp_path / "ckpt")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "disk_only(why): runs on the file system only (ckpt_root), for the reason given"
    )


class StoredPath(str):
    """A location in a storage that is no file system (``memory://...``, ``s3://...``), with the few
    ``pathlib`` methods the suites use, so that one test body runs on disk and in memory."""

    def __truediv__(self, name: str) -> StoredPath:
        return StoredPath(f"{self.rstrip('/')}/{name}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> StoredPath:
        return StoredPath(self.rstrip("/").rsplit("/", 1)[0])

    def _storage(self):
        from ddpckpt.storage import storage_for

        return storage_for(self)

    def exists(self) -> bool:
        return self._storage().exists(self)

    def is_dir(self) -> bool:
        return self._storage().is_dir(self)

    def iterdir(self) -> list[StoredPath]:
        return [self / name for name in self._storage().list(self)]

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._storage().make_dirs(self)

    def read_bytes(self) -> bytes:
        return self._storage().read(self)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self._storage().replace(self, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def unlink(self) -> None:
        self._storage().delete(self)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on loopback for the whole session, with the bucket
    ``s3server.BUCKET`` and ``AWS_ENDPOINT_URL``/credentials set in the environment
    (inherited by launched workers). Skips only if boto3 or moto is not installed."""
    import s3server

    why = s3server.missing()
    if why:
        pytest.skip(why)
    process, endpoint = s3server.start()
    previous = s3server.set_environment(endpoint)
    try:
        s3server.make_bucket(endpoint)
        import ddpckpt.storage.s3

        ddpckpt.storage.s3.reset_default()  # the next s3:// URL reads the new environment
        yield endpoint
    finally:
        s3server.restore_environment(previous)
        s3server.stop(process)


@contextlib.contextmanager
def closing_checkpointers() -> Iterator[None]:
    """Close the Checkpointers created inside when it ends: one left open keeps refreshing
    its lock on a server that the session stops before the process exits."""
    from ddpckpt._run.checkpointer import Checkpointer

    opened = []
    real = Checkpointer.__init__

    @functools.wraps(real)
    def init(self, *args, **kwargs) -> None:
        real(self, *args, **kwargs)
        opened.append(self)

    Checkpointer.__init__ = init
    try:
        yield
    finally:
        Checkpointer.__init__ = real
        for ckpt in opened:
            ckpt.close()


@pytest.fixture
def s3_root(s3_endpoint) -> Iterator[StoredPath]:
    """A fresh, empty prefix in the test bucket; Checkpointers the test leaves open are
    closed at its end. (No ``monkeypatch`` here: a test's patches must be undone before
    this clean-up runs.)"""
    import s3server
    from ddpckpt.storage import storage_for

    root = StoredPath(f"s3://{s3server.BUCKET}/test-{uuid.uuid4().hex[:12]}")
    with closing_checkpointers():
        yield root
    storage_for(root).delete_tree(root)


@pytest.fixture
def fsspec_root() -> Iterator[StoredPath]:
    """A fresh prefix of fsspec's in-memory file system, served as ``fsmem://``."""
    from fsspec.implementations.memory import MemoryFileSystem

    import ddpckpt.storage.fsspec

    ddpckpt.storage.fsspec.use("fsmem", MemoryFileSystem())
    name = f"test-{uuid.uuid4().hex[:12]}"
    with closing_checkpointers():
        yield StoredPath(f"fsmem://{name}")
    fs = MemoryFileSystem()
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _stored_root(request, tmp_path) -> Iterator[object]:
    if request.param == "disk":
        yield tmp_path
        return
    disk_only = request.node.get_closest_marker("disk_only")
    if disk_only:
        pytest.skip(f"on disk only: {disk_only.args[0]}")
    if request.param == "s3":
        yield request.getfixturevalue("s3_root")
        return
    from ddpckpt.storage import storage_for

    name = f"test-{uuid.uuid4().hex[:12]}"
    yield StoredPath(f"memory://{name}")
    storage_for(f"memory://{name}").clear(name)


@pytest.fixture(params=["disk", "memory"])
def ckpt_root(request, tmp_path) -> Iterator[object]:
    """An empty place to save checkpoints: ``tmp_path``, then a fresh ``memory://`` store.
    Suites written against it prove that the library reaches bytes only through the storage
    interface; tests marked ``disk_only`` run on the file system alone."""
    yield from _stored_root(request, tmp_path)


@pytest.fixture(params=["disk", "memory", "s3"])
def run_root(request, tmp_path) -> Iterator[object]:
    """As ``ckpt_root``, and a fresh prefix on a local S3 server as well: for the
    Checkpointer's suite (resume, fallback, retention), what S3 users rely on most. The save
    and load suites run on disk and memory only, to keep the test run short; S3's own
    semantics are in tests/storage."""
    yield from _stored_root(request, tmp_path)
