"""Names an object store lists, checked before they are used: a key is used exactly as
listed, so a name with an empty, ``.`` or ``..`` segment (``step-6/./manifest.json``,
``run//x``), which a path-like split would turn into another key, is never one of ours.
Such names are skipped, each reported with a WARNING naming the key (once per process,
not at every listing; past :data:`_MAX_REPORTED` keys, one line says the rest go unnamed):
never read, copied or deleted by name.
"""

from __future__ import annotations

import threading

from ddpckpt._log import get_logger

_log = get_logger(__name__)
_BAD_SEGMENTS = ("", ".", "..")
_MAX_REPORTED = 10_000  # keys remembered, so each is reported once per process
_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def is_plain_name(name: str) -> bool:
    """Whether every ``/``-separated segment of ``name`` is a real name (not empty, ``.``
    or ``..``); an empty ``name`` is not."""
    return not any(segment in _BAD_SEGMENTS for segment in name.split("/"))


def plain_name(name: str, key: str, where: str) -> str | None:
    """``name`` (listed under ``where`` as the object or prefix ``key``) if it is plain;
    else ``None``, after a WARNING naming ``key``."""
    if is_plain_name(name):
        return name
    with _reported_lock:
        if (where, key) in _reported or len(_reported) > _MAX_REPORTED:
            return None
        _reported.add((where, key))
        full = len(_reported) > _MAX_REPORTED
    if full:  # one last line, not one per key at every listing from now on
        _log.warning(
            "%s: more than %d listed objects with an empty, '.' or '..' segment in their "
            "names were skipped; the others are skipped without a word",
            where,
            _MAX_REPORTED,
        )
        return None
    _log.warning(
        "%s: skipped the object %r listed there: its name has an empty, '.' or '..' "
        "segment, which ddpckpt never writes and would read as another key; it is not used "
        "(delete it with your storage's own tools if nobody needs it)",
        where,
        key,
    )
    return None
