"""How a checkpoint becomes visible all at once: the commit strategies of a storage.

:class:`RenameCommit` writes under a temporary directory and renames it (file systems);
:class:`ManifestLastCommit` writes the data objects first and the manifest last, the manifest
being the commit (object stores, which have no rename). One rank per storage domain (the
leader) calls ``begin``/``publish``/``abort``; see :class:`~ddpckpt.storage.CommitStrategy`
(in :mod:`ddpckpt.storage._base`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
from collections.abc import Callable

from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointWriteError
from ddpckpt.storage._base import CommitStrategy, Storage
from ddpckpt.storage._layout import MANIFEST, new_token, previous_name, previous_of, temp_name

_log = get_logger(__name__)


class RenameCommit(CommitStrategy):
    """Write into a temporary sibling ``.D.tmp-<token>``, manifest last, sync, then rename
    it to ``D``: readers see no ``D`` or a complete one; a crash leaves only a temporary,
    which :func:`is_temp_name` recognises.

    Overwriting exchanges the two directories where the store can (``renameat2`` on
    Linux). Elsewhere (NFS, Lustre, macOS, many FUSE file systems) it takes two renames:
    ``D`` to ``.D.previous``, then the new one to ``D``; the parent is synced and only then
    is ``.D.previous`` deleted. Between the renames ``.D.previous`` *is* the committed
    checkpoint: a failure of the second rename moves it back, and what a crash (or a failing
    move back) leaves is put back by :meth:`restore`, which every start of a run calls.
    """

    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        """The temporary sibling ``.D.tmp-<token>`` of ``final`` (``D``)."""
        return temp_name(final, token)

    def exists(self, storage: Storage, final: str) -> bool:
        """Whether ``D`` or ``.D.previous`` exists."""
        return storage.exists(final) or storage.exists(previous_name(final))

    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        """Make the staging directory."""
        storage.make_dirs(staging)

    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        """Sync the staging directory, :meth:`restore` what an interrupted overwrite left,
        then rename it to ``final`` (exchange, or two renames, when overwriting).

        Raises:
            CheckpointWriteError: Files the manifest lists vanished from the staging
                directory (nothing committed), a second rename failed (the old
                checkpoint is put back), or another process keeps restoring the old one.
            FileExistsError: ``final`` exists and ``overwrite`` is false.
            OSError: A storage failure (``EEXIST``/``ENOTEMPTY``: another process
                committed ``final`` first).
        """
        missing = _missing_files(storage, staging)
        if missing:
            raise CheckpointWriteError(
                errno.ENOENT,
                f"{final}: {len(missing)} file(s) the manifest lists vanished from {staging} "
                f"before the commit ({', '.join(missing[:3])}): deleted from outside (the run "
                "directory removed while the save ran?). Nothing was committed",
            )
        storage.sync_dir(staging)
        self.restore(storage, final)  # what an earlier, interrupted overwrite left
        if not storage.exists(final):
            storage.rename(staging, final)  # ENOTEMPTY/EEXIST if another process won a race
            storage.sync_dir(storage.parent(final))
        elif not overwrite:
            raise FileExistsError(errno.EEXIST, "checkpoint already exists", final)
        elif self._exchange(storage, staging, final):
            storage.sync_dir(storage.parent(final))
            _after_replacing(final, lambda: storage.delete_tree(staging))  # the old one now
        else:
            self._replace(storage, staging, final)

    def _exchange(self, storage: Storage, a: str, b: str) -> bool:
        exchange = getattr(storage, "exchange", None)
        return bool(exchange is not None and exchange(a, b))

    def _replace(self, storage: Storage, staging: str, final: str) -> None:
        """Replace ``final`` by ``staging`` in two renames (no atomic exchange here)."""
        previous = previous_name(final)
        for _ in range(3):
            storage.rename(final, previous)
            try:
                storage.rename(staging, final)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and not storage.exists(previous):
                    continue  # another process put the previous one back meanwhile
                raise _undone(storage, previous, final, exc) from exc
            storage.sync_dir(storage.parent(final))  # the new one is durable under its name
            _after_replacing(final, lambda: self._drop(storage, previous))  # only then the old
            return
        raise CheckpointWriteError(
            errno.EBUSY,
            f"{final}: another process keeps restoring the checkpoint this save replaces; the "
            "new one was not committed, the old one is in place",
        )

    def restore(self, storage: Storage, final: str) -> None:
        """Rename ``.D.previous`` back to ``D`` where ``D`` is missing (a WARNING says so),
        or delete it where ``D`` is there."""
        previous = previous_name(final)
        if not storage.exists(previous):
            return
        if storage.exists(final):  # the replacement was committed; deleting the old one was not
            storage.sync_dir(storage.parent(final))
            self._drop(storage, previous)
            _log.info("%s: removed %s, the checkpoint it replaced", final, previous)
            return
        try:
            storage.rename(previous, final)
        except FileNotFoundError:
            return  # another process restored it first
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            self.restore(storage, final)  # another process committed a new one meanwhile
            return
        storage.sync_dir(storage.parent(final))
        _log.warning(
            "%s: restored from %s, where an overwrite that was interrupted (a crash or a "
            "storage failure between its two renames) had left it; it is the checkpoint "
            "committed there before that save",
            final,
            previous,
        )

    def _drop(self, storage: Storage, previous: str) -> None:
        """Delete a replaced checkpoint; renamed to a temporary first, so that a crash
        midway never leaves a partial copy under a name :meth:`restore` would bring back."""
        doomed = temp_name(previous, new_token())
        storage.rename(previous, doomed)
        storage.delete_tree(doomed)

    def remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        storage.delete_tree(staging)

    def discard(self, storage: Storage, final: str) -> None:
        """Rename ``D`` to a temporary, sync the parent, then delete it (and any
        ``.D.previous``)."""
        previous = previous_name(final)
        if storage.exists(previous):  # never to be put back once final is gone
            self._drop(storage, previous)
            if not storage.exists(final):
                return
        doomed = self.staging(storage, final, new_token())
        storage.rename(final, doomed)
        storage.sync_dir(storage.parent(final))
        storage.delete_tree(doomed)

    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        """Rename ``D`` to ``target``."""
        storage.rename(final, target)


def restore_interrupted(storage: Storage, directory: str, names: list[str]) -> list[str]:
    """Put back the checkpoints of ``directory`` that interrupted overwrites left under
    their :func:`previous_name` (``names``: its listing); returns the checkpoint names
    concerned. Call it where no other job may be saving into ``directory`` (its lock held,
    or no live holder): a save of this process in flight survives it."""
    found = [target for target in map(previous_of, names) if target is not None]
    for target in found:
        storage.commit.restore(storage, f"{directory.rstrip('/')}/{target}")
    return found


def _after_replacing(final: str, delete_old: Callable[[], None]) -> None:
    """Delete what ``final`` replaced; the new checkpoint is committed and durable, so a
    failure here is logged, not raised: the next start of the run deletes it."""
    try:
        delete_old()
    except OSError as exc:
        _log.warning(
            "%s: replaced, but deleting the checkpoint it replaced failed (%s); that copy is "
            "no checkpoint any more and goes at the next start of the run or `ddpckpt clean`",
            final,
            exc,
        )


def _missing_files(storage: Storage, staging: str) -> list[str]:
    """The files the manifest in ``staging`` lists that are not there (those its file
    tables list too, format 7)."""
    present = set(storage.walk(staging))
    listed = set(_listed(storage.read(f"{staging}/{MANIFEST}")))
    for table in sorted(listed & present):
        if _TABLE.fullmatch(table):
            listed.update(_listed(storage.read(f"{staging}/{table}")))
    return sorted(listed - present)


def _undone(storage: Storage, previous: str, final: str, exc: OSError) -> CheckpointWriteError:
    """The error of a replacement whose second rename failed, after moving the old
    checkpoint back; it says where that checkpoint is now."""
    try:
        storage.rename(previous, final)
    except OSError as undo:
        return CheckpointWriteError(
            exc.errno,
            f"{final}: replacing the checkpoint failed ({_why(exc)}), and moving the checkpoint "
            f"it replaces back from {previous} failed too ({_why(undo)}). That checkpoint is "
            f"whole and stays there: {final} is missing until the next Checkpointer.resume(), "
            f"ddpckpt.latest() or `ddpckpt ls`/`ddpckpt clean` of its directory puts it back. "
            "The new checkpoint was not committed",
        )
    return CheckpointWriteError(
        exc.errno,
        f"{final}: replacing the checkpoint failed ({_why(exc)}); the checkpoint it replaces "
        "is back in place, unchanged. The new one was not committed",
    )


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc} at {exc.filename}" if exc.filename else str(exc.strerror or exc)


class ManifestLastCommit(CommitStrategy):
    """For stores without rename: data objects are written under ``D`` itself and the
    manifest, written last, is the commit. A prefix without a valid manifest is never a
    checkpoint. Deleting removes the manifest first.

    Overwriting never leaves a moment without a committed checkpoint at ``D``: the new one
    is written under ``D/.next-<token>/``, manifest last; the commit replaces ``D``'s
    manifest in one write with that manifest, its object names prefixed by
    ``.next-<token>/``; only then are the old objects deleted. A failure before that write
    leaves the old checkpoint (and removes the new objects); one after it, the new one.
    """

    def staging(self, storage: Storage, final: str, token: str, *, overwrite: bool = False) -> str:
        """``D/.next-<token>`` when overwriting, else ``D`` itself."""
        return f"{final}/{_NEXT_MARK}{token}" if overwrite else final

    def exists(self, storage: Storage, final: str) -> bool:
        """Whether ``D/manifest.json`` exists."""
        return storage.exists(f"{final}/{MANIFEST}")

    def begin(self, storage: Storage, final: str, staging: str, *, overwrite: bool) -> None:
        """Delete an interrupted save's leftovers under ``D`` (not a committed checkpoint
        when overwriting: it stays until :meth:`publish`).

        Raises:
            FileExistsError: A checkpoint is at ``D`` and ``overwrite`` is false.
        """
        if self.exists(storage, final):
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "checkpoint already exists", final)
            if staging != final:
                storage.make_dirs(staging)  # the old checkpoint stays committed meanwhile
                return
            self.discard(storage, final)
        storage.delete_tree(final)  # an interrupted save's leftovers: no checkpoint
        storage.make_dirs(staging)

    def publish(self, storage: Storage, staging: str, final: str, *, overwrite: bool) -> None:
        """Nothing left to do for a new checkpoint: the manifest the leader wrote last is
        the commit. For a replacement, the switch of manifests described above; a failure
        to delete the old objects afterwards is logged as a WARNING (the new checkpoint
        is committed).

        Raises:
            OSError: Reading the new manifest or replacing ``D``'s failed (the old
                checkpoint stays committed).
        """
        if staging == final:
            return
        prefix = staging[len(final) + 1 :]
        manifest = _relocated(storage.read(f"{staging}/{MANIFEST}"), prefix, final)
        storage.replace(f"{final}/{MANIFEST}", manifest)
        try:  # committed: what follows only frees space
            for name in storage.walk(final):  # the new checkpoint is all under its prefix
                ours = name.startswith(f"{prefix}/") and name != f"{prefix}/{MANIFEST}"
                if name != MANIFEST and not ours:
                    storage.delete(f"{final}/{name}")
        except OSError as exc:
            _log.warning(
                "%s: replaced, but deleting the objects of the previous save failed (%s); "
                "they are no part of the checkpoint and go when it is deleted or replaced",
                final,
                exc,
            )

    def remove_leftovers(self, storage: Storage, staging: str, final: str) -> None:
        if staging != final:
            if staging[len(final) + 1 :] not in _committed_prefixes(
                storage, final
            ):  # not committed
                storage.delete_tree(staging)
        elif not self.exists(storage, final):
            storage.delete_tree(final)

    def discard(self, storage: Storage, final: str) -> None:
        """Delete ``D/manifest.json`` first, then everything under ``D``."""
        with contextlib.suppress(FileNotFoundError):
            storage.delete(f"{final}/{MANIFEST}")
        storage.delete_tree(final)

    def unfinished(self, storage: Storage, final: str) -> list[str]:
        """The ``.next-<token>/`` prefixes of overwrites that never switched the manifest
        (the process died first); the one the committed manifest names is the checkpoint.

        Returns:
            Their locations; empty when ``D`` holds no committed checkpoint.
        """
        try:  # listed before the manifest is read, so that a commit meanwhile is seen
            names = storage.list(final)
            committed = _prefixes(_listed(storage.read(f"{final}/{MANIFEST}")))
        except FileNotFoundError:
            return []  # no checkpoint: the whole prefix is an interrupted save's leftover
        return [
            f"{final}/{name}"
            for name in names
            if name.startswith(_NEXT_MARK) and name not in committed
        ]

    def set_aside(self, storage: Storage, final: str, target: str) -> None:
        """Copy every object to ``target`` (the manifest last), then :meth:`discard`
        ``D``."""
        names = storage.walk(final)
        for name in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
            storage.make_dirs(storage.parent(f"{target}/{name}"))
            storage.copy(f"{final}/{name}", f"{target}/{name}")
        self.discard(storage, final)


_NEXT_MARK = ".next-"


_TABLE = re.compile(r"files-[0-9]{5,10}\.json", re.ASCII)  # a file table (format 7)


def _listed(manifest: bytes) -> list[str]:
    """The object names a manifest (or a file table) lists (read without verifying: a
    cleanup's question)."""
    try:
        return list(json.loads(manifest)["files"])
    except (ValueError, KeyError, TypeError):
        return []


def _committed_prefixes(storage: Storage, final: str) -> set[str]:
    """The first components of the names the committed manifest at ``final`` lists."""
    try:
        return _prefixes(_listed(storage.read(f"{final}/{MANIFEST}")))
    except FileNotFoundError:
        return set()


def _prefixes(names: list[str]) -> set[str]:
    return {name.split("/", 1)[0] for name in names if "/" in name}


Relocation = Callable[[bytes, str, str], bytes]
_relocation: list[Relocation] = []  # registered by ddpckpt._format.manifest at its import


def register_relocation(relocate: Relocation) -> None:
    """Say how a manifest's object names move under a prefix. The format registers it (the
    storage layer knows no manifest schema); every save imports the format before it
    commits, so :class:`ManifestLastCommit` always finds it."""
    _relocation[:] = [relocate]


def _relocated(manifest: bytes, prefix: str, where: str) -> bytes:
    """``manifest`` with every object name under ``prefix/``: what a replacement written
    under ``D/prefix`` commits as ``D``'s manifest."""
    if not _relocation:
        raise RuntimeError(f"{where}: no manifest relocation registered (import ddpckpt first)")
    return _relocation[0](manifest, prefix, where)
