"""Which globals a ``torch.save`` pickle may name: only plain data classes can be trusted
(:func:`why_not_plain`), never anything from a module that acts on the system; and the
error for a pickle torch's weights-only unpickler refused, which suggests trusting a
global only when it could be."""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import importlib
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError

# Modules whose classes and functions act on the system (processes, files, the network,
# the interpreter): nothing in them is ever trusted, whatever the user names.
_DENIED_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "builtins", "importlib", "sys",
    "shutil", "pickle", "_pickle", "copyreg", "marshal", "ctypes", "_ctypes", "socket", "ssl",
    "select", "selectors", "asyncio", "http", "urllib", "ftplib", "smtplib", "telnetlib",
    "xmlrpc", "webbrowser", "antigravity", "code", "codeop", "runpy", "pdb", "bdb", "types",
    "functools", "operator", "io", "_io", "tempfile", "glob", "fileinput", "zipfile", "tarfile",
    "gzip", "bz2", "lzma", "zipimport", "pkgutil", "logging", "multiprocessing", "concurrent",
    "threading", "_thread", "signal", "platform", "getpass", "pty", "tty", "resource", "mmap",
    "sqlite3", "dbm", "shelve", "inspect", "gc", "atexit", "torch", "numpy",
})  # fmt: skip
# Plain record classes of the standard library, trusted by name (their own __init__ only
# sets attributes).
_PLAIN_CLASSES = frozenset({
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PurePath", "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath", "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath",
})  # fmt: skip
# What unpickling (or dropping) an instance may call: each must come from a built-in.
_HOOKS = ("__new__", "__init__", "__setstate__", "__reduce__", "__reduce_ex__",
          "__setitem__", "append", "extend", "__hash__", "__eq__", "__del__")  # fmt: skip
_BUILTIN_OWNERS = (object, dict, list, tuple, set, frozenset, OrderedDict, int, float, str)


def why_not_plain(name: str, obj: Any) -> str | None:
    """Why the global ``name`` (resolved to ``obj``) cannot be trusted, or ``None`` if it
    is a plain data class: a dataclass, named tuple or enum, a plain record class of the
    standard library, or a class that adds no code of its own to how it is built, kept or
    dropped. Never a function, a module, or anything from a module in ``_DENIED_MODULES``."""
    if name in _PLAIN_CLASSES:
        return None
    root = name.split(".")[0]
    if root in _DENIED_MODULES:
        return f"it comes from {root}, whose functions and classes act on the system"
    if not isinstance(obj, type):
        return f"it is a {type(obj).__name__}, not a class"
    if dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum):
        return None
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return None
    for hook in _HOOKS:
        owner = next((c for c in obj.__mro__ if hook in vars(c)), object)
        if owner not in _BUILTIN_OWNERS:
            return f"its {hook} is code of its own ({owner.__module__}.{owner.__qualname__})"
    return None


_TRUSTABLE = (
    "only plain data classes can be trusted: dataclasses, named tuples, enums, "
    "argparse.Namespace, and classes adding no code of their own to how they are built; "
    "never a function, and nothing from os, subprocess, builtins, importlib, sys, shutil, "
    "pickle and other modules that act on the system"
)


def trusted_globals(names: Iterable[str]) -> list[Any]:
    """The objects the user named to trust, each checked by :func:`why_not_plain`."""
    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        if not module or not attr:
            raise UnsafeCheckpointError(f"trusted global {name!r} must be 'module.Name'")
        if module.split(".")[0] in _DENIED_MODULES and name not in _PLAIN_CLASSES:
            obj = None  # never imported
        else:
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise UnsafeCheckpointError(f"trusted global {name!r}: not found ({exc})") from exc
        why = why_not_plain(name, obj)
        if why is not None:
            raise UnsafeCheckpointError(f"refusing to trust {name}: {why}; {_TRUSTABLE}")
        found.append(obj)
    return found


def refusal(
    path: str, exc: pickle.UnpicklingError
) -> CorruptCheckpointError | UnsafeCheckpointError:
    """The error for a pickle torch refused: a global it names (suggesting to trust it
    only if it could be trusted), or a pickle it cannot read."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found is None:
        # torch's text goes on to suggest weights_only=False: only the reason is kept
        reason = (
            str(exc).rpartition("WeightsUnpickler error:")[2].strip().split("\n")[0]
            or type(exc).__name__
        )
        return CorruptCheckpointError(
            f"{path}: not a readable torch.save file ({reason}); `import` reads files "
            "written by torch.save or Lightning"
        )
    name = _python3_name(found.group(1))
    module, _, attr = name.rpartition(".")
    loaded = sys.modules.get(module)  # never imported here: its import could run code
    if loaded is not None:
        why = why_not_plain(name, vars(loaded).get(attr))
    elif module.split(".")[0] in _DENIED_MODULES:
        why = why_not_plain(name, None)
    else:
        why = None  # unknown until the user names it: checked then
    advice = (
        f"it cannot be trusted ({why}): this file cannot be imported safely; export the "
        "state from the code that wrote it"
        if why is not None
        else f"if {name} is a plain data class you trust (a dataclass, named tuple or enum "
        f"of your own code), name it with --trust-global {name}; {_TRUSTABLE}. Otherwise "
        "export the state from the code that wrote the file"
    )
    return UnsafeCheckpointError(
        f"{path}: refusing to load it: unpickling would call {name}, and a pickle can run any "
        f"code that way; {advice}"
    )


def _python3_name(written: str) -> str:
    """The global a pickle's ``module.name`` means: Python 2 spellings (``commands.Popen``,
    ``__builtin__.eval``) are read as the unpickler's ``fix_imports`` reads them, and torch
    writes builtins without their module."""
    if "." not in written:
        return f"builtins.{written}"
    module, _, attr = written.rpartition(".")
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"
