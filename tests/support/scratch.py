"""One temporary directory for everything the tests' processes leave behind (a pytest
plugin), removed at the end of the run.

torchrun makes a ``torchelastic_*`` directory for each launch and never removes it;
multiprocessing leaves its ``pymp-*`` directory when the tests kill a process on purpose; a
local Ray cluster writes its session there. Without this, every run of the suite left some
two hundred such directories in the system's temporary directory. The processes the tests
start (the workers, their servers, the launches) have ``TMPDIR`` set to one directory made
for the run, inside the temporary directory the run was given; pytest's own (``tmp_path``,
kept for the last three runs) stays where it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_scratch: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _scratch
    if hasattr(config, "workerinput"):  # pytest-xdist's worker: given its TMPDIR already
        return
    tempfile.gettempdir()  # this process keeps the one it was given (pytest's basetemp)
    _scratch = tempfile.mkdtemp(prefix="ddpckpt-tests-")
    # Shared like /tmp: some tests run processes as another user (setpriv).
    os.chmod(_scratch, 0o1777)
    os.environ["TMPDIR"] = _scratch


def pytest_unconfigure(config: pytest.Config) -> None:
    global _scratch
    if _scratch is None:
        return
    # After the workers ended; a process a test killed may still be exiting as it goes.
    shutil.rmtree(_scratch, ignore_errors=True)
    _scratch = None
