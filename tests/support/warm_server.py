"""``python warm_server.py SOCKET``: the warm server of one test worker. It imports torch
(and what every test program imports first) once, then forks a process for each program a
stand-in (tests/support/warm/sitecustomize.py) hands over, and tells the stand-in its pid
and, at the end, its wait status.

The forked process becomes what a fresh ``python SCRIPT`` (or ``-m MODULE``) started by the
stand-in's parent would be: its own session (so it and what it starts are killed together
when the stand-in is SIGKILLed), the stand-in's file descriptors at their numbers, its
environment, working directory, umask, resource limits, signal dispositions and mask,
warning options, standard streams and module search path; NumPy's global generator seeded
afresh (``random`` reseeds itself at a fork). It then runs the program as ``__main__`` and
ends as the interpreter ends it (threads joined, atexit handlers, the program's own modules
torn down), but for the teardown of what the server preloaded (see :func:`_end`).

What it shares with the server rather than having its own: modules imported at start-up
(so environment variables read while they load must match; the server refuses otherwise),
as if the program had imported them first thing (one that changes TMPDIR before it first
uses torch._dynamo still has the temporary and inductor cache directories of the TMPDIR it
started with), and the string-hash seed, so a set of strings iterates in one order in every
warm process of a worker. The server serves only its own user, group and interpreter.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import types
import weakref
from typing import NoReturn

from warm.warm_ended import stat_fields

_LIBRARY = "ddpckpt"
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    # DDP's constructor and the optimizers import it (about 1.2 s of CPU a process)
    "torch._dynamo",
    "numpy",
    "xxhash",
    # The library under test (0.14 s of CPU a program): out of sys.modules in each program
    # until it imports it (_defer); a program under one of its tools (check-resume's
    # recorder starts at ddpckpt's import) imports it afresh (_forget).
    _LIBRARY,
)
# Environment variables read while the preloaded modules load: by C code (OpenMP, the
# allocator, torch's logging and C++ settings), listed here, and by Python code
# (torch._dynamo's and inductor's settings, TMPDIR ...), noted while the server preloads
# (_READ). A program whose values differ starts cold. CUDA's (CUDA_VISIBLE_DEVICES,
# PYTORCH_CUDA_ALLOC_CONF ...) are read when CUDA is first used, which the server never does.
_LOAD_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_PRELOAD", "LD_LIBRARY_PATH", "MALLOC_",
              "TORCH_LOGS", "TORCH_CPP_", "TORCH_SHOW_CPP", "PYTORCH_JIT", "NPY_", "NUMPY_",
              "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONHOME", "LANG", "LC_", "TZ", "TQDM_",
              "TORCH_DISTRIBUTED_DEBUG")  # fmt: skip


_READ: set[str] = set()
_STARTED_WITH: dict[str, str] = {}  # the server's environment before it preloaded
_SET_BY_PRELOAD: dict[str, str] = {}  # what preloading set (TORCHINDUCTOR_CACHE_DIR)
# Read while preloading, but only by sysconfig for its user base, which _become finds again
_REDERIVED = frozenset({"HOME"})
# ddpckpt's tools' variables (ddpckpt._observe.TOOLS), which its import reads: a program with
# one set imports ddpckpt afresh (_forget), as a cold one would, after reading it
_TOOLS: tuple[str, ...] = ()
_EXITS: list[tuple] = []  # what ddpckpt registered with atexit as it loaded, in order


@contextlib.contextmanager
def _noting_exits(into: list):
    """Note in ``into`` each ``atexit.register(function, *args, **kwargs)`` meanwhile."""
    import atexit

    register = atexit.register

    def noted(function, *args, **kwargs):
        into.append((function, args, kwargs))
        return register(function, *args, **kwargs)

    atexit.register = noted
    try:
        yield
    finally:
        atexit.register = register


def _load_time(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k.startswith(_LOAD_TIME) or (k in _READ and k not in _REDERIVED and k not in _TOOLS)
    }


@contextlib.contextmanager
def _noting_reads():
    """Note in _READ every environment variable Python code looks up meanwhile
    (``os.environ[k]``, ``.get``, ``in``, ``os.getenv``); not those a copy or a walk of the
    whole environment reads (``.copy()``, ``.items()``: tqdm's scan for ``TQDM_``, hence its
    prefix in _LOAD_TIME)."""
    from collections.abc import ItemsView, ValuesView

    cls = type(os.environ)
    getitem, contains = cls.__getitem__, cls.__contains__
    walks = {ItemsView.__iter__.__code__, ValuesView.__iter__.__code__, cls.copy.__code__}

    def noted_getitem(self, key):
        if sys._getframe(1).f_code not in walks:
            _READ.add(key)
        return getitem(self, key)

    def noted_contains(self, key):
        _READ.add(key)
        return contains(self, key)

    cls.__getitem__, cls.__contains__ = noted_getitem, noted_contains  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__getitem__, cls.__contains__ = getitem, contains  # type: ignore[method-assign]


def _refusal(request: dict, peer: tuple[int, int, int]) -> str | None:
    """Why this server cannot start the request's program as a fresh interpreter would."""
    _, uid, gid = peer
    if (uid, gid) != (os.getuid(), os.getgid()) or sorted(request["groups"]) != sorted(
        os.getgroups()
    ):
        return "another user or group"
    if _privileges(peer[0]) != _privileges(os.getpid()):
        return "other capabilities"  # a launcher's preexec_fn dropped root's, say
    if (request["executable"], request["prefix"]) != (sys.executable, sys.prefix):
        return "another interpreter"
    if request["flags"] != {name: getattr(sys.flags, name, None) for name in request["flags"]}:
        return "other interpreter flags"
    # a variable preloading set matches where the program leaves it unset or has that value
    theirs = _load_time({**_SET_BY_PRELOAD, **request["env"]})
    ours = _load_time({**_STARTED_WITH, **_SET_BY_PRELOAD})
    if theirs != ours:
        differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        return f"other load-time environment: {', '.join(differ)}"
    from importlib.machinery import PathFinder

    path = [_first(request) or request["cwd"], *request["path"]]  # "": the program's cwd
    for name in {name.split(".")[0] for name in PRELOAD}:
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.origin != sys.modules[name].__spec__.origin:
            return f"another {name} on its path"
    import resource

    for name, (_, hard) in request["limits"].items():
        own = resource.getrlimit(getattr(resource, name))[1]
        if own != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > own):
            return f"a higher {name}"
    return None


def _privileges(pid: int) -> list[str]:
    """What a process may do besides its user's rights: its capability sets, and whether it
    may gain privileges or runs under seccomp (the kernel's word, in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return [line for line in f if line.startswith(("Cap", "NoNewPrivs", "Seccomp"))]


def _first(request: dict) -> str:
    """``sys.path[0]`` of the program: its script's directory, (``-m``) the working one, or
    (``-c``) the empty string, which stands for it."""
    script = request["script"]
    if script:
        return os.path.dirname(os.path.realpath(os.path.join(request["cwd"], script)))
    return "" if request.get("code") is not None else request["cwd"]


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    size, fds, _, _ = socket.recv_fds(conn, 8, 1024)
    if len(size) != 8:
        raise OSError("short request")
    length = int.from_bytes(size, "big")
    data = b""
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise OSError("short request")
        data += chunk
    return json.loads(data), fds


def serve(path: str) -> None:
    """Preload, listen on ``path``, and fork a program for each request until SIGTERM, the
    end of the parent, or a closed listener. Only forked children return from here: into
    :func:`_become`, which ends the program (:func:`_end`, or a KeyboardInterrupt through
    the interpreter's exit)."""
    _STARTED_WITH.update(os.environ)
    with _noting_reads():
        for name in PRELOAD:
            with _noting_exits(_EXITS if name == _LIBRARY else []):
                importlib.import_module(name)
    _SET_BY_PRELOAD.update((k, v) for k, v in os.environ.items() if _STARTED_WITH.get(k) != v)
    global _TOOLS
    _TOOLS = tuple(sys.modules[f"{_LIBRARY}._observe"].TOOLS)
    # What the preloaded modules left to run at exit (torch's operator libraries, each
    # unregistered: 0.07 s of CPU a program) is the server's, not torn down (_end)
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False
    _CAPTURED.extend(_captured((os.getpid, os.getppid, os.kill)))
    # Out of the collector's reach: a child's collections (its exit's among them) then
    # neither walk nor copy the server's objects.
    gc.collect()
    gc.freeze()
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: end with the test worker
    parent = os.getppid()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    os.chmod(path + ".binding", 0o600)
    listener.listen(128)
    os.rename(path + ".binding", path)  # clients find it only once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    by_pid: dict[int, socket.socket] = {}
    by_conn: dict[socket.socket, int] = {}
    stopping = False
    while not stopping:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                child = _start(conn, [listener, wake_r, wake_w, *by_conn], selector)
                if child == 0:
                    return  # in the child: the program has ended (never reached)
                if child > 0:
                    by_pid[child] = conn
                    by_conn[conn] = child
                    selector.register(conn, selectors.EVENT_READ)
            elif key.fileobj is wake_r:
                try:
                    signals = os.read(wake_r, 512)
                except BlockingIOError:
                    signals = b""
                stopping = signal.SIGTERM in signals
            else:  # the stand-in went away (SIGKILL): its program goes with it
                conn = key.fileobj
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone:
                    selector.unregister(conn)
                    pid = by_conn.pop(conn)
                    _kill_group(pid)
                    conn.close()
        _reap(by_pid, by_conn, selector)
        if os.getppid() != parent:
            stopping = True
    for pid in by_pid:
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue


def _reap(by_pid: dict, by_conn: dict, selector: selectors.BaseSelector) -> None:
    while by_pid or by_conn:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = by_pid.pop(pid, None)
        if conn is not None and by_conn.pop(conn, None) is not None:
            selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {status}\n".encode())
            conn.close()


def _start(conn: socket.socket, own: list, selector: selectors.BaseSelector) -> int:
    """Fork the program ``conn`` asks for: its pid in the server (``0`` in the child, which
    only returns once the program has ended), ``-1`` after a refusal."""
    conn.settimeout(10)
    fds: list[int] = []
    before: set[signal.Signals] | None = None
    try:
        request, fds = _receive(conn)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        peer = tuple(int.from_bytes(creds[i : i + 4], "little") for i in (0, 4, 8))
        refusal = _refusal(request, peer)  # type: ignore[arg-type]
        request["stand_in"] = peer[0]  # the kernel's word for it, not the request's
        if refusal is not None:
            conn.sendall(f"no {refusal}\n".encode())
            raise OSError(refusal)
        # Blocked until the child has its program's dispositions: a signal the stand-in
        # passes on at once must not meet the server's handlers.
        before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        pid = os.fork()
    except Exception:  # a request it cannot serve: refused (the stand-in starts cold)
        if before is not None:  # the fork failed
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        for fd in fds:
            os.close(fd)
        conn.close()
        return -1
    if pid == 0:
        signal.set_wakeup_fd(-1)  # before its descriptor closes and the number is reused
        selector.close()
        for thing in own:
            if isinstance(thing, int):
                os.close(thing)
            else:
                thing.close()
        _become(request, fds, conn)
    signal.pthread_sigmask(signal.SIG_SETMASK, before)
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    try:
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:
        _kill_group(pid)
    return pid


def _become(request: dict, received: list[int], conn: socket.socket) -> None:
    """In the forked child: turn into the program's process, run it, and end as Python ends
    (leaves through :func:`_end`, or raises KeyboardInterrupt; never returns)."""
    import ctypes
    import faulthandler
    import fcntl
    import io
    import resource
    import warnings

    conn.close()
    os.setsid()
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: not past the server
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        how = request["signals"].get(str(int(sig)))
        handler = {"ignore": signal.SIG_IGN, "interrupt": signal.default_int_handler}.get(
            how, signal.SIG_DFL
        )
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [int(s) for s in request["blocked"]])
    # The stand-in's descriptors at their own numbers; out of the way first, since a
    # received descriptor may hold a number another one needs.
    wanted = {int(fd): inheritable for fd, inheritable in request["fds"]}
    above = max([*wanted, *received, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd in (0, 1, 2):
        if fd not in wanted:
            with contextlib.suppress(OSError):
                os.close(fd)
    for temp, (fd, inheritable) in zip(high, wanted.items(), strict=True):
        os.dup2(temp, fd, inheritable=inheritable)
        os.close(temp)
    for name, (soft, hard) in request["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in _SET_BY_PRELOAD.items():  # as the program's own import would have
        os.environ.setdefault(name, value)
    if any(os.environ.get(name) for name in _TOOLS):
        _forget()
    else:
        _defer()
    _streams(request, io)
    if request["faulthandler"]:
        faulthandler.enable()
    else:
        faulthandler.disable()
    sys.dont_write_bytecode = request["dont_write_bytecode"]
    sys._xoptions.clear()
    sys._xoptions.update(request["xoptions"])
    sys.warnoptions[:] = request["warnoptions"]
    warnings._processoptions(request["warnoptions"])  # type: ignore[attr-defined]
    sys.orig_argv[:] = request["orig_argv"]
    sys.argv[:] = request["argv"]
    sys.path[:] = [_first(request), *request["path"]]
    _pids_as_cold(request["stand_in"], as_launched=request["as_launched"])
    import numpy

    numpy.random.seed()  # from the system's entropy, as at a fresh import
    _user_base_again()
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=__builtins__)  # as Python's own
    sys.modules["__main__"] = main
    ours = frozenset(sys.modules)  # the server's and this start's: none is the program's
    try:
        _run(main, request["script"], request["module"], request.get("code"))
    except SystemExit as exc:
        code = exc.code
    # the exception is gone, and with its traceback the program's frames, as in Python's exit
    del main
    _end(code, ours)


def _end(code: object, ours: frozenset[str]) -> NoReturn:
    """End the program as the interpreter ends it (Py_FinalizeEx), for everything the
    program made: the status or message of its ``SystemExit``; its other threads that are
    not daemons joined; the atexit handlers run; the standard streams flushed (120 if that
    fails); its Python signal handlers back to the default; then, unless a daemon thread is
    still running (the interpreter would have stopped it; here it could meet cleared
    globals), the modules it imported and ``__main__`` torn down as the interpreter tears
    modules down (taken out of ``sys.modules``, collected, the survivors' globals cleared,
    latest import first), so that its objects' ``__del__`` and finalizers run; C's stdio
    flushed. The process then leaves with ``os._exit``: what the server preloaded is not
    torn down (freeing torch's objects copies the pages the fork shared: 0.4 s of CPU a
    program), nor are its finalizers run (see :func:`serve`), nor C++'s static destructors
    (where gloo's threads can abort a finished process: tests/support/exiting.py)."""
    import atexit
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # as Python prints it: the object itself on stderr, status 1
        status = 1
        if sys.stderr is not None:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"{code}\n")
        else:
            os.write(2, f"{code}\n".encode(errors="backslashreplace"))
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException as exc:  # a KeyboardInterrupt while it joins
        _unraisable(threading, exc)
    atexit._run_exitfuncs()
    flushed = _flush()
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    if len(sys._current_frames()) == 1:
        if gc.isenabled():
            gc.collect()
        alive = []  # weak references: a module only sys.modules holds goes as it leaves it
        for name in [name for name in sys.modules if name not in ours or name == "__main__"]:
            if isinstance(sys.modules.get(name), types.ModuleType):
                alive.append(weakref.ref(sys.modules[name]))
            sys.modules[name] = None  # type: ignore[assignment]
        gc.collect()
        for ref in reversed(alive):
            module = ref()
            if module is not None:
                _clear(module)
            del module
        gc.collect()
    flushed = _flush() and flushed
    for stream in (sys.__stdout__, sys.__stderr__):  # the program may have replaced them
        with contextlib.suppress(Exception):
            stream.flush()  # type: ignore[union-attr]
    import ctypes

    ctypes.CDLL(None).fflush(None)  # what C and C++ code wrote, as exit() would
    os._exit((status if flushed else 120) & 0xFF)


def _unraisable(what: object, exc: BaseException) -> None:
    """``Exception ignored in: WHAT`` and the traceback on stderr, as the interpreter says
    it of an exception nothing can raise to."""
    import traceback

    if sys.stderr is None:
        return
    with contextlib.suppress(Exception):
        sys.stderr.write(f"Exception ignored in: {what!r}\n")
        sys.stderr.write("".join(traceback.format_exception(exc)))
        sys.stderr.flush()


def _clear(module: types.ModuleType) -> None:
    """A module's globals set to ``None`` as the interpreter's teardown sets them: the names
    with one leading underscore first, then the others but ``__builtins__``."""
    namespace = module.__dict__
    for first in (True, False):
        for name in list(namespace):
            private = name.startswith("_") and not name.startswith("__")
            if private if first else name != "__builtins__":
                with contextlib.suppress(Exception):
                    namespace[name] = None


def _flush() -> bool:
    """stdout and stderr flushed as at the interpreter's exit: whether both were (a failing
    stdout is reported as an exception ignored)."""
    flushed = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception as exc:
            flushed = False
            if name == "stdout":
                _unraisable(stream, exc)
    return flushed


def _take_out() -> dict[str, types.ModuleType]:
    """The library's modules, taken out of ``sys.modules``, and what it registered with
    atexit as it loaded unregistered."""
    import atexit

    modules = {
        n: m for n, m in sys.modules.items() if n == _LIBRARY or n.startswith(f"{_LIBRARY}.")
    }
    for function, _, _ in _EXITS:
        atexit.unregister(function)
    for name in modules:
        del sys.modules[name]
    return modules


def _forget() -> None:
    """Take the library out, as if the server had never imported it, so that the program's
    own import runs its import-time code; and undo what that code hooked in outside its
    modules (its handlers and filters on loggers; what it registered with atexit)."""
    import logging

    modules = _take_out()
    theirs = [v for m in modules.values() for v in vars(m).values()]
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            if any(handler is v for v in theirs):
                logger.removeHandler(handler)
        for found in list(getattr(logger, "filters", ())):
            if type(found).__module__ in modules:
                logger.removeFilter(found)


def _defer() -> None:
    """Take the library out until the program first imports it (or one of its modules):
    its modules come back then, as its own import would bring them; what it registered with
    atexit as it loaded is registered again at that moment, so that it runs where a cold
    import puts it among the program's own, and it looks for its tools again (a program
    that set a tool's variable itself gets the tool)."""
    import atexit
    import importlib.abc
    import importlib.machinery

    modules = _take_out()
    specs = {name: module.__spec__ for name, module in modules.items()}

    class Existing(importlib.abc.Loader):
        def create_module(self, spec):  # the module as the server loaded it, and the rest
            if deferred in sys.meta_path:
                sys.meta_path.remove(deferred)
                sys.modules.update((n, m) for n, m in modules.items() if n != spec.name)
                for function, args, kwargs in _EXITS:
                    atexit.register(function, *args, **kwargs)
                observe = modules[f"{_LIBRARY}._observe"]  # what its __init__ does last
                observe._looked = False
                observe.observer()
            return modules[spec.name]

        def exec_module(self, module):  # loaded already; its own spec back
            module.__spec__ = specs[module.__name__]

    class Deferred(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in modules:
                return None
            own = specs[name]  # as the path finder would find it (a package, a file)
            spec = importlib.machinery.ModuleSpec(name, Existing(), origin=own.origin)
            spec.submodule_search_locations = own.submodule_search_locations
            spec.has_location = own.has_location
            return spec

    deferred = Deferred()
    sys.meta_path.insert(0, deferred)


def _captured(functions: tuple) -> list:
    """Where modules the server imported keep ``functions`` of their own (a default
    argument: multiprocessing's ``Finalize``; a module's ``from os import getpid``), so that
    a program's replacements (:func:`_pids_as_cold`) reach them too."""
    modules = {id(m.__dict__) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    wanted = {id(f) for f in functions}
    found: list = []
    for function in functions:
        for holder in gc.get_referrers(function):
            if isinstance(holder, dict) and id(holder) in modules:
                if holder is not os.__dict__ and holder.get("__name__") != "posix":
                    found.extend((holder, k) for k, v in list(holder.items()) if id(v) in wanted)
            elif isinstance(holder, tuple):
                found.extend(
                    (f, None) for f in gc.get_referrers(holder)
                    if isinstance(f, types.FunctionType) and f.__defaults__ is holder
                )  # fmt: skip
    return found


_CAPTURED: list = []


def _pids_as_cold(stand_in: int, *, as_launched: bool) -> None:
    """The pids the program sees, as a cold one's as far as a fork allows: its own
    ``os.getppid()`` is its stand-in's parent, the process that started it (read when asked,
    so it changes when that one ends, as DataLoader's watchdog expects).

    ``as_launched`` (under ddpckpt check-resume, which matches the pids a rank records with
    those its launcher reports): its ``os.getpid()`` is the stand-in's, the pid its launcher
    knows; the processes it forks see that as their parent's; ``os.kill`` of it signals the
    program itself at once. Limits: a process the program starts anew (exec) sees its real
    pid as its parent's, and reading ``/proc/<os.getpid()>`` reads the stand-in's."""
    real = os.getpid()
    getpid, getppid, kill = os.getpid, os.getppid, os.kill

    def warm_getppid() -> int:
        if getpid() != real:  # a process it forked
            pid = getppid()
            return stand_in if as_launched and pid == real else pid
        try:
            return int(stat_fields(stand_in)[1])
        except OSError:  # the stand-in is gone: so is its parent
            return 1

    def warm_getpid() -> int:
        pid = getpid()
        return stand_in if pid == real else pid

    def warm_kill(pid: int, sig: int) -> None:
        kill(real if pid == stand_in else pid, sig)

    instead = {id(getppid): warm_getppid}
    if as_launched:
        instead.update({id(getpid): warm_getpid, id(kill): warm_kill})
    for name in ("getpid", "getppid", "kill"):
        setattr(os, name, instead.get(id(getattr(os, name)), getattr(os, name)))
    for holder, key in _CAPTURED:
        if isinstance(holder, dict):
            holder[key] = instead.get(id(holder[key]), holder[key])
        else:
            holder.__defaults__ = tuple(instead.get(id(d), d) for d in holder.__defaults__)


def _user_base_again() -> None:
    """Forget the user base (``~/.local``) that ``site`` and ``sysconfig`` derived from the
    server's HOME: both find it again, from the program's, when next asked."""
    import site
    import sysconfig

    site.USER_BASE = site.USER_SITE = None  # type: ignore[assignment]
    sysconfig._CONFIG_VARS = None  # type: ignore[attr-defined]
    if hasattr(sysconfig, "_CONFIG_VARS_INITIALIZED"):  # Python 3.12 and later
        sysconfig._CONFIG_VARS_INITIALIZED = False  # type: ignore[attr-defined]


def _streams(request: dict, io) -> None:
    """``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` as Python builds them at start-up."""
    unbuffered = request["unbuffered"]
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        if name not in request["streams"] or fd not in {f for f, _ in request["fds"]}:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        encoding, errors = request["streams"][name]
        tty = os.isatty(fd)
        # As CPython's create_stdio: stdin always buffered; -u: the others written through
        # and never line-buffered, else stderr and a terminal by line; "\n" untranslated.
        buffering = 0 if unbuffered and name != "stdin" else -1
        binary = io.open(fd, "rb" if name == "stdin" else "wb", buffering, closefd=False)
        (binary if buffering == 0 else binary.raw).name = f"<{name}>"
        line = not unbuffered and (tty or name == "stderr")
        stream = io.TextIOWrapper(binary, encoding, errors, newline="\n", line_buffering=line,
                                  write_through=unbuffered)  # fmt: skip
        stream.mode = "r" if name == "stdin" else "w"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run(
    main: types.ModuleType, script: str | None, module: str | None, source: str | None
) -> None:
    """Run the program in ``main`` (``sys.modules["__main__"]``) and end as ``python`` does:
    SystemExit propagates (to :func:`_end`) and KeyboardInterrupt to the interpreter, any
    other exception is printed without this module's frames and exits 1."""
    import runpy
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    try:
        if module is not None:
            runpy._run_module_as_main(module)  # type: ignore[attr-defined]
        elif source is not None:  # -c: no __file__, the code's file named "<string>"
            main.__dict__.update(__package__=None, __spec__=None, __loader__=BuiltinImporter)
            exec(compile(source, "<string>", "exec", dont_inherit=True), main.__dict__)
        else:
            assert script is not None
            script = os.path.abspath(script)  # as Python makes it (3.9 and later)
            main.__dict__.update(__file__=script, __cached__=None, __package__=None,
                                 __spec__=None, __loader__=SourceFileLoader("__main__", script))  # fmt: skip
            with open(script, "rb") as f:
                code = compile(f.read(), script, "exec", dont_inherit=True)
            exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # printed as Python prints it; exit 1
        tb = exc.__traceback__
        here = (os.path.abspath(__file__), os.path.abspath(runpy.__file__))
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in here:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    serve(sys.argv[1])
