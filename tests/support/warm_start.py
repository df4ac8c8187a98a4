"""Warm starts for the processes the tests start (a pytest plugin).

Each test worker whose tests include the process or long tier starts one warm server
(warm_server.py: torch imported once) and puts warm/ on ``PYTHONPATH`` with
``DDPCKPT_TEST_WARM`` naming the server's socket, so that the Python processes its tests
start, with the worker's environment or one built from it (the launchers', the CLI's, the
documentation snippets'), are forked from the server instead of importing torch again:
about 2.5 s of CPU each, most of what a process test costs. What a
warm process shares with the server instead of having its own: warm_server.py. Which
processes start cold anyway, and why: warm/sitecustomize.py.

``DDPCKPT_TEST_COLD=1`` runs the suite with every process started cold, as before.
Subprocesses inherit ``OMP_NUM_THREADS=1`` (the launchers set it already), which the server
was started with.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tiers import MARKERS

WARM = Path(__file__).with_name("warm")
SERVER = Path(__file__).with_name("warm_server.py")
_server: subprocess.Popen[bytes] | None = None
_home: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the server once the tests this process runs are known, only if one of them
    may start a process (the process and long tiers): the unit tier starts none."""
    global _server, _home
    config = session.config
    if os.environ.get("DDPCKPT_TEST_COLD") or _server is not None:
        return
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test
    if not any(item.get_closest_marker(tier) for item in session.items for tier in MARKERS):
        return
    _home = tempfile.mkdtemp(prefix="warm-")
    os.chmod(_home, 0o700)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONWARNINGS", "PYTHONFAULTHANDLER", "DDPCKPT_TEST_WARM")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WARM), env.get("PYTHONPATH")) if p)
    socket = os.path.join(_home, "socket")
    with open(os.path.join(_home, "server.log"), "wb") as log:
        _server = subprocess.Popen(
            [sys.executable, str(SERVER), socket], env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    with open(socket + ".starting", "w") as f:  # stand-ins wait for it while it imports
        f.write(str(_server.pid))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    os.environ["DDPCKPT_TEST_WARM"] = socket


def pytest_unconfigure(config: pytest.Config) -> None:
    global _server, _home
    if _server is None:
        return
    _server.send_signal(signal.SIGTERM)
    try:
        _server.wait(10)
    except subprocess.TimeoutExpired:
        _server.kill()
        _server.wait()
    _server = None
    if _home is not None:
        shutil.rmtree(_home, ignore_errors=True)
        _home = None
