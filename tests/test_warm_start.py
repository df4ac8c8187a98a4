"""The suite's warm starts (tests/support/warm_start.py): a program forked from the warm
server behaves as the same program started cold, as far as a test can see: what it is
given, how it ends, the signals it gets; and what the server cannot reproduce starts cold."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from warm.warm_ended import ended

pytestmark = pytest.mark.processes

if os.environ.get("DDPCKPT_TEST_COLD"):
    pytest.skip("the suite runs cold (DDPCKPT_TEST_COLD)", allow_module_level=True)

SHOW = textwrap.dedent(
    """
    import os, resource, signal, sys
    import numpy
    print("argv", sys.argv)
    print("name", __name__, __file__)
    print("path0", sys.path[0])
    print("cwd", os.getcwd())
    print("env", os.environ.get("SOME_SETTING"))
    print("umask", oct(os.umask(0)))
    print("fsize", resource.getrlimit(resource.RLIMIT_FSIZE))
    print("sigint", signal.getsignal(signal.SIGINT))
    print("sigusr1", signal.getsignal(signal.SIGUSR1))
    print("stdin", sys.stdin.read().strip())
    os.write(int(os.environ["FD"]), b"to the descriptor it was given")
    print("warnings", sys.warnoptions)
    print("streams", sys.stdout.encoding, sys.stderr.errors, sys.stderr.line_buffering,
          sys.stdout.name, repr(sys.stdin.newlines), sys.dont_write_bytecode)
    def annotated(a: int) -> None: ...
    print("annotations", annotated.__annotations__)  # no __future__ of the server's
    print("main", list(k for k in vars() if k.startswith("__")))
    print("parent", os.getppid())  # the process that started it
    import site, sysconfig, tempfile
    print("user base", site.getuserbase(), sysconfig.get_config_var("userbase"))  # its HOME
    import atexit, importlib.util
    # the library under test: not loaded until it is imported
    print("ddpckpt", "ddpckpt" in sys.modules, importlib.util.find_spec("ddpckpt").parent)
    if sys.argv[1] in ("0", "raise"):  # what the server imported first (seconds, cold)
        import torch._dynamo
        print("inductor cache", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))  # set by the import
        before = atexit._ncallbacks()
        import ddpckpt  # registers with atexit as it loads
        print("registered at import", atexit._ncallbacks() - before)
    print("tmp", tempfile.gettempdir())
    import threading, time, teardown  # its own module, next to it
    class Noted:  # says when the interpreter's teardown frees it
        def __del__(self):
            print("freed: a global of __main__", flush=True)
    kept = Noted()
    import weakref  # its finalizer runs at exit (those of what the server loaded do not)
    weakref.finalize(Noted, print, "finalizer at exit", flush=True)
    atexit.register(print, "atexit", flush=True)
    threading.Thread(target=lambda: time.sleep(0.2) or print("thread joined")).start()
    sys.stdout.flush()
    if sys.argv[1] == "raise":
        raise ValueError("planted")
    sys.exit(sys.argv[1])
    """
)


# a module the program imports, kept alive past its removal from sys.modules (by a logger,
# which lives as long as the interpreter): its global is freed when the teardown clears it
TEARDOWN = textwrap.dedent(
    """
    import logging, sys
    class Noted:
        def __del__(self, stderr=sys.stderr):  # its module's globals are None by then
            print("freed: a global of an imported module", file=stderr, flush=True)
    kept = Noted()
    logging.getLogger("teardown").module = sys.modules[__name__]
    """
)


def _run(
    argv: list[str], env: Mapping[str, str], cwd: Path, *, warm: bool, log: Path, **kwargs
) -> subprocess.CompletedProcess[str]:
    env = {**env, "DDPCKPT_TEST_WARM_LOG": str(log)}
    if not warm:
        env.pop("DDPCKPT_TEST_WARM")
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs
    )


def _starts(log: Path) -> list[str]:
    return [start for start, _ in _starts_and_why(log)]


def _starts_and_why(log: Path) -> list[list[str]]:
    """Each start the log noted: ``["warm", ""]``, or ``["cold", why]``."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split("\t")[:2] for line in lines]


@pytest.mark.parametrize("ending", ["0", "3", "a message", "raise"])
def test_a_warm_program_is_given_and_ends_as_a_cold_one(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "scripts" / "show.py"
    script.parent.mkdir()
    script.write_text(SHOW)
    (script.parent / "teardown.py").write_text(TEARDOWN)
    env = {**os.environ, "SOME_SETTING": "x", "HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # set in this test worker if it imported dynamo

    def limits() -> None:  # as a launcher's preexec_fn sets them
        os.umask(0o027)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, resource.RLIM_INFINITY))
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    runs = {}
    for warm in (False, True):
        r, w = os.pipe()
        log = tmp_path / f"starts-{warm}"
        done = _run([sys.executable, "-W", "ignore::FutureWarning", str(script), ending],
                    {**env, "FD": str(w)}, tmp_path, warm=warm, log=log, input="on stdin",
                    pass_fds=(w,), preexec_fn=limits)  # fmt: skip
        os.close(w)
        with os.fdopen(r) as f:
            runs[warm] = (done.returncode, done.stdout, done.stderr, f.read())
        assert _starts(log) == (["warm"] if warm else [])
    cold, warm = runs[False], runs[True]
    assert warm == cold
    assert f"path0 {script.parent}" in warm[1] and "stdin on stdin" in warm[1]
    assert warm[3] == "to the descriptor it was given"
    assert "fsize (1073741824, -1)" in warm[1] and "umask 0o27" in warm[1]
    assert f"user base {tmp_path}/.local {tmp_path}/.local" in warm[1]
    assert "ddpckpt False ddpckpt" in warm[1]
    if ending in ("0", "raise"):
        assert "inductor cache /" in warm[1] and "registered at import 1" in warm[1]
    if ending == "raise":
        assert warm[2].splitlines()[1] == f'  File "{script}", line 45, in <module>', warm[2]
    # how it ends, in the order Python's exit has it
    assert warm[1].split("tmp ")[1].splitlines()[1:] == [
        "thread joined", "atexit", "finalizer at exit", "freed: a global of __main__"
    ]  # fmt: skip
    assert warm[2].endswith("freed: a global of an imported module\n"), warm[2]


def test_signals_reach_the_program_and_its_end_is_the_stand_ins(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            def stop(signum, frame):
                print("stopped by", signal.Signals(signum).name, flush=True)
                sys.exit(5)
            signal.signal(signal.SIGTERM, stop)
            open("pid", "w").write(str(os.getpid()))
            if sys.argv[1] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
            """
        )
    )
    log = tmp_path / "starts"
    env = {**os.environ, "DDPCKPT_TEST_WARM_LOG": str(log)}

    def start(how: str) -> subprocess.Popen[str]:
        (tmp_path / "pid").unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, str(script), how], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        return proc

    proc = start("wait")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 5 and proc.stdout.read() == "stopped by SIGTERM\n"

    proc = start("die")
    assert proc.wait(30) == -signal.SIGKILL

    proc = start("wait")
    program = int((tmp_path / "pid").read_text())
    assert program != proc.pid
    proc.kill()  # the stand-in: its program goes too
    proc.wait(30)
    deadline = time.monotonic() + 30
    while not ended(program):
        assert time.monotonic() < deadline, "the program outlived its killed stand-in"
        time.sleep(0.02)
    assert _starts(log) == ["warm"] * 3


def test_a_signal_before_the_program_starts_and_one_to_the_group_reach_it(tmp_path: Path) -> None:
    """SIGTERM at once (before the stand-in knows the program's pid: the program gets it
    first thing, its handler not yet set) ends both runs alike; a SIGTERM to the stand-in's
    process group, as a launcher stops its workers, also reaches what the program started."""
    script = tmp_path / "starts_one.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            sleeper = subprocess.Popen(["sleep", "60"])
            open("sleeper", "w").write(str(sleeper.pid))
            time.sleep(60)
            """
        )
    )
    log = tmp_path / "starts"
    env = {**os.environ, "DDPCKPT_TEST_WARM_LOG": str(log)}
    codes = {}
    for warm in (False, True):
        run_env = env if warm else {k: v for k, v in env.items() if k != "DDPCKPT_TEST_WARM"}
        proc = subprocess.Popen([sys.executable, str(script)], env=run_env, cwd=tmp_path)
        proc.send_signal(signal.SIGTERM)
        codes[warm] = proc.wait(30)
    assert codes[True] == codes[False] == -signal.SIGTERM

    (tmp_path / "sleeper").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not (tmp_path / "sleeper").exists() or not (tmp_path / "sleeper").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    sleeper = int((tmp_path / "sleeper").read_text())
    while not ended(sleeper):
        assert time.monotonic() < deadline, "a process the program started missed the signal"
        time.sleep(0.02)
    assert _starts(log)[-1:] == ["warm"]  # the first warm run may end before it hands over


def test_a_module_runs_warm_and_what_the_server_cannot_reproduce_starts_cold(
    tmp_path: Path,
) -> None:
    (tmp_path / "mod.py").write_text("import sys\nprint('module', sys.argv)\n")
    script = tmp_path / "s.py"
    script.write_text("print('script')\n")
    log = tmp_path / "starts"
    env = dict(os.environ)
    done = _run([sys.executable, "-m", "mod", "x"], env, tmp_path, warm=True, log=log)
    assert done.stdout == f"module ['{tmp_path / 'mod.py'}', 'x']\n"
    cold = [
        ([sys.executable, "-O", str(script)], env),
        ([sys.executable, str(script)], {**env, "OMP_NUM_THREADS": "2"}),
        ([sys.executable, str(script)], {**env, "TMPDIR": str(tmp_path)}),  # read by dynamo
    ]
    for argv, run_env in cold:
        done = _run(argv, run_env, tmp_path, warm=True, log=log)
        assert done.stdout == "script\n", done.stderr
    shadow = tmp_path / "shadow"  # -c imports from its working directory first
    shadow.mkdir()
    (shadow / "numpy.py").write_text("print('script')\n")
    done = _run([sys.executable, "-c", "import numpy"], env, shadow, warm=True, log=log)
    assert done.stdout == "script\n", done.stderr
    assert _starts_and_why(log) == [
        ["warm", ""],
        ["cold", "option -O"],
        ["cold", "refused: other load-time environment: OMP_NUM_THREADS"],
        ["cold", "refused: other load-time environment: TMPDIR"],
        ["cold", "refused: another numpy on its path"],
    ]


def test_multiprocessings_resource_tracker_starts_cold(tmp_path: Path) -> None:
    """It lives as long as the process that started it: warm, the tracker of a test worker
    (started by its tests) was killed with the server before the worker ended, and its
    stand-in said so at the end of every run."""
    log = tmp_path / "starts"
    code = "from multiprocessing import resource_tracker as r; r.ensure_running(); print('ran')"
    done = _run([sys.executable, "-c", code], os.environ, tmp_path, warm=True, log=log)
    assert done.stdout == "ran\n", done.stderr
    assert _starts_and_why(log) == [
        ["warm", ""],
        ["cold", "multiprocessing's resource tracker"],
    ]


def _drop_a_capability() -> None:  # as a launcher's preexec_fn drops one of root's
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP CAP_DAC_OVERRIDE
        os._exit(77)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping root's capabilities needs root")
def test_a_program_with_other_capabilities_starts_cold(tmp_path: Path) -> None:
    """The server's fork has the test worker's capabilities, so a program started with fewer
    (a test playing an unprivileged job) must not run in it."""
    log = tmp_path / "starts"
    done = _run([sys.executable, "-c", "print('ran')"], os.environ, tmp_path, warm=True,
                log=log, preexec_fn=_drop_a_capability)  # fmt: skip
    if done.returncode == 77:
        pytest.skip("dropping a capability is not permitted here")
    assert done.stdout == "ran\n", done.stderr
    assert _starts_and_why(log) == [["cold", "refused: other capabilities"]]


CODE = """
import os, sys
print("argv", sys.argv, "path0", repr(sys.path[0]), "cwd", os.getcwd())
print("main", sorted(k for k in vars() if k.startswith("__")), __spec__, __loader__)
sys.stdout.flush()
raise ValueError(sys.argv[1])
"""


def test_a_program_given_with_c_runs_warm_as_it_runs_cold(tmp_path: Path) -> None:
    runs = {}
    for warm in (False, True):
        log = tmp_path / f"starts-{warm}"
        done = _run([sys.executable, "-c", CODE, "planted"], os.environ, tmp_path, warm=warm,
                    log=log)  # fmt: skip
        runs[warm] = (done.returncode, done.stdout, done.stderr)
        assert _starts(log) == (["warm"] if warm else [])
    assert runs[True] == runs[False]
    code, out, err = runs[True]
    assert code == 1 and f"argv ['-c', 'planted'] path0 '' cwd {tmp_path}" in out
    assert err.splitlines()[1:] == [
        '  File "<string>", line 6, in <module>',
        "ValueError: planted",
    ], err


AS_LAUNCHED = textwrap.dedent(
    """
    import os, signal, sys
    import multiprocessing.util
    print("pid", os.getpid(), "parent", os.getppid())
    class Thing: ...
    thing = Thing()
    multiprocessing.util.Finalize(thing, print, args=("finalized",))()  # compares pids
    child = os.fork()
    if child == 0:
        os.write(1, f"child {os.getpid()} {os.getppid()}\\n".encode())
        os._exit(0)
    os.waitpid(child, 0)
    print("child pid", child, flush=True)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    print("still running", flush=True)
    """
)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_under_check_resume_a_warm_program_sees_the_pid_its_launcher_knows(
    tmp_path: Path, sig: str
) -> None:
    """check-resume matches the pids its ranks record with those their launcher reports:
    the program's own process sees its stand-in's pid, a signal to it reaches the program
    at once, and a process it forks sees its own."""
    script = tmp_path / "s.py"
    script.write_text(AS_LAUNCHED)
    log = tmp_path / "starts"
    env = {**os.environ, "DDPCKPT_CHECK_RESUME": str(tmp_path / "records")}
    process = subprocess.Popen([sys.executable, str(script), sig], env={**env,
        "DDPCKPT_TEST_WARM_LOG": str(log)}, stdout=subprocess.PIPE, text=True)  # fmt: skip
    out, _ = process.communicate(timeout=60)
    assert _starts(log) == ["warm"]
    assert process.returncode == -getattr(signal, sig), out
    lines = out.splitlines()
    assert lines[0] == f"pid {process.pid} parent {os.getpid()}" and "still running" not in out
    assert lines[1] == "finalized"
    child = int(lines[-1].split()[-1])
    assert f"child {child} {process.pid}" in out and child != process.pid


@pytest.mark.skipif(
    shutil.which("setpriv") is None or os.geteuid() != 0,
    reason="playing another user needs setpriv and root (CI runs as root)",
)
def test_another_users_program_starts_cold() -> None:
    shared = Path(tempfile.mkdtemp(prefix="warm-other-user-", dir="/tmp"))  # tmp_path is 0700
    try:
        shared.chmod(0o1777)
        script = shared / "s.py"
        script.write_text("import os\nprint('as', os.getuid())\n")
        script.chmod(0o644)
        log = shared / "starts"
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                sys.executable, str(script)]  # fmt: skip
        done = _run(argv, dict(os.environ), shared, warm=True, log=log)
        assert done.stdout == "as 65534\n", done.stderr
        # Cold: the server's socket refused it, or (a checkout only root may read, as CI's
        # clone) the stand-in itself was out of its reach.
        lines = log.read_text().splitlines() if log.exists() else []
        program = [sys.executable, str(script)]
        assert lines in ([], [f"cold\tno server ([Errno 13] Permission denied)\t{program!r}"])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
