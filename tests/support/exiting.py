"""Ending a test process without the interpreter's teardown.

torch 2.13's gloo worker threads can drop a finished work after the interpreter began to
finalize; the process then aborts with "terminate called without an active exception"
(exit -6) although every rank finished its work (pytorch/pytorch#190489: the work's
thread-local state holds a Python object whose release takes the GIL). Loaded CI machines
see it in DDP and FSDP2 runs, with or without ddpckpt. Test processes whose exit status is
asserted end through :func:`exit_now`: what a normal exit does first still happens (other
threads that are not daemons are joined, atexit handlers run, output is flushed), and the
process ends before finalization.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Join the non-daemon threads, run the atexit handlers, flush, and ``os._exit(code)``."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
