"""Finding the newest checkpoint in a directory, without parsing names.

For code that saves with :func:`ddpckpt.save` under names of its own choosing
(``ckpt/step-{step}``, ``ckpt/epoch{epoch}``, ...); a :class:`~ddpckpt.Checkpointer` run
directory works too. Local and read-only: any process may call it, also while a job
saves into the directory.
"""

from __future__ import annotations

import os

from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, read_manifest
from ddpckpt._log import get_logger
from ddpckpt._run.rundir import restore_unless_locked
from ddpckpt.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from ddpckpt.storage import storage_for
from ddpckpt.storage._base import BucketNotFoundError, is_temp_name, previous_of

_log = get_logger(__name__)

SET_ASIDE_MARK = ".corrupt-"  # step-N.corrupt-<token>: moved aside by Checkpointer.resume


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest committed checkpoint directly inside ``directory``; local.

    Newest means the highest ``step`` recorded by ``save(..., step=)``; checkpoints saved
    without a step count as older than any with one and are ordered by when they were
    saved. Temporaries of unfinished saves, checkpoints moved aside as corrupt, and
    directories whose manifest is missing, damaged or lists a file that is missing or of
    the wrong size are skipped. A checkpoint that an interrupted overwrite left as
    ``.name.previous`` (on file systems without an atomic exchange) is put back as ``name``
    first, unless a live job holds the directory's lock (then that path is returned). The
    tensor data is verified when loaded (or by :func:`ddpckpt.verify`).

    Local: call it on every rank before a collective :func:`ddpckpt.load`, or on rank 0
    and broadcast the answer. Inside a run with a :class:`~ddpckpt.Checkpointer`, its
    :meth:`~ddpckpt.Checkpointer.latest_step` says the same as a step.

    Args:
        directory: A run directory (or URL).

    Returns:
        The checkpoint's path, or ``None`` when there is none (also when ``directory``
        does not exist).

    Raises:
        FileNotFoundError: An object store's bucket does not exist.

    Example:
        ::

            path = ddpckpt.latest("ckpt")
            if path is not None:
                info = ddpckpt.load(path, model=model, optimizer=optimizer)
    """
    directory = os.fspath(directory)
    try:
        names = storage_for(directory).list(directory)
    except BucketNotFoundError:
        raise  # None would start a run afresh that can never save there
    except FileNotFoundError:
        return None
    if MANIFEST_NAME in names:  # None here would start the run afresh
        raise ValueError(
            f"{directory}: is a checkpoint itself, and latest() looks for checkpoints inside a "
            f"directory: pass the directory that holds it ({os.path.dirname(directory) or '.'}) "
            "or load this checkpoint directly"
        )
    names = restore_unless_locked(directory, names)
    found: list[tuple[tuple[bool, int, float], str]] = []
    for name in names:
        if is_temp_name(name) or SET_ASIDE_MARK in name:
            continue
        if (replaced := previous_of(name)) is not None and replaced in names:
            continue  # a replaced copy: the checkpoint is the one under its own name
        path = os.path.join(directory, name)
        manifest = _committed(path)
        if manifest is not None:
            step = manifest.step
            found.append(((step is not None, step or 0, manifest.created), path))
    return max(found)[1] if found else None


def _committed(path: str) -> Manifest | None:
    """The manifest of the checkpoint at ``path`` if it is one and its files are all there."""
    store = storage_for(path)
    if not store.is_dir(path):
        return None
    try:
        manifest = read_manifest(path)
    except (IncompleteCheckpointError, CheckpointNotFoundError):
        return None  # no manifest: an unfinished save, no checkpoint at all, or just deleted
    except CheckpointError as exc:
        return _skipped(path, str(exc))
    for name, file in manifest.files.items():
        try:
            size = store.size(os.path.join(path, name))
        except OSError as exc:
            if not store.is_dir(path):
                return None  # deleted meanwhile (the retention of a job saving there): not damaged
            return _skipped(path, f"{name}: {exc}")
        if size != file.size:
            return _skipped(path, f"{name} has {size} bytes, its manifest says {file.size}")
    return manifest


def _skipped(path: str, why: str) -> None:
    _log.warning("latest(): skipping the damaged checkpoint %s (%s); it is not loaded", path, why)
    return None
