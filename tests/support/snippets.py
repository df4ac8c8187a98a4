"""The snippets of the README and the site's pages, and how each one runs as written.

Each ```python block is preceded by a marker comment saying how it runs:

* ``<!-- readme-test: python -->``: ``python snippet.py`` in a fresh directory;
* ``<!-- readme-test: torchrun N -->``: ``torchrun --nproc-per-node N snippet.py`` (gloo on CPU);
  these two in processes forked from a server that imported torch (see :func:`_launch`);
* ``<!-- readme-test: accelerate N -->``: ``accelerate launch --config_file C snippet.py``, ``C``
  as ``accelerate config`` writes it for N processes on one machine (see ACCELERATE_CONFIG);
* a trailing ``, twice``: run it again in the same directory (a restarted job), both must succeed;
* then ``, then check-resume``: ``ddpckpt check-resume -- <that command>`` in the same
  directory must find the resume exact, and leave every byte the runs wrote unchanged;
* ``<!-- readme-test: skip: REASON -->``: not run (only for the recipe a page warns against).

A run fails on a non-zero exit or a traceback printed by the snippet's own processes (see
``first_traceback`` for the lines Ray forwards from its own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from forked import run_python, run_ranks
from launch import RUN_SCRIPT, lost_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(
    r"(?:<!--\s*readme-test:\s*(?P<how>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S
)
HOW = re.compile(
    r"(?P<launcher>python|torchrun (?P<nproc>\d+)|accelerate (?P<processes>\d+))"
    r"(?P<twice>, twice)?(?P<check>, then check-resume)?$"
)


# What `accelerate config` writes for one machine and N processes. MULTI_GPU: on CPU,
# `accelerate launch --cpu --num_processes N` starts one process (N of them only through
# mpirun); with this the processes are started by torchrun, and the snippets' own
# Accelerator(cpu=not torch.cuda.is_available()) trains on CPU with gloo.
ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: {processes}
main_process_port: 0
mixed_precision: 'no'
"""


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    how: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _snippets(page: Path) -> list[Snippet]:
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    return [
        Snippet(
            name, text.count("\n", 0, m.start("code")), (m.group("how") or "").strip(), m["code"]
        )
        for m in BLOCK.finditer(text)
    ]


SNIPPETS = [snippet for page in PAGES for snippet in _snippets(page)]


RUNNABLE = [s for s in SNIPPETS if s.how and not s.how.startswith("skip:")]


def run_as_written(snippet: Snippet, tmp_path: Path) -> None:
    """Run ``snippet`` in ``tmp_path`` as its marker says; raises AssertionError on failure."""
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    runs = 2 if snippet.how.endswith(", twice") else 1
    for attempt in range(runs):
        code, output = _launch(snippet, script, tmp_path)
        assert code == 0, (
            f"{snippet.id} (run {attempt + 1} of {runs}) failed with exit {code}:\n{output[-8000:]}"
        )
        where = first_traceback(output)
        assert where < 0, f"{snippet.id}: a traceback:\n{output[max(where - 2000, 0) :][:8000]}"
    match = HOW.match(snippet.how)
    if match is not None and match["check"]:
        _check_resume(snippet, script, tmp_path)


# A line a Ray process forwards to the driver: "(TrainController pid=7) ...", colour codes
# around the prefix. Only RayTrainWorker runs the snippet's code; the others are Ray's own
# (its controller, placement-group cleaner, raylet), whose tracebacks on a loaded machine (a
# state API call timing out, an actor's restart notice) are Ray's, and a failure of the
# snippet's training function reaches the driver as fit()'s exception and a non-zero exit.
RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\((?P<who>[A-Za-z_][\w.]*)(?:[ ,][^)]*)?\)")


def first_traceback(stderr: str) -> int:
    """The offset of the first traceback the snippet's own processes printed, else -1."""
    offset = 0
    for line in stderr.splitlines(keepends=True):
        prefix = RAY_PREFIX.match(line)
        if "Traceback" in line and (prefix is None or prefix["who"] == "RayTrainWorker"):
            return offset + line.index("Traceback")
        offset += len(line)
    return -1


def _launch(snippet: Snippet, script: Path, cwd: Path) -> tuple[int, str]:
    """Run ``script`` once as ``snippet``'s marker says: its exit status and output.

    ``python`` and ``torchrun N`` run the snippet's code as written in plain processes
    started as torchrun starts its workers (forked.py: the environment torchrun gives them,
    the agent's way of stopping them), since the launcher is incidental to what these runs
    check and torchrun's agent costs a process of its own; the real ``torchrun`` runs them
    under ``then check-resume`` (and in the tests about launchers). ``accelerate N`` runs
    ``accelerate launch`` itself."""
    match = HOW.match(snippet.how)
    assert match is not None
    env = _environment(cwd)
    if match["launcher"] == "python":
        return run_python(RUN_SCRIPT, [str(script)], env=env, timeout=240, cwd=cwd)
    if match["nproc"]:
        return run_ranks(RUN_SCRIPT, [str(script)], nproc=int(match["nproc"]), env=env,
                         timeout=240, cwd=cwd)  # fmt: skip
    done = _run(_command(snippet, script), cwd)
    for _ in range(2):  # accelerate launch picks a free port, then torchrun binds it
        if not lost_port(done.returncode, done.stdout + done.stderr):
            break
        done = _run(_command(snippet, script), cwd)
    return done.returncode, done.stdout + done.stderr


def _command(snippet: Snippet, script: Path) -> list[str]:
    match = HOW.match(snippet.how)
    assert match is not None
    runner = [
        str(RUN_SCRIPT),
        str(script),
    ]  # the snippet as written, without torch's teardown abort
    if match["launcher"] == "python":
        return [sys.executable, *runner]
    if match["processes"]:  # accelerate launch, with a config file as `accelerate config` writes
        config = script.with_name("accelerate_config.yaml")
        config.write_text(ACCELERATE_CONFIG.format(processes=match["processes"]))
        accelerate = Path(sys.executable).with_name("accelerate")
        return [str(accelerate), "launch", "--config_file", str(config), *runner]
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), f"--nproc-per-node={match['nproc']}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=0", *runner]  # fmt: skip


def _environment(cwd: Path) -> dict[str, str]:
    """A user's shell, as far as a snippet sees it: the venv's tools on PATH, HOME in
    ``cwd``."""
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "HOME": str(cwd)}  # fmt: skip
    if "PYTHONPATH" in os.environ:  # a development checkout imported through PYTHONPATH
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    # The shell's locale, user and temporary directory, the CI flag (torch reads it when it
    # loads), the resolver's options (tests/conftest.py), and the suite's warm starts
    # (warm_server.py: a program whose values of these differ from the test worker's starts
    # cold).
    for name in ("LANG", "LC_ALL", "LC_CTYPE", "USER", "LOGNAME", "TMPDIR", "CI", "RES_OPTIONS",
                 "DDPCKPT_TEST_WARM", "DDPCKPT_TEST_WARM_LOG"):  # fmt: skip
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = _environment(cwd)
    try:
        return subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{cmd} hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}") from None


def _files(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (``None``) under ``root``."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _check_resume(snippet: Snippet, script: Path, cwd: Path) -> None:
    """``ddpckpt check-resume -- <the command>`` where the user ran it: the resume is exact,
    and nothing the user's runs wrote is read for resuming or changed."""
    before = _files(cwd)
    command = [str(Path(sys.executable).with_name("ddpckpt")), "check-resume", "--timeout=200",
               "--", *_command(snippet, script)]  # fmt: skip
    done = _run(command, cwd, timeout=500)
    assert done.returncode == 0, (
        f"{snippet.id}: check-resume:\n{done.stdout}\n{done.stderr[-4000:]}"
    )
    assert "verdict: the resume is exact at every kill point" in done.stdout
    assert "bit-identical at every step compared on every rank" in done.stdout
    assert not re.search(r"steps? [\d-]+ not compared", done.stdout), done.stdout  # all of them
    assert "ckpt (load_latest, save)" in done.stdout  # mapped into the check's directory
    home = (".cache", ".config")  # matplotlib's in HOME, which _run sets to cwd
    after = {k: v for k, v in _files(cwd).items() if not k.startswith(("resume-check", *home))}
    assert after == {k: v for k, v in before.items() if not k.startswith(home)}
