"""Fault injection at the file-system boundary, for the crash-consistency suite.

:class:`Faults` wraps the ``os`` calls a save makes, numbers each event while armed, and
at event ``at`` either kills the process with SIGKILL *before* the call runs, or makes the
call fail with ENOSPC/EROFS/EIO. Independently of the library, it logs
every executed rename of a temporary onto a ``step-N`` name to an oracle file: those
checkpoints were committed before the fault (a rename back from ``.step-N.previous`` puts
an older commit back, and is no new one).
"""

from __future__ import annotations

import errno
import os
import re
import signal
from typing import Any

_STEP = re.compile(r"^step-\d+$")
_REAL = {
    name: getattr(os, name)
    for name in ("open", "write", "fsync", "rename", "replace", "mkdir", "unlink", "rmdir")
}


def category(kind: str, name: str, target: str = "") -> str:
    """Which phase of a save an event belongs to."""
    if kind == "rename" and _STEP.match(target):
        return "commit"
    if kind == "rename" and _STEP.match(name):
        return "delete"
    if kind in ("unlink", "rmdir") and ".tmp-" not in name and name != ".lock":
        return "delete"
    if "latest" in name or "latest" in target:
        return "latest"
    if name == "manifest.json":
        return "manifest"
    if name.endswith(".safetensors"):
        return "data"
    if kind == "fsync":
        return "fsync"
    return "other"


class Faults:
    """``at``: the number of the event to fault, counting every event, or with ``match``
    (a regular expression) only the events whose description matches it; with ``after``
    (another), counting only the events after the first that matches it (the ``mkdir`` of
    one save's temporary, say, where saves overlap)."""

    def __init__(
        self,
        oracle: str,
        at: int | None = None,
        action: str = "kill",
        match: str | None = None,
        after: str | None = None,
    ) -> None:
        self.oracle = oracle
        self.at = at
        self.action = action
        self.match = re.compile(match) if match else None
        self.after = re.compile(after) if after else None
        self.matched = 0
        self.count = 0
        self.armed = False
        self.events: list[tuple[str, str]] = []
        self._names: dict[int, str] = {}
        self.fired = False
        self.window: tuple[int, int] | None = None  # events of one save, set by the trainer

    def install(self) -> None:
        for name in _REAL:
            setattr(os, name, self._wrap(name))

    def uninstall(self) -> None:
        for name, real in _REAL.items():
            setattr(os, name, real)

    def note(self, line: str) -> None:
        fd = _REAL["open"](self.oracle, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _REAL["write"](fd, (line + "\n").encode())
            _REAL["fsync"](fd)
        finally:
            os.close(fd)

    def _event(self, kind: str, name: str, target: str = "") -> None:
        if not self.armed:
            return
        what = f"{kind} {name} {target}".strip()
        self.events.append((category(kind, name, target), what))
        if self.after is not None:
            if self.after.fullmatch(what):
                self.after = None
            return
        index = self.count
        self.count += 1
        if self.match is not None:
            if not self.match.fullmatch(what):
                return
            index, self.matched = self.matched, self.matched + 1
        if index != self.at or self.fired:
            return
        self.fired = True
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        code = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}.get(self.action, errno.EIO)
        raise OSError(code, os.strerror(code), name)

    def _wrap(self, kind: str) -> Any:
        real = _REAL[kind]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kind in ("write", "fsync"):
                self._event(kind, self._names.get(args[0], "?"))
                return real(*args, **kwargs)
            if kind in ("rename", "replace"):
                source, target = os.path.basename(str(args[0])), os.path.basename(str(args[1]))
                self._event("rename", source, target)
                result = real(*args, **kwargs)
                if self.armed and _STEP.match(target) and ".tmp-" in source:
                    self.note(f"committed {target}")
                return result
            name = os.path.basename(str(args[0]))
            if kind == "open":
                flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
                if flags & os.O_CREAT:
                    self._event("create", name)
                fd = real(*args, **kwargs)
                self._names[fd] = name
                return fd
            self._event(kind, name)
            return real(*args, **kwargs)

        return wrapper
