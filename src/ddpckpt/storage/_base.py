"""How bytes are stored: the :class:`Storage` and :class:`CommitStrategy` interfaces (the
commit strategies themselves are in :mod:`ddpckpt.storage._commit`, the streams a storage
hands out in :mod:`ddpckpt.storage._streams`).

A storage is addressed by *locations*: strings that name an object (a file) or a prefix
(a directory) in that storage's own spelling, e.g. ``/data/run/step-00000100/manifest.json``
on a file system or ``memory://t/run/step-00000100/manifest.json`` in memory. Locations are
joined with ``/`` (``os.path.join`` on POSIX); :func:`ddpckpt.storage.storage_for` maps a path or
URL to the storage that serves it. Inside ddpckpt a public call resolves each path once into a
:class:`~ddpckpt.storage._location.Location` (the storage and the path) that the layers below
take.

Nothing here knows about ranks. The callers decide who calls what: every rank creates,
writes and syncs the data objects it was assigned and reads the ones it loads; one rank
per storage domain (the leader) runs the commit strategy's ``begin``/``publish``/``abort``,
writes the manifest and ``latest``, applies retention and holds the run's lock.

What is atomic: :meth:`Storage.create` is exclusive (a second create of the same location
raises :class:`FileExistsError`); :meth:`Storage.replace` swaps a small object so that
readers see the old or the new content; a checkpoint becomes visible all at once through
its :class:`CommitStrategy`. Everything else (listing, deleting a tree) is not atomic.
"""

from __future__ import annotations

import abc
import builtins
import contextlib

from ddpckpt._log import get_logger
from ddpckpt.storage._streams import Reader, Writer

_log = get_logger(__name__)


class Storage(abc.ABC):
    """The operations ddpckpt performs on stored bytes: subclass it for a backend of your
    own, and serve a URL scheme from it with :func:`~ddpckpt.storage.register`.

    Locations are strings in the storage's own spelling (the path or URL the user gave,
    with names joined by ``/``). No method knows about ranks: every rank creates, writes
    and syncs the data objects assigned to it and opens the ones it loads, from several
    threads at once; one rank per storage domain (the leader) runs the
    :attr:`commit` strategy, writes the manifest and ``latest``, applies retention and
    holds the run's lock. So every method must be thread-safe, and must work when other
    processes, on other hosts, use the same store at the same time.

    Failures raise :class:`OSError` with an ``errno`` (the built-in subclasses where they
    fit): :class:`FileNotFoundError` for a missing object or directory,
    :class:`FileExistsError` for :meth:`create` of an existing one. ddpckpt reports them
    as :class:`~ddpckpt.errors.CheckpointWriteError` naming the checkpoint, and a
    :class:`~ddpckpt.Checkpointer` retries the transient ones (``EIO``, ``EAGAIN``,
    ``EINTR``, ``EBUSY``, ``ETIMEDOUT``, ``ESTALE``, ``ECONNRESET``, ``ENETDOWN``,
    ``ENETUNREACH``, ``EHOSTUNREACH``); an exception of another type is taken for a bug
    and propagates as it is.

    Attributes:
        commit: How a checkpoint is made visible here: a :class:`RenameCommit` where a
            directory renames atomically (a file system), a :class:`ManifestLastCommit`
            where it does not (an object store).
    """

    commit: CommitStrategy

    # ------------------------------------------------------------------- objects
    @abc.abstractmethod
    def create(self, location: str) -> Writer:
        """Start a new object at ``location``; exclusive, so that two writers never share
        one object.

        Args:
            location: The object's location; its parent exists (made by
                :meth:`make_dirs`) where the store has directories.

        Returns:
            A :class:`Writer` for it.

        Raises:
            FileExistsError: ``location`` exists (or another writer created it first).
            OSError: Any other failure.
        """

    @abc.abstractmethod
    def open(self, location: str) -> Reader:
        """Open an object for ranged reads, without blocking (never on a FIFO).

        Args:
            location: The object's location.

        Returns:
            A :class:`Reader` of the bytes as they are now.

        Raises:
            FileNotFoundError: Nothing is at ``location``.
            OSError: ``location`` is no regular object (a directory, a link, a FIFO or
                a device: ``NotRegularFileError``, an :class:`OSError`), or another
                failure.
        """

    @abc.abstractmethod
    def replace(self, location: str, data: bytes) -> None:
        """Write a small object (``latest``, ``run.json``, the run's lock) atomically and
        durably, replacing any previous one: a reader sees the old content or the new,
        never a mix or nothing.

        Args:
            location: The object's location.
            data: Its whole new content.

        Raises:
            OSError: The write failed; the previous content is still there.
        """

    @abc.abstractmethod
    def size(self, location: str) -> int:
        """The size of the object at ``location``.

        Returns:
            Its size in bytes.

        Raises:
            FileNotFoundError: Nothing is at ``location``.
        """

    @abc.abstractmethod
    def age(self, location: str) -> float:
        """How long ago the object was last written or :meth:`touch`-ed (the run's lock
        is stale once this exceeds ``lock_stale_after``): this host's clock minus the
        object's modification time.

        Returns:
            Seconds.

        Raises:
            FileNotFoundError: Nothing is at ``location``.
        """

    @abc.abstractmethod
    def touch(self, location: str) -> None:
        """Mark the object as written now, its content unchanged (the run's lock holder
        refreshes the lock so).

        Raises:
            FileNotFoundError: Nothing is at ``location``.
        """

    @abc.abstractmethod
    def delete(self, location: str) -> None:
        """Delete one object.

        Raises:
            FileNotFoundError: Nothing is at ``location``.
        """

    def write_new(self, location: str, data: bytes) -> None:
        """Create ``location`` holding ``data``, durably (by :meth:`create`).

        Raises:
            FileExistsError: ``location`` exists.
        """
        with self.create(location) as writer:
            writer.write(data)
            writer.sync()

    def read(self, location: str) -> bytes:
        """The whole (small) object at ``location`` (by :meth:`open`).

        Raises:
            FileNotFoundError: Nothing is at ``location``.
        """
        reader = self.open(location)
        try:
            return reader.read_all()
        finally:
            reader.close()

    def copy(self, source: str, target: str) -> None:
        """Copy one object to a new location; override with a server-side copy where the
        store has one (the default reads it whole, then :meth:`write_new`).

        Raises:
            FileNotFoundError: ``source`` does not exist.
            FileExistsError: ``target`` exists.
        """
        self.write_new(target, self.read(source))

    # ------------------------------------------------------------------ prefixes
    @abc.abstractmethod
    def is_dir(self, location: str) -> bool:
        """Whether ``location`` is a directory (a prefix holding objects, on object
        stores); False when nothing is there."""

    @abc.abstractmethod
    def exists(self, location: str) -> bool:
        """Whether ``location`` is an object or a directory; never raises for a missing
        one."""

    @abc.abstractmethod
    def list(self, location: str) -> list[str]:
        """The entries directly under the directory ``location``.

        Returns:
            Their names (objects and directories, without ``location`` or a trailing
            ``/``), in any order.

        Raises:
            FileNotFoundError: ``location`` is no directory (or, on an object store, no
                object has it as a prefix).
        """

    @abc.abstractmethod
    def walk(self, location: str) -> builtins.list[str]:
        """Every object under ``location``, at any depth.

        Returns:
            Their names relative to ``location`` (``a/b``); empty if none, also when
            ``location`` does not exist.
        """

    @abc.abstractmethod
    def make_dirs(self, location: str) -> None:
        """Make the directory ``location`` and its parents; existing ones are fine, and a
        store without directories does nothing."""

    @abc.abstractmethod
    def delete_tree(self, location: str) -> None:
        """Delete a directory (or an object) and everything under it; a missing one is
        fine. Not atomic: a crash midway leaves part of it (ddpckpt renames a checkpoint
        to a temporary name, or deletes its manifest, before calling it)."""

    @abc.abstractmethod
    def rename(self, source: str, target: str) -> None:
        """Move an object or a directory; atomic where :attr:`commit` is a
        :class:`RenameCommit` (which relies on it); elsewhere it may copy then delete
        (S3 does), as no commit relies on it there.

        Args:
            source: What to move.
            target: Where to; an object there is replaced by an object.

        Raises:
            FileNotFoundError: ``source`` does not exist.
            OSError: A directory meets an existing non-empty ``target`` (``EEXIST`` or
                ``ENOTEMPTY``).
        """

    # ---------------------------------------------------------------- the rest
    @abc.abstractmethod
    def parent(self, location: str) -> str:
        """The directory holding ``location`` (absolute where the store has a working
        directory); pure, touches nothing."""

    @abc.abstractmethod
    def free_bytes(self, location: str) -> int | None:
        """Space left for new objects at ``location``, checked before a save writes
        anything.

        Returns:
            Bytes free, or ``None`` where unbounded or unknown (no check is made).
        """

    def best_effort(self) -> Storage:
        """This storage for a last operation that must not hold the process up (releasing
        the run's lock at interpreter exit).

        Returns:
            A storage whose requests are tried once, with short timeouts; local stores
            have no retries and return themselves (the default).
        """
        return self

    def sync_dir(self, location: str) -> None:  # noqa: B027 - a no-op unless overridden
        """Make the entries of the directory ``location`` (creations, renames) durable:
        ``fsync`` of the directory on POSIX; does nothing unless overridden.

        Raises:
            OSError: The sync failed.
        """

    def tree_bytes(self, location: str) -> int:
        """The size of everything under ``location`` (an object or a directory).

        Returns:
            Bytes; objects deleted meanwhile count 0.
        """
        names = self.walk(location) if self.is_dir(location) else [""]
        total = 0
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += self.size(f"{location}/{name}" if name else location)
        return total


class CommitStrategy(abc.ABC):
    """How a checkpoint at location ``final`` becomes visible, all at once.

    A :class:`~ddpckpt.storage.Storage` names its strategy in its ``commit`` attribute;
    a backend usually picks :class:`RenameCommit` or :class:`ManifestLastCommit`, and
    subclasses this only for a store with a commit of its own. A checkpoint is committed
    exactly when its manifest (``manifest.json``) can be read at ``final``: readers never
    see part of one.

    A save runs in this order. Every rank computes :meth:`staging` (the same on every
    rank); the leader of each storage domain checks :meth:`exists` and calls
    :meth:`begin` before any rank writes; every rank then writes its objects under the
    staging location; the leader writes the manifest there last, then calls
    :meth:`publish`. If anything fails anywhere, the leader calls :meth:`abort`. Cleanups
    (``Checkpointer`` retention, :func:`ddpckpt.remove_checkpoint`, ``Checkpointer.resume``
    and ``ddpckpt clean``) call :meth:`discard`, :meth:`set_aside`, :meth:`unfinished` and
    :meth:`restore` on one process, with the run's lock held where there is a run.

    A subclass implements the abstract methods below. Every method raises
    :class:`OSError` (from its storage) on a storage failure.
    """

    @abc.abstractmethod
    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        """Where the objects of the checkpoint ``final`` are written before publishing;
        pure (touches nothing), called on every rank.

        Args:
            storage: The storage holding ``final``.
            final: The checkpoint's location.
            token: Unique to this save attempt, the same on every rank.
            overwrite: The save may replace a committed checkpoint at ``final``.

        Returns:
            The staging location: a new name no reader takes for a checkpoint, or
            ``final`` itself where the manifest written last is the commit.
        """

    @abc.abstractmethod
    def exists(self, storage: Storage, final: str) -> bool:
        """Whether a save to ``final`` without ``overwrite`` must be refused; on the
        leader, before :meth:`begin`.

        Returns:
            True if a committed checkpoint is at ``final`` (or one an interrupted
            overwrite left to be restored there).
        """

    @abc.abstractmethod
    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        """Prepare ``staging`` for the writers (make its directory, remove what an
        interrupted save left there); on the leader, before any rank writes.

        Raises:
            FileExistsError: A checkpoint is at ``final`` and ``overwrite`` is false
                (where this strategy checks it here).
            OSError: A storage failure.
        """

    @abc.abstractmethod
    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        """Make the finished checkpoint visible at ``final`` in one step; on the leader,
        once every object and then the manifest are written and synced under ``staging``.
        With ``overwrite``, a committed checkpoint at ``final`` stays readable until the
        new one replaces it, and is deleted only then.

        Raises:
            FileExistsError: ``final`` exists and ``overwrite`` is false (or an
                :class:`OSError` with ``EEXIST`` or ``ENOTEMPTY``: another process
                committed there first).
            OSError: A storage failure; nothing must be committed then, unless the
                failure came after the commit (a sync of the parent directory).
        """

    def abort(self, storage: Storage, staging: str, final: str) -> None:
        """Remove what a failed save left, never a committed checkpoint; on the leader.

        Called while the save's own error propagates, so a storage failure here (the
        store that just failed the save is often still down) is logged as a WARNING, not
        raised: the leftovers are no checkpoint, and the next save there or
        ``ddpckpt clean`` removes them. Calls :meth:`remove_leftovers`; override that,
        not this.
        """
        try:
            self.remove_leftovers(storage, staging, final)
        except OSError as exc:
            _log.warning(
                "%s: could not remove what the failed save left (%s); it is no checkpoint, "
                "and the next save there or `ddpckpt clean` removes it",
                staging,
                exc,
            )

    @abc.abstractmethod
    def remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        """Delete what a failed save wrote at ``staging``, never a committed checkpoint at
        ``final``; on the leader, through :meth:`abort`.

        Raises:
            OSError: The storage failed (:meth:`abort` logs it).
        """

    @abc.abstractmethod
    def discard(self, storage: Storage, final: str) -> None:
        """Delete a committed checkpoint so that a crash midway never leaves a damaged one
        that still looks committed (rename it away first, or delete its manifest first);
        on one process.

        Raises:
            FileNotFoundError: Where the storage raises it for a missing checkpoint.
            OSError: A storage failure.
        """

    @abc.abstractmethod
    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        """Move a (broken) checkpoint to ``target``, where it is never loaded; on the
        leader, in ``Checkpointer.resume``. Afterwards nothing committed is left at
        ``final``.

        Raises:
            OSError: A storage failure.
        """

    def unfinished(self, storage: Storage, final: str) -> list[str]:
        """What interrupted saves left inside the committed checkpoint ``final``; called by
        cleanups (``ddpckpt clean``).

        Returns:
            Locations that are no part of the checkpoint, safe to delete once no save to
            ``final`` is in flight; empty by default.
        """
        return []

    def restore(self, storage: Storage, final: str) -> None:  # noqa: B027 - nothing by default
        """Finish an overwrite of ``final`` that a crash or a failure interrupted, so that
        ``final`` is the checkpoint committed last: put the replaced checkpoint back where
        ``final`` is missing, delete it where ``final`` is there. Called at every start of
        a run (with its lock held, or no live holder) and by :func:`ddpckpt.latest`;
        other processes may be restoring the same one meanwhile. Does nothing by default:
        nothing to do where the commit replaces ``final`` in one step.

        Raises:
            OSError: A storage failure.
        """
