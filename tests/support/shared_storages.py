"""The storages every test shares, as each test found them (a plugin of tests/conftest.py).

``monkeypatch.setattr(storage, "delete", ...)`` on a shared instance (the worker's default
S3 storage, the file system's, the in-memory one) undoes itself by setting the method it
saved, bound, on the instance: the instance keeps a copy of its class's method, and a later
test that patches the class is bypassed (retention on S3 recorded no deletion, once tests of
tests/storage/test_base.py had run first on the worker). After every test, such copies are
removed, and the tables that resolve a location to its storage are as before it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

_TABLES = ("_mounts", "_configured", "_schemes", "_configurable")


def _shared() -> list[Any]:
    import ddpckpt.storage._registry as storage

    s3 = sys.modules.get("ddpckpt.storage.s3")
    default = getattr(s3, "_default", None) if s3 is not None else None
    return [o for o in (storage._local, storage._memory, default) if o is not None]


def _copied_methods(instance: Any) -> list[str]:
    """Attributes of ``instance`` that shadow a method of its class."""
    cls = type(instance)
    return [k for k in vars(instance) if callable(getattr(cls, k, None))]


@pytest.fixture(autouse=True)
def _shared_storages_restored() -> Iterator[None]:
    """Set up before the test's ``monkeypatch`` (it takes none), so torn down after it."""
    import ddpckpt.storage._registry as storage

    tables = {name: dict(getattr(storage, name)) for name in _TABLES}
    guard = storage._guard
    yield
    for name, saved in tables.items():
        table = getattr(storage, name)
        table.clear()
        table.update(saved)
    storage._guard = guard
    for instance in _shared():
        for name in _copied_methods(instance):
            delattr(instance, name)
