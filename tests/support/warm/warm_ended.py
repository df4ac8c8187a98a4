"""Whether a process has ended: for sitecustomize.py (imported only while it waits for the
server, so standard library only) and the tests of warm starts."""

from __future__ import annotations


def ended(pid: int) -> bool:
    """Whether ``pid`` is gone, or has exited and is not reaped yet (a zombie, or a dead
    task): Linux's ``/proc``, whose ``stat`` puts the state after the command's last ``)``
    (a command may hold one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True
