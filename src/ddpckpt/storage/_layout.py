"""The names ddpckpt gives what it stores: the manifest (the commit marker), the temporary
siblings of what is being written, and the copy an overwrite keeps of the checkpoint it
replaces."""

from __future__ import annotations

import uuid

MANIFEST = "manifest.json"  # the commit marker both strategies rely on
_TEMP_MARK = ".tmp-"
_PREVIOUS_MARK = ".previous"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_name(location: str, token: str) -> str:
    """A temporary sibling of ``location``: ``dir/.name.tmp-<token>``."""
    head, slash, name = location.rstrip("/").rpartition("/")
    return f"{head}{slash}.{name}{_TEMP_MARK}{token}"


def is_temp_name(name: str) -> bool:
    """True for names of temporary (uncommitted) directories and files this library makes."""
    return name.startswith(".") and _TEMP_MARK in name


def previous_name(location: str) -> str:
    """Where an overwrite without an atomic exchange keeps the committed checkpoint it
    replaces until the new one is durable: ``dir/.name.previous``. No temporary: that
    copy *is* the checkpoint ``name`` while ``name`` is missing."""
    head, slash, name = location.rstrip("/").rpartition("/")
    return f"{head}{slash}.{name}{_PREVIOUS_MARK}"


def previous_of(name: str) -> str | None:
    """The checkpoint name whose replaced copy ``name`` is (see :func:`previous_name`)."""
    if name.startswith(".") and name.endswith(_PREVIOUS_MARK) and not is_temp_name(name):
        return name[1 : -len(_PREVIOUS_MARK)] or None
    return None
