"""Names an object store lists, checked before they are used: a key is used exactly as
listed, so a name with an empty, ``.`` or ``..`` segment (``step-6/./manifest.json``,
``run//x``), which a path-like split would turn into another key, is never one of ours.
Such names are skipped (never read, copied, moved or deleted by name), each
reported with a WARNING once per process, whichever listing meets it: an object by its full
key, a prefix that a delimited listing shows in place of its objects (``step-6/./``) as the
prefix that every skipped object's key starts with; an object under a prefix already
reported is not reported again. Past :data:`_MAX_REPORTED` names, one line says the rest go
unnamed.
"""

from __future__ import annotations

import threading

from ddpckpt._log import get_logger

_log = get_logger(__name__)
_BAD_SEGMENTS = ("", ".", "..")
_MAX_REPORTED = 10_000  # names remembered, so each is reported once per process
# (bucket, key, whether a prefix): what was reported, whichever listing met it
_reported: set[tuple[str, str, bool]] = set()
_reported_lock = threading.Lock()
_WHY = (
    "has an empty, '.' or '..' segment, which ddpckpt never writes and which would read as "
    "another key"
)


def is_plain_name(name: str) -> bool:
    """Whether every ``/``-separated segment of ``name`` is a real name (not empty, ``.``
    or ``..``); an empty ``name`` is not."""
    return not any(segment in _BAD_SEGMENTS for segment in name.split("/"))


def plain_name(
    name: str, key: str, where: str, *, bucket: str = "", prefix: bool = False
) -> str | None:
    """``name`` if it is plain; else ``None``, after a WARNING (once per process).

    Args:
        name: What the listing of ``where`` gives, relative to ``where``.
        key: Its full key (or path) in the store, as the user's own tools name it.
        where: The location listed.
        bucket: The bucket ``key`` is in, where the store has buckets and ``key`` does not
            name it.
        prefix: ``key`` is a prefix that a delimited listing shows in place of the objects
            under it (it ends with ``/``), not an object.
    """
    if is_plain_name(name):
        return name
    with _reported_lock:
        if _known(bucket, key, prefix) or len(_reported) > _MAX_REPORTED:
            return None
        _reported.add((bucket, key, prefix))
        full = len(_reported) > _MAX_REPORTED
    if full:  # one last line, not one per key at every listing from now on
        _log.warning(
            "%s: more than %d listed objects or prefixes with an empty, '.' or '..' segment "
            "in their names were skipped; the others are skipped without a word",
            where,
            _MAX_REPORTED,
        )
        return None
    in_bucket = f" in bucket {bucket!r}" if bucket else ""
    if prefix:
        _log.warning(
            "%s: skipped every object whose key starts with %r%s (listed there as a prefix): "
            "that prefix %s; ddpckpt never reads them. Delete them with your storage's own "
            "tools if nobody needs them",
            where,
            key,
            in_bucket,
            _WHY,
        )
    else:
        _log.warning(
            "%s: skipped the object %r%s listed there: its key %s; ddpckpt never reads it. "
            "Delete it with your storage's own tools if nobody needs it",
            where,
            key,
            in_bucket,
            _WHY,
        )
    return None


def _known(bucket: str, key: str, prefix: bool) -> bool:
    """Whether ``key`` was reported, or lies under a prefix that was (the lock held)."""
    if (bucket, key, prefix) in _reported:
        return True
    return any(
        (bucket, key[: end + 1], True) in _reported
        for end, char in enumerate(key[:-1])
        if char == "/"
    )
