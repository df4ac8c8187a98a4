"""A tiny training script that runs to its end, then ends the way ``EXIT_HOW`` says, for
check-resume's tests of how a run ended (tests/resumecheck/test_runner.py).

    torchrun --standalone --nproc-per-node 1 exiting_script.py DIR    (or python exiting_script.py DIR)

``EXIT_HOW``: ``raise`` (``raise SystemExit(3)``), ``builtin`` (the builtin ``exit(3)``),
``bound`` (``from sys import exit`` before ddpckpt is imported, then ``exit(3)``),
``os-exit`` (the atexit handlers run, then ``os._exit(3)``), ``abort`` (the atexit handlers
run, then SIGABRT: a death in the interpreter's teardown, as torch 2.13's gloo threads cause),
anything else: a normal end.
"""

from __future__ import annotations

import atexit
import os
import sys
from sys import exit  # bound before ddpckpt is imported: its hook of sys.exit misses it

import torch
import torch.distributed as dist

import ddpckpt

HOW = os.environ.get("EXIT_HOW", "")


def main(directory: str) -> None:
    if "RANK" in os.environ:  # under torchrun; else one process started by python
        dist.init_process_group("gloo")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 3):
        model(torch.ones(4, 2)).sum().backward()
        optimizer.step()
        ddpckpt.save(os.path.join(directory, f"step-{step}"), model=model, step=step)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    if HOW == "raise":
        raise SystemExit(3)
    if HOW == "builtin":
        __builtins__.exit(3) if hasattr(__builtins__, "exit") else __builtins__["exit"](3)
    if HOW == "bound":
        exit(3)
    if HOW in ("os-exit", "abort"):
        atexit._run_exitfuncs()
        sys.stderr.flush()
        os._exit(3) if HOW == "os-exit" else os.abort()
