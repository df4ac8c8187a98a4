"""A missing framework: importing its integration says which extra to install, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "accelerate", "transformers", "ray"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
"""

SCRIPT = """
for name in ("lightning", "accelerate", "transformers", "ray"):
    try:
        __import__(f"ddpckpt.integrations.{name}")
    except ImportError as exc:
        print(type(exc).__name__, exc, exc.__cause__, exc.__suppress_context__)
"""


@pytest.mark.processes
def test_each_integration_without_its_framework_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)  # as if not installed
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.splitlines() == [
        "ImportError ddpckpt.integrations.lightning needs PyTorch Lightning, which is not "
        "installed: pip install 'ddpckpt[lightning]' None True",
        "ImportError ddpckpt.integrations.accelerate needs Hugging Face Accelerate, which is "
        "not installed: pip install 'ddpckpt[accelerate]' None True",
        "ImportError ddpckpt.integrations.transformers needs Hugging Face transformers, which "
        "is not installed: pip install 'ddpckpt[transformers]' None True",
        "ImportError ddpckpt.integrations.ray needs Ray Train, which is not installed: "
        "pip install 'ddpckpt[ray]' None True",
    ], done.stderr
