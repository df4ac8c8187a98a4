"""Holding the overlap mode's deferred copies, to put a write between ``save()`` and them."""

from __future__ import annotations

import threading

import ddpckpt._io.staging as staging


class HeldCopies:
    """Holds the overlap mode's deferred copies (the "ddpckpt-snapshot" thread) until
    :meth:`release`; ``copied`` is set once they have landed, and the check that follows
    waits for ``checked`` (set at once unless ``hold_check``)."""

    def __init__(self, monkeypatch, hold_check: bool = False) -> None:
        self.released, self.copied, self.checked = (threading.Event() for _ in range(3))
        if not hold_check:
            self.checked.set()
        real = staging._copy

        def held(pairs):
            if pairs and threading.current_thread().name == "ddpckpt-snapshot":
                assert self.released.wait(30), "the copies were never released"
                real(pairs)
                self.copied.set()
                assert self.checked.wait(30), "the check was never let go on"
                return
            real(pairs)

        monkeypatch.setattr(staging, "_copy", held)

    def release(self) -> None:
        self.released.set()
