"""Whether a process has ended, and its parent: for sitecustomize.py (imported only while it
waits for the server, so standard library only), the server's programs and the tests of warm
starts."""

from __future__ import annotations


def stat_fields(pid: int) -> list[str]:
    """The fields of Linux's ``/proc/PID/stat`` after the command, from the state on (the
    parent's pid is the second): they follow its last ``)``, since a command may hold one.
    Raises OSError when there is no such process."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def ended(pid: int) -> bool:
    """Whether ``pid`` is gone, or has exited and is not reaped yet (a zombie, or a dead
    task)."""
    try:
        return stat_fields(pid)[0] in "ZX"
    except OSError:
        return True
