"""A storage under test and a root location in it, for each implementation."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from ddpckpt.storage import Storage, resolve
from ddpckpt.storage.memory import SCHEME


@pytest.fixture(params=["posix", "memory"])
def store(request, tmp_path) -> Iterator[tuple[Storage, str]]:
    """``(storage, root)``: an empty directory or memory prefix to work under."""
    if request.param == "posix":
        yield resolve(os.fspath(tmp_path))
        return
    name = f"test-{uuid.uuid4().hex[:8]}"
    storage, root = resolve(f"{SCHEME}{name}/root")
    yield storage, root
    storage.clear(name)
