"""How long ddpckpt's collectives wait: the timeout, and when rank 0 says whom it waits for."""

from __future__ import annotations

import os

DEFAULT_TIMEOUT = 600.0
DEFAULT_WAIT_NOTICE = 10.0
# seconds rank 0 waits at most, once done, for the others to be done with the store it may
# hold: to leave a call that succeeded, or (at exit) to read its last published answer
LEAVE_WAIT = 30.0


def resolve_timeout(timeout: float | None) -> float:
    """The effective timeout: ``timeout``, else ``$DDPCKPT_TIMEOUT``, else 600 seconds."""
    source = "timeout"
    if timeout is None:
        env = os.environ.get("DDPCKPT_TIMEOUT", "").strip()
        if not env:
            return DEFAULT_TIMEOUT
        source = "DDPCKPT_TIMEOUT"
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"DDPCKPT_TIMEOUT={env!r} is not a number of seconds") from None
    if not timeout > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def resolve_wait_notice() -> float:
    """Seconds rank 0 waits for ranks that have not called before saying so:
    ``$DDPCKPT_WAIT_NOTICE``, else 10."""
    env = os.environ.get("DDPCKPT_WAIT_NOTICE", "").strip()
    if not env:
        return DEFAULT_WAIT_NOTICE
    try:
        notice = float(env)
    except ValueError:
        raise ValueError(f"DDPCKPT_WAIT_NOTICE={env!r} is not a number of seconds") from None
    if not notice >= 0:
        raise ValueError(f"DDPCKPT_WAIT_NOTICE must be a number of seconds >= 0, got {env!r}")
    return notice
