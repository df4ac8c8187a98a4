"""A warm start for the Python processes the test suite starts: ``python SCRIPT``,
``python -m MODULE``, ``python -c CODE`` and the venv's console scripts (``torchrun``,
``ddpckpt``) run in a process forked from the test worker's warm server
(tests/support/warm_server.py), which has imported torch already; this process stays as its
stand-in and ends as it ends.

Python imports this module at start-up when its directory is on ``PYTHONPATH``
(tests/support/warm_start.py puts it there for the test run) and ``DDPCKPT_TEST_WARM``
names the server's socket. The stand-in hands over what a fresh interpreter would have
(its command line, environment, working directory, open file descriptors, signal
dispositions and mask, resource limits, umask, warning options, module search path),
passes on every signal it can catch, and exits with the program's status (or dies of the
signal that killed it). Killed itself (SIGKILL), it takes the program with it.

Anything the server cannot reproduce starts cold, as Python itself: another interpreter or
user, options other than ``-u``/``-B``/``-W``/``-X faulthandler``, a script inside
site-packages other than Ray's workers (its workers' set-up script, its daemons),
multiprocessing's resource tracker (which outlives the server when a test worker starts it),
or environment variables read when torch loads that differ from the server's. Under ``ddpckpt
check-resume`` (which tells processes apart by their pids) the program sees this process's
pid as its own. ``DDPCKPT_TEST_WARM_LOG=FILE`` appends one line per start: warm, or cold and
why.
"""

from __future__ import annotations


def _start_warm() -> None:
    import os
    import sys

    where = os.environ.get("DDPCKPT_TEST_WARM")
    if not where:
        return
    command = _command(os, sys)
    # _handover returns only when the server refused
    reason = command if isinstance(command, str) else _handover(where, command, os, sys)
    _note(f"cold\t{reason}", os, sys)


_FLAGS = ("debug", "inspect", "interactive", "optimize", "no_user_site", "no_site",
          "ignore_environment", "verbose", "bytes_warning", "quiet", "isolated", "dev_mode",
          "utf8_mode", "safe_path")  # fmt: skip


# Ray's workers, which its raylet starts (they register the program's pid with it)
_RAY_WORKER = "/ray/_private/workers/default_worker.py"
# The helper multiprocessing starts for the process that first needs it (a test worker, say),
# which ends when that process does: warm, it would end with the server before then, and
# it imports next to nothing
_TRACKER = "from multiprocessing.resource_tracker import main"


def _command(os, sys) -> dict | str:
    """What the command line runs (``module``, ``script`` or ``code``), whether ``-u`` was
    given; or why this interpreter must start as itself."""
    # check-resume tells a run's processes apart by their pids (its launcher's, the ones
    # torchrun reports): the processes it records see their stand-in's as their own.
    checked = bool(os.environ.get("DDPCKPT_CHECK_RESUME"))
    if set(sys._xoptions) - {"faulthandler"}:
        return "-X options"
    argv = sys.orig_argv[1:]
    unbuffered = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return {"module": argv[i + 1], "script": None, "unbuffered": unbuffered,
                    "as_launched": checked}  # fmt: skip
        if arg == "-c" and i + 1 < len(argv):
            if argv[i + 1].startswith(_TRACKER):
                return "multiprocessing's resource tracker"
            return {"module": None, "script": None, "code": argv[i + 1],
                    "unbuffered": unbuffered, "as_launched": checked}  # fmt: skip
        if arg in ("-W", "-X"):
            i += 2
            continue
        if arg == "-u":
            unbuffered = True
        elif arg != "-B" and not arg.startswith(("-W", "-Xfaulthandler")):
            if arg.startswith("-"):
                return f"option {arg}"
            path = os.path.realpath(arg)
            if not os.path.isfile(path):
                return "no such script"
            if f"{os.sep}site-packages{os.sep}" in path and not path.endswith(_RAY_WORKER):
                return "a script of an installed package"
            return {"module": None, "script": arg, "unbuffered": unbuffered,
                    "as_launched": checked}  # fmt: skip
        i += 1
    return "no script"


def _request(command: dict, os, sys) -> tuple[dict, list[int]]:
    """What the program's process needs to start as this one would have, and the file
    descriptors to hand over."""
    import resource
    import signal

    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:  # the listing's own descriptor, closed by now
            continue
        fds.append(fd)
    mask = os.umask(0)
    os.umask(mask)
    dispositions = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(sig)
        if handler is signal.SIG_IGN:
            dispositions[int(sig)] = "ignore"
        elif handler is signal.default_int_handler:
            dispositions[int(sig)] = "interrupt"
    limits = {
        name: list(resource.getrlimit(getattr(resource, name)))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }
    streams = {}
    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None:
            streams[name] = [stream.encoding, stream.errors]
    request = {
        **command,
        "unbuffered": command["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")),
        "argv": list(sys.argv),
        "orig_argv": list(sys.orig_argv),
        "path": list(sys.path),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": mask,
        "fds": [[fd, os.get_inheritable(fd)] for fd in fds],
        "signals": dispositions,
        "blocked": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "limits": limits,
        "groups": os.getgroups(),
        "warnoptions": list(sys.warnoptions),
        "faulthandler": "faulthandler" in sys._xoptions
        or bool(os.environ.get("PYTHONFAULTHANDLER")),
        "streams": streams,
        "flags": {name: getattr(sys.flags, name, None) for name in _FLAGS},
        "dont_write_bytecode": sys.dont_write_bytecode,
        "xoptions": dict(sys._xoptions),
        "prefix": sys.prefix,
        "executable": sys.executable,
    }
    return request, fds


def _handover(where: str, command: dict, os, sys) -> str:
    """Start the program in the server and stand in for it until it ends; the reason
    when the server refused (this process then starts cold)."""
    import json
    import resource
    import signal
    import socket

    pending: list[int] = []
    child = [0]
    leader = os.getpgrp() == os.getpid()

    def forward(sig: int, frame: object) -> None:
        if not child[0]:
            pending.append(sig)
            return
        # A signal to this process's group (a launcher stopping its workers) is meant for
        # the program's group too: the program leads its own, with what it started.
        try:
            if leader:
                os.killpg(child[0], sig)
            else:
                os.kill(child[0], sig)
        except ProcessLookupError:  # it has ended; its status is on its way
            pass

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT, signal.SIGWINCH):  # fmt: skip
        handler = signal.getsignal(sig)
        if handler is not signal.SIG_IGN:
            previous[sig] = handler
    request, fds = _request(command, os, sys)
    for sig in previous:
        signal.signal(sig, forward)

    def cold(reason: str) -> str:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:  # as if it had come now
            os.kill(os.getpid(), sig)
        return reason

    _wait_for_server(where, os)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(where)
        header = json.dumps(request).encode()
        socket.send_fds(sock, [len(header).to_bytes(8, "big")], fds)
        sock.sendall(header)
        replies = sock.makefile("rb")
        reply = replies.readline().decode().strip()
    except OSError as exc:
        sock.close()
        return cold(f"no server ({exc})")
    if not reply.startswith("pid "):
        sock.close()
        return cold(f"refused: {reply[3:]}" if reply.startswith("no ") else "no answer")
    child[0] = int(reply[4:])
    _note("warm\t", os, sys)
    try:  # from here on this process only mirrors the program: it never runs it itself
        for sig in pending:
            forward(sig, None)
        reply = replies.readline().decode().strip()
        if not reply.startswith("exit "):
            program = " ".join(sys.orig_argv)[:300]
            os.write(
                2, f"warm start: the server ended before the program did: {program}\n".encode()
            )
            os._exit(1)
        status = int(reply[5:])
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the program dumped its own
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.waitstatus_to_exitcode(status))
    except BaseException as exc:  # said, and this process ends
        os.write(2, f"warm start: {exc!r}\n".encode())
        os._exit(1)


def _note(what: str, os, sys) -> None:
    """One line in ``DDPCKPT_TEST_WARM_LOG``, if set and writable."""
    log = os.environ.get("DDPCKPT_TEST_WARM_LOG")
    if log:
        try:
            with open(log, "a") as f:
                f.write(f"{what}\t{sys.orig_argv!r}\n")
        except OSError:
            pass


def _wait_for_server(where: str, os) -> None:
    """While the server is still importing (``SOCKET.starting`` holds its pid), wait for its
    socket: a cold start would cost what that wait saves."""
    import time

    try:
        with open(where + ".starting") as f:
            pid = int(f.read())
    except (OSError, ValueError):
        return
    from warm_ended import ended

    deadline = time.monotonic() + 30
    while not os.path.exists(where) and time.monotonic() < deadline:
        if ended(pid):
            return
        time.sleep(0.05)


_start_warm()
del _start_warm
