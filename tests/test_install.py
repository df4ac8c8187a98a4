"""A plain ``pip install ddpckpt`` (no extras) runs the main job, ``ddpckpt demo``.

Builds a fresh virtual environment with torch (the copy running these tests) and this
project installed by ``pip install`` without any extra, checks that no optional dependency
is there, then runs the demo as a user would, and ``ddpckpt bench``, which says how to run
the benchmark (kept in the source tree, not in the package) from a clone.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ddpckpt._cli.bench_cmd import NOT_INSTALLED

pytestmark = [pytest.mark.long, pytest.mark.processes, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("numpy", "torchdata", "matplotlib", "safetensors", "tqdm")


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    # The installed copy only; and bytecode written, as a user's Python does: installed with
    # --no-compile, every process would otherwise compile what it imports again.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, env=env, **kwargs
    )


def link_torch(venv: Path, linked: Path) -> None:
    """torch and what it requires, importable in ``venv`` from this interpreter's copies: a
    ``.pth`` file names ``linked``, a directory of links to their files, which pip counts as
    installed, as if ``pip install torch==VERSION`` had unpacked them again (half of this
    test's time). pip changes nothing there: it installs into the venv and never removes what
    lies outside it, as ``linked`` does (the venv's Python writes bytecode next to the
    sources, as ours does). setuptools (torch requires a newer one than a venv may have) is
    left to pip."""
    linked.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        assert dist.files, f"{name}: no record of its files"
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            if not (linked / top).exists():
                (linked / top).symlink_to(dist.locate_file(top))
        for text in dist.requires or []:
            requirement = Requirement(text)
            needed = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
            if needed and requirement.name.lower() != "setuptools":
                todo.append(requirement.name)
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "torch-linked.pth").write_text(f"{linked}\n")


def test_plain_install_runs_the_demo_and_says_where_the_benchmark_is(tmp_path) -> None:
    venv = tmp_path / "venv"
    python, ddpckpt = venv / "bin" / "python", venv / "bin" / "ddpckpt"
    done = run([sys.executable, "-m", "venv", str(venv)], timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    link_torch(venv, tmp_path / "torch-linked")
    step = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(ROOT)]
    done = run(step, timeout=600)
    assert done.returncode == 0, f"{' '.join(step)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    check = f"import importlib.util as u; print([m for m in {OPTIONAL!r} if u.find_spec(m)])"
    assert run([str(python), "-c", check], timeout=120).stdout.strip() == "[]"

    demo = run(
        # one rank: what the install must carry is the same at any size; the demo at 3
        # ranks, with its plots, is tests/cli/test_demo.py's
        [str(ddpckpt), "demo", "--nproc", "1", "--steps", "12", "--every", "4", "--out",
         str(tmp_path / "demo")],
        timeout=600, cwd=tmp_path,
    )  # fmt: skip
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output[-4000:]
    assert "Traceback" not in output
    assert "ddpckpt demo: 1 rank, 12 optimizer steps, a checkpoint every 4" in demo.stdout
    assert "verdict: the resume is exact at every kill point" in demo.stdout
    assert "plot: not drawn: matplotlib is not installed (pip install 'ddpckpt[demo]')" in output

    bench = run([str(ddpckpt), "bench", "--out", str(tmp_path / "bench")], timeout=300)
    assert bench.returncode == 2 and "Traceback" not in bench.stderr
    said = [line for line in bench.stderr.splitlines() if line.startswith("ddpckpt bench:")]
    assert said == [f"ddpckpt bench: error: {NOT_INSTALLED}"]  # the benchmark is not in a wheel
    assert not (tmp_path / "bench").exists()
