"""Where a checked script's ddpckpt calls read and write: never in the user's own runs.

Under ``ddpckpt check-resume`` every path or URL the script hands to ddpckpt is mapped into
the check run's scratch directory, ``RUN/checkpoints/<the absolute path>`` (a URL as
``RUN/checkpoints/<scheme>/<bucket>/<key>``), so that the mapping of a directory holds the
mappings of everything inside it:

* writes (``save``, ``save_dict``, ``remove_checkpoint``, a writable ``Checkpointer``) go
  to the mapped path, always; the directory the call would have created is created empty
  (the script may write its own files there) and removed when the check ends, if still empty;
* lookups of the checkpoint to resume from (``latest``) look at the mapped path only: a
  checked run never resumes from the user's run;
* reads of a given path (``load``, ``load_dict``, ``load_state_dict``, ``verify``, a
  read-only ``Checkpointer``) read the mapped path when the check run wrote it, else the
  path itself: pretrained weights and other inputs. An input inside a directory the run
  writes its checkpoints to is the user's own run read for resuming: refused
  (:class:`~ddpckpt.errors.ResumeCheckRefusedError`, naming both calls), at whichever of
  the two calls comes second, before that call reads or writes anything.

Fail closed: while a check runs, the storage of any location outside the run's directory
refuses every write (:func:`guard`), so a path that escaped the mapping is an error, never
a write into the user's files. ``memory://`` locations live and die with the process: left
as they are. Outside a check nothing here runs: the core's
:func:`ddpckpt._observe.place` returns the path unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._observe import Access
from ddpckpt.errors import ResumeCheckRefusedError

_MUTATING = frozenset(
    {"create", "replace", "touch", "delete", "write_new", "copy", "make_dirs", "delete_tree",
     "rename"}
)  # fmt: skip


def _split_url(location: str) -> tuple[str, str] | None:
    scheme, sep, rest = location.partition("://")
    if not sep or "/" in scheme:
        return None
    return scheme, rest


def _absolute(location: str) -> str:
    return location if _split_url(location) else os.path.abspath(location)


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both absolute, or URLs)."""
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root if root.endswith("/") else root + "/")


@dataclass
class Isolation:
    """The mapping of one checked process (see the module docstring).

    ``record`` is called with a route once per distinct (call, user path) and with a
    refusal before it is raised, so that the check's report can say where things went.
    """

    run_dir: str
    record: Callable[[dict[str, Any]], None] = lambda event: None
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (call, absolute path)
    roots: list[tuple[str, str]] = field(default_factory=list)  # (call, directory written)
    _seen: set[tuple[str, str]] = field(default_factory=set)

    @property
    def scratch(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def mapped(self, location: str) -> str | None:
        """The scratch location of ``location``; ``None`` for what is not mapped
        (``memory://``, or a location already inside this run's directory)."""
        url = _split_url(location)
        if url is not None:
            scheme, rest = url
            if scheme == "memory":
                return None
            return os.path.join(self.scratch, scheme, rest.lstrip("/"))
        absolute = os.path.abspath(location)
        if _inside(absolute, self.run_dir):
            return None
        return os.path.join(self.scratch, absolute.lstrip(os.sep))

    def _route(self, call: str, location: str, target: str, how: str) -> str:
        if (call, location) not in self._seen:
            self._seen.add((call, location))
            self.record({"event": "route", "call": call, "path": location, "to": target,
                         "how": how})  # fmt: skip
        return target

    def _refuse(self, call: str, path: str, why: str) -> None:
        message = (
            f"ddpckpt check-resume refused {call}({path!r}): {why}. The check runs the "
            "script twice from a fresh start in its own directory and never reads or writes "
            "the user's checkpoints"
        )
        self.record({"event": "refused", "call": call, "path": path, "why": message})
        raise ResumeCheckRefusedError(message)

    def for_write(self, path: str | os.PathLike[str], call: str, *, directory: bool) -> str:
        """Where ``call`` writes ``path`` (a run directory if ``directory``, else a
        checkpoint inside the directory that holds it)."""
        location = os.fspath(path)
        target = self.mapped(location)
        if target is None:
            return location
        absolute = _absolute(location)
        root = absolute if directory else absolute.rstrip("/").rsplit("/", 1)[0]
        for read_by, read in self.inputs:
            if _inside(read, root):
                self._refuse(
                    call, location,
                    f"the script read {read} ({read_by}) from the directory it now writes "
                    "checkpoints to, before the check's run had written anything there: that "
                    "is the user's own run, read for resuming. Find the checkpoint to resume "
                    f"from with ddpckpt.latest({os.path.dirname(read)!r}) or a Checkpointer's "
                    "resume() (the check maps those into its own directory)",
                )  # fmt: skip
        self.roots.append((call, root))
        if _split_url(location) is None:
            self._create(root)
        if not directory:  # named by the directory that holds the checkpoints, as latest() is
            shown = location.rstrip("/").rpartition("/")[0] or "."
            self._route(call, shown, self.mapped(shown) or shown, "written")
            return target
        return self._route(call, location, target, "written")

    def _create(self, directory: str) -> None:
        """Make ``directory`` as the call would have (a script may write its own files there,
        next to where its checkpoints would be); the check removes what it made, once empty,
        when it ends (``created``)."""
        missing = []
        while directory and not os.path.exists(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        if missing:
            os.makedirs(missing[0], exist_ok=True)
            self.record({"event": "created", "paths": missing})

    def for_lookup(self, path: str | os.PathLike[str], call: str) -> str:
        """Where ``call`` looks for the checkpoint to resume from: the mapped path only."""
        location = os.fspath(path)
        target = self.mapped(location)
        if target is None:
            return location
        # the user's own directory is not read: whether it exists is said in the report
        how = "looked up, the user's not" if os.path.exists(location) else "looked up"
        return self._route(call, location, target, how)

    def for_read(self, path: str | os.PathLike[str], call: str, *, directory: bool = False) -> str:
        """Where ``call`` reads ``path`` (a run directory if ``directory``): the check run's
        copy, or the path as an input."""
        location = os.fspath(path)
        target = self.mapped(location)
        if target is None:
            return location
        if os.path.exists(target):
            return self._route(call, location, target, "read")
        absolute = _absolute(location)
        for written_by, root in self.roots:
            if not _inside(absolute, root):
                continue
            if directory or not os.path.exists(location):  # a reader of the run being trained
                return self._route(call, location, target, "read")
            self._refuse(
                call, location,
                f"it lies in {root}, where the script writes its checkpoints ({written_by}), "
                "but this check's run did not write it: it is the user's own checkpoint. To "
                f"resume, find the checkpoint with ddpckpt.latest({root!r}) or a Checkpointer's "
                "resume(), which see what the check's run wrote; listing the directory "
                "yourself (glob, os.listdir) sees the user's files",
            )  # fmt: skip
        self.inputs.append((call, absolute))
        return self._route(call, location, location, "input")

    def place(self, location: str, call: str, access: Access) -> str:
        """Where ``call`` uses ``location`` (the core's :func:`ddpckpt._observe.place`)."""
        if access is Access.LOOKUP:
            return self.for_lookup(location, call)
        if access in (Access.WRITE, Access.WRITE_RUN):
            return self.for_write(location, call, directory=access is Access.WRITE_RUN)
        return self.for_read(location, call, directory=access is Access.READ_RUN)

    def guard(self, storage: Any, location: str) -> Any:
        """``storage``, refusing writes when ``location`` is outside this run's directory."""
        if _split_url(location) is None and _inside(os.path.abspath(location), self.run_dir):
            return storage
        if (url := _split_url(location)) is not None and url[0] == "memory":
            return storage
        return _ReadOnly(storage, location, self)


class _ReadOnly:
    """A storage whose writes are refused: a location the mapping did not cover."""

    def __init__(self, storage: Any, location: str, isolation: Isolation) -> None:
        self._storage, self._location, self._isolation = storage, location, isolation

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._storage, name)
        if name not in _MUTATING:
            return attribute

        def refused(*args: Any, **kwargs: Any) -> Any:
            self._isolation._refuse(
                f"storage.{name}", str(args[0]) if args else self._location,
                "it would write outside the check's directory (a path that did not come "
                "through save(), save_dict(), remove_checkpoint() or a Checkpointer); this "
                "is a ddpckpt bug: please report it",
            )  # fmt: skip

        return refused


def install(isolation: Isolation | None) -> None:
    """Guard this process's storage with ``isolation`` (``None``: stop): see
    :meth:`Isolation.guard`."""
    from ddpckpt.storage import _registry

    _registry._guard = None if isolation is None else isolation.guard
