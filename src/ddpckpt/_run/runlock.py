"""One job at a time per run directory: a lock file naming its holder.

``run/.lock`` holds JSON: host, pid, job id (``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``)
and when it was taken. It is created with ``O_EXCL``. A lock is *stale*, and is taken
over with a warning, when its holder is this host's process that no longer exists, when
it belongs to the same job (an elastic restart) and is not a live process on this host,
or when it has not been refreshed for ``stale_after`` seconds (a holder on another host
that died). A job that only reads a run (``Checkpointer(read_only=True)``) never takes it.
The holder refreshes it from a thread while it holds it, and checks before every save that
it still does (:meth:`RunLock.check`): a lock another job took over is lost for good; one
deleted (with its directory or alone: a clean-up script, a scheduler's purge) is taken
again, with a WARNING, unless another job took it meanwhile.

A lock still held when the interpreter exits (a Checkpointer never closed, a script ended
by an exception) is released then: refreshes stop, and the lock is removed with one
attempt per request (:meth:`~ddpckpt.storage.Storage.best_effort`), so a store that is gone
costs one WARNING line, not the retries of a running job.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import platform
import threading
import time
import weakref
from typing import Any

from ddpckpt._format.runfiles import LOCK_NAME, read_lock
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointLockedError, CorruptCheckpointError
from ddpckpt.storage import Storage
from ddpckpt.storage._location import Location

_log = get_logger(__name__)
_CREATING = 30.0  # seconds an empty lock file may be in the middle of being written
_held: weakref.WeakSet[RunLock] = weakref.WeakSet()  # locks of this process, for exit
_exiting = threading.Event()


def _release_at_exit() -> None:
    """Drop the locks still held: the process is ending, nobody refreshes them any more."""
    _exiting.set()
    for lock in list(_held):
        lock._release_at_exit()


atexit.register(_release_at_exit)


def _job_id() -> str | None:
    """This job's id across restarts; torchrun's default id ``none`` identifies nothing."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "")
        if value and value != "none":
            return value
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The lock of one run directory, as held by this process."""

    def __init__(self, directory: Location, stale_after: float = 600.0) -> None:
        self._storage = directory.storage
        self.path = directory.join(LOCK_NAME).path
        self.directory = os.path.dirname(self.path)
        self.stale_after = stale_after
        self.held = False
        self.lost: str | None = None  # why this process no longer holds it, for good
        self._claimed = False  # taken by this process and not released
        self._stop = threading.Event()
        self._pid = os.getpid()
        self._mine = {"host": platform.node(), "pid": os.getpid(), "job": _job_id()}

    def _read(self, storage: Storage | None = None) -> dict[str, Any] | None:
        try:
            holder = read_lock(Location(storage or self._storage, self.path))
        except CorruptCheckpointError:
            return {}  # a torn lock file: whoever wrote it died while writing (or damaged)
        return None if holder is None else holder.as_dict()

    def _age(self) -> float:
        try:
            return self._storage.age(self.path)
        except FileNotFoundError:
            return math.inf

    def _why_stale(self, holder: dict[str, Any]) -> str | None:
        if not holder:  # a holder that died while writing it, or one writing it right now
            return "unreadable" if self._age() > _CREATING else None
        if holder.get("host") == self._mine["host"] and holder.get("pid") == self._mine["pid"]:
            return "ours"
        here = holder.get("host") == self._mine["host"]
        if here and not _alive(int(holder.get("pid", -1))):
            return f"its holder, pid {holder.get('pid')} on this host, is gone"
        if holder.get("job") and holder.get("job") == self._mine["job"] and not here:
            # Elastic restarts replace the processes; a live one here is another program
            # of the same allocation (an evaluation job), never taken over.
            return f"held by an earlier attempt of this job (pid {holder.get('pid')})"
        age = self._age()
        if age > self.stale_after:
            return f"not refreshed for {age:.0f} s"
        return None

    def acquire(self) -> None:
        """Take the lock or raise :class:`CheckpointLockedError` naming its live holder."""
        if self.lost is not None:
            raise CheckpointLockedError(self.lost)
        self._storage.make_dirs(self.directory)
        document = json.dumps({**self._mine, "since": time.time()}).encode()
        for _ in range(3):
            try:
                writer = self._storage.create(self.path)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue
                reason = self._why_stale(holder)
                if reason is None and not holder:  # being written this very moment
                    time.sleep(0.1)
                    continue
                if reason is None:
                    raise CheckpointLockedError(
                        f"{self.directory} is in use by another job: pid "
                        f"{holder.get('pid')} on {holder.get('host')} (job {holder.get('job')}). "
                        "Use another directory, stop that job, or delete the .lock file if "
                        "you are sure it is dead; to only load from it while it runs, use "
                        "Checkpointer(..., read_only=True)"
                    ) from None
                if reason != "ours":
                    _log.warning("%s: taking over a stale lock (%s)", self.path, reason)
                self._storage.replace(self.path, document)
                self._hold()
                return
            try:
                with writer:
                    writer.write(document)
                    writer.sync()
            except OSError:  # e.g. a full disk: leave no empty lock behind to block the next job
                with contextlib.suppress(FileNotFoundError):  # S3: nothing was written
                    self._storage.delete(self.path)
                raise
            self._hold()
            return
        if self._read() == {}:
            raise CheckpointLockedError(
                f"{self.path} is empty: a job is creating it right now, or one died while "
                f"creating it. It is taken over once it is {_CREATING:.0f} s old; delete it if "
                "no job uses this directory"
            )
        raise CheckpointLockedError(f"{self.path}: could not take the lock (it keeps changing)")

    def _hold(self) -> None:
        """Keep the lock fresh from a thread, so a job that saves rarely never looks dead."""
        self.held = self._claimed = True
        self._stop = stop = threading.Event()
        _held.add(self)
        interval = min(60.0, self.stale_after / 4)

        def refresh() -> None:
            while not stop.wait(interval) and not _exiting.is_set():
                try:
                    self.refresh()
                except OSError as exc:
                    if not stop.is_set():  # a lock being dropped needs no refresh
                        _log.warning("%s: could not refresh the lock: %s", self.path, exc)

        threading.Thread(target=refresh, name="ddpckpt-lock", daemon=True).start()

    def check(self) -> bool:
        """Before writing, on the process that took the lock: make sure it still holds it.

        Raises :class:`CheckpointLockedError` if another job took it over, then and at every
        later call (the lock is lost for good). A lock file that is gone is taken again with
        a WARNING, the directory created again if it went too, and returns True (whatever
        else was deleted with it is gone); if another job took it meanwhile, it is lost.
        Does nothing in a process that never took the lock.
        """
        if self.lost is not None:
            raise CheckpointLockedError(self.lost)
        if not self._claimed:
            return False
        if self.held:
            holder = self._read()
            if holder and self._why_stale(holder) == "ours":
                return False
            if holder is not None:
                self._lose(holder)
            self._stop_holding()
        return self._take_again()

    def _lose(self, holder: dict[str, Any]) -> None:
        self._stop_holding()
        self._claimed = False
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')} (job {holder.get('job')})"
            if holder
            else "another process (it is writing the lock file now)"
        )
        self.lost = (
            f"{self.directory}: {who} took this directory's lock over; this job stops writing "
            "here: this save and every later one of this Checkpointer are refused, and nothing "
            "of that job's is touched. To go on saving, use another directory"
        )
        raise CheckpointLockedError(self.lost)

    def _take_again(self) -> bool:
        """Take back a lock whose file is gone; True."""
        vanished = not self._storage.is_dir(self.directory)
        try:
            self.acquire()
        except CheckpointLockedError as exc:
            self._claimed = False
            self.lost = (
                f"{exc}. This job's lock file had been deleted, and that job took the lock "
                "before this one could take it again; this job stops writing here: this save "
                "and every later one of this Checkpointer are refused"
            )
            raise CheckpointLockedError(self.lost) from None
        if vanished:
            _log.warning(
                "%s was deleted while this job was saving into it (a clean-up script, a user, a "
                "scheduler's purge?), with every checkpoint in it: created it again and took "
                "the lock again; saving goes on, and the run has no checkpoint until the next "
                "save commits",
                self.directory,
            )
        else:
            _log.warning(
                "%s was deleted while this job held the lock (not by ddpckpt): took the lock "
                "again; saving goes on",
                self.path,
            )
        return True

    def _stop_holding(self) -> None:
        self.held = False
        self._stop.set()
        _held.discard(self)

    def held_live(self) -> bool:
        """Whether a live process (this one included) holds the lock now, or is taking it;
        reads only."""
        holder = self._read()
        return holder is not None and self._why_stale(holder) in (None, "ours")

    def refresh(self) -> None:
        """Touch the lock, if it is still ours (never another job's)."""
        if self.held:
            holder = self._read()
            if holder and self._why_stale(holder) == "ours":
                self._storage.touch(self.path)

    def release(self) -> None:
        """Delete the lock file if it is still ours. If storage refuses (read-only), the
        lock stays and the next job takes it over as stale; that is logged, not raised."""
        self._release(self._storage)

    def _release_at_exit(self) -> None:
        if os.getpid() == self._pid:  # a forked child exiting leaves its parent's lock alone
            self._release(self._storage.best_effort())

    def _release(self, storage: Storage) -> None:
        self._claimed = False
        if not self.held:
            return
        self._stop_holding()
        try:
            holder = self._read(storage)
            if holder and self._why_stale(holder) == "ours":
                storage.delete(self.path)
        except OSError as exc:
            _log.warning(
                "%s: could not remove the lock (%s); the next job takes it over", self.path, exc
            )
