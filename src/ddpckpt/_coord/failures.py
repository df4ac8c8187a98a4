"""Failures that cross ranks: one rank's exception described, every rank's combined.

:meth:`~ddpckpt._coord.comm.Comm.run` sends each rank's outcome to rank 0, which combines
the failures into one error, identical on every rank: the ranks' common error type where
they share one, with a per-rank report in ``failures``. Errors travel through the store
encoded as JSON (``Mark.ERROR`` and the document), never pickled, and are rebuilt by type name.
"""

from __future__ import annotations

import builtins
import json
import logging
import platform
from collections.abc import Sequence
from typing import Any

from ddpckpt._coord.wire import Mark
from ddpckpt._log import all_ranks, get_logger
from ddpckpt.errors import (
    CheckpointError,
    CheckpointWriteError,
    CollectiveTimeoutError,
    RankFailureError,
    error_class,
)

_log = get_logger(__name__)


class PeerFailure(Exception):
    """This rank stopped a transfer because another rank of the call failed; the combined
    error names that rank's failure, not this echo."""


def rank_list(ranks: Sequence[int]) -> str:
    """``ranks`` for a message, runs of three or more shortened: ``"1, 2, 5-9"``."""
    parts: list[str] = []
    ordered = sorted(ranks)
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}-{ordered[end]}")
        else:
            parts.extend(str(r) for r in ordered[start : end + 1])
        start = end + 1
    return ", ".join(parts)


def timeout_error(
    call: str, timeout: float, ranks: Sequence[int], tag: str
) -> CollectiveTimeoutError:
    """The error naming ``ranks``, silent for ``timeout`` seconds in step ``tag`` of ``call``."""
    names = rank_list(ranks)
    plural = "s" if len(ranks) > 1 else ""
    if tag == "enter":
        why = (
            f"rank{plural} {names} did not call {call} within {timeout:g} s. "
            f"{call} is collective: every rank must call it (not inside `if rank == 0`)"
        )
    else:
        why = (
            f"rank{plural} {names} stopped responding during {call} (step "
            f"'{tag}') for {timeout:g} s: the process died or hangs"
        )
    error = CollectiveTimeoutError(
        f"{why}. Raise the limit with timeout= or DDPCKPT_TIMEOUT if it is only slow."
    )
    error.failures = {r: f"CollectiveTimeoutError: no response in step '{tag}'" for r in ranks}
    return error


def unwrap(blob: bytes) -> bytes:
    """The data of a reply (``Mark.DATA`` and data), or raise the error it carries
    (``Mark.ERROR``, or ``Mark.FAILED``: a failure another rank posted, put there by this
    rank's heartbeat)."""
    if Mark.raises(blob):
        raise decode_error(blob)
    return blob[1:]


def decode_error(blob: bytes) -> CheckpointError:
    """The error :func:`encode_error` encoded in ``blob``."""
    doc = json.loads(blob[1:])
    cls = error_class(doc["type"])
    errno = doc.get("errno")
    error = cls(errno, doc["message"]) if errno is not None else cls(doc["message"])
    error.failures = {int(r): f for r, f in doc["failures"].items()}
    return error


def encode_error(exc: CheckpointError) -> bytes:
    """``exc`` as a reply that :func:`unwrap` raises again on another rank."""
    doc: dict[str, Any] = {"type": type(exc).__name__, "failures": exc.failures}
    if isinstance(exc, OSError) and exc.errno is not None:  # rebuilt as cls(errno, strerror)
        doc.update(errno=exc.errno, message=exc.strerror)
    else:
        doc["message"] = str(exc)
    return Mark.ERROR + json.dumps(doc).encode()


def describe(exc: BaseException) -> dict[str, Any]:
    """What rank 0 needs to know of this rank's failure: type, message, errno, host."""
    message = str(exc) or type(exc).__name__  # KeyboardInterrupt has no message
    if isinstance(exc, OSError) and exc.strerror is not None:  # without the "[Errno N]" prefix
        message = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return {
        "type": type(exc).__name__,
        "message": message,
        "errno": getattr(exc, "errno", None),
        "host": platform.node(),
    }


def combine(call: str, failures: dict[int, dict[str, Any]]) -> CheckpointError:
    """One error describing every rank's failure, identical on every rank (ranks that only
    stopped because another failed, :class:`PeerFailure`, are left out)."""
    failures = {r: f for r, f in failures.items() if f["type"] != "PeerFailure"} or failures
    kinds = {f["type"] for f in failures.values()}
    messages = {(f["type"], f["message"]) for f in failures.values()}
    ranks = sorted(failures)
    on = ", ".join(str(r) for r in ranks)
    if len(messages) == 1:
        text = f"{_labelled(failures[ranks[0]])} (on rank{'s' if len(ranks) > 1 else ''} {on})"
    else:
        lines = [
            f"  rank {r} ({failures[r]['host']}): {failures[r]['type']}: {failures[r]['message']}"
            for r in ranks
        ]
        text = f"{call} failed on {len(ranks)} rank(s):\n" + "\n".join(lines)
    if len(kinds) > 1:  # e.g. incomplete on one rank, corrupt on another: both are corrupt
        common = _common_error(kinds)
        kinds = {common.__name__} if common is not None else kinds
    if len(kinds) == 1:
        kind = kinds.pop()
        cls = error_class(kind)
        errnos = {f.get("errno") for f in failures.values()}
        if cls is RankFailureError and _is_os_error(kind):
            cls = CheckpointWriteError
        if issubclass(cls, OSError) and len(errnos) == 1 and errnos != {None}:
            error: CheckpointError = cls(errnos.pop(), text)
        else:
            error = cls(text)
    else:
        error = RankFailureError(text)
    error.failures = {r: f"{f['type']}: {f['message']}" for r, f in failures.items()}
    return error


def _labelled(failure: dict[str, Any]) -> str:
    """A failure's message, after its exception type unless that is a ddpckpt error (whose
    type the combined error keeps)."""
    kind, message = failure["type"], failure["message"]
    if error_class(kind) is not RankFailureError or _is_os_error(kind) or message == kind:
        return message  # an OSError becomes a CheckpointWriteError with its errno
    return f"{kind}: {message}"


def _common_error(kinds: set[str]) -> type[CheckpointError] | None:
    """The most specific ddpckpt error class all ``kinds`` share, if more specific than the base."""
    classes = [error_class(k) for k in kinds]
    if any(c is RankFailureError for c in classes):
        return None
    for candidate in classes[0].__mro__:
        if candidate is CheckpointError:
            return None
        if isinstance(candidate, type) and all(issubclass(c, candidate) for c in classes):
            return candidate
    return None


def _is_os_error(name: str) -> bool:
    builtin = getattr(builtins, name, None)
    return isinstance(builtin, type) and issubclass(builtin, OSError)


def shorten(error: BaseException) -> bool:
    """Make ``error`` ready to leave a public collective call, on each rank that raises
    it; whether it changed (then raise it with ``raise error``, not a bare ``raise``).

    A failure every rank raises (a ddpckpt error with ``failures``, each rank's part one of
    ddpckpt's own errors, whose message says all there is) loses its traceback through the
    coordination and the chained copy of the same failure on the rank that saw it: the
    user's traceback then ends at the call they made, once per process, with the one
    message. Its full traceback goes to the ``ddpckpt`` logger at DEBUG level; with that
    level set, or ``DDPCKPT_LOG_ALL_RANKS=1``, ``error`` is left whole. Anything else (a
    bug's exception, KeyboardInterrupt) is left whole too.
    """
    failures = getattr(error, "failures", None)
    cause = error.__cause__
    if (
        not isinstance(error, CheckpointError)
        or not failures
        or not all(_own_error(text) for text in failures.values())
        or (cause is not None and not isinstance(cause, CheckpointError))
        or all_ranks()
        or logging.getLogger("ddpckpt").isEnabledFor(logging.DEBUG)
    ):
        return False
    _log.debug(
        "where %s was raised on this rank", type(error).__name__,
        exc_info=(type(error), error, error.__traceback__),
    )  # fmt: skip
    error.__cause__ = None  # also suppresses the context: the same failure, once
    error.with_traceback(None)
    return True


def _own_error(failure: str) -> bool:
    """Whether a rank's part of ``failures`` (``"Type: message"``) is a ddpckpt error."""
    kind = failure.split(":", 1)[0]
    return error_class(kind) is not RankFailureError or kind == RankFailureError.__name__
