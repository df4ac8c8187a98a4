"""Each rank's own state beside a framework's checkpoint, written by that rank.

A framework that writes its checkpoint from global rank 0 alone (Lightning) cannot hold
every rank's random streams and loader position without gathering them at rank 0: about
21 kB per rank through rank 0's store into every checkpoint, which every rank then reads,
O(N) per rank and O(N²) in all. Instead, every rank saves its own state in a ddpckpt
checkpoint beside the framework's (:func:`save_own`, collective: each rank writes its own
rank file, rank 0 the manifest), and the framework's checkpoint keeps only a reference,
``{"saved": ".ddpckpt-ranks/<its file name>@step-<step>", "id": <a token>}``, the token
agreed by the ranks and saved with their state (so that state replaced by a later save
under the same name and step is told apart).
At a resume every rank reads the manifest and its own rank file (:func:`load_own`; from
129 ranks on, through one file table: :mod:`ddpckpt._format.filetable`), so no rank's cost
grows with the number of ranks.

One such checkpoint is kept per framework checkpoint and step, under ``.ddpckpt-ranks/``
next to it; :func:`prune_own` deletes those of a framework checkpoint that was deleted, or
replaced twice since (the one replaced last may still be what its file holds while the new
file is written).
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid
from typing import Any

import ddpckpt
from ddpckpt._coord.comm import Comm
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, InexactResumeError
from ddpckpt.storage import storage_for

SIDECARS = ".ddpckpt-ranks"
_KEY = "ranks_own_state"
_TOKEN = "token"  # the same on every rank: what the framework checkpoint's reference names
_SAVED = re.compile(r"\.ddpckpt-ranks/(?P<name>[^/\\]{1,255})@step-(?P<step>[0-9]{10})", re.ASCII)

_log = get_logger(__name__)


class _Held:
    """A value as an object with ``state_dict()``, for :class:`ddpckpt.PerRank`."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = state


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if "://" in directory else os.path.join(directory, name)


def _split(checkpoint: str) -> tuple[str, str]:
    checkpoint = checkpoint.rstrip("/") if "://" in checkpoint else os.path.normpath(checkpoint)
    split = posixpath.split if "://" in checkpoint else os.path.split
    return split(checkpoint)


def save_own(
    checkpoint: str, step: int, state: Any, *, timeout: float | None = None
) -> dict[str, Any]:
    """Save this rank's ``state`` (tensors and plain values) for the framework checkpoint
    about to be written at ``checkpoint``; collective: every rank calls it, with the same
    ``checkpoint`` and ``step``. Returns the reference the framework checkpoint keeps."""
    directory, name = _split(checkpoint)
    relative = f"{SIDECARS}/{name}@step-{max(step, 0):010d}"
    with Comm.open("ddpckpt.integrations (ranks' own state)", timeout=timeout) as comm:
        token = comm.run_reduce("token", lambda: uuid.uuid4().hex[:16], lambda found: found[0])
    own = ddpckpt.TrainingState({_KEY: ddpckpt.PerRank(_Held(state)), _TOKEN: token}, rng=False)
    ddpckpt.save(_join(directory, relative), own, step=step, overwrite=True, timeout=timeout)
    return {"saved": relative, "id": token}


def load_own(checkpoint: str, reference: Any, *, timeout: float | None = None) -> tuple[Any, int]:
    """This rank's state saved for the framework checkpoint ``checkpoint`` whose reference
    is ``reference`` (what :func:`save_own` returned on rank 0), and the number of ranks
    that saved it; collective. A rank the save did not have gets rank 0's state, with a
    warning. Raises :class:`~ddpckpt.errors.CorruptCheckpointError` for a reference that is
    not one, :class:`~ddpckpt.errors.InexactResumeError` if the state it names is missing
    or was replaced by a later save."""
    fields = reference if isinstance(reference, dict) else {}
    relative, ident = fields.get("saved"), fields.get("id")
    if (
        not isinstance(relative, str)
        or not _SAVED.fullmatch(relative)
        or not isinstance(ident, str)
    ):
        raise CorruptCheckpointError(
            f"{checkpoint}: the reference to its ranks' own state is not one ddpckpt writes"
        )
    name = _SAVED.fullmatch(relative)["name"]  # type: ignore[index]
    if name in (".", ".."):
        raise CorruptCheckpointError(f"{checkpoint}: the reference names {relative!r}; refused")
    path = _join(_split(checkpoint)[0], relative)
    held, found = _Held(), {_KEY: None, _TOKEN: None}
    found[_KEY] = ddpckpt.PerRank(held)
    try:
        info = ddpckpt.load(path, ddpckpt.TrainingState(found, rng=False), timeout=timeout)
    except CheckpointNotFoundError:
        raise InexactResumeError(
            f"{checkpoint}: the random streams and data positions of its ranks were saved in "
            f"{path}, which is gone: copy or move the checkpoint together with its "
            f"{SIDECARS} directory, or resume from another checkpoint"
        ) from None
    if found[_TOKEN] != ident:  # the same on every rank: every rank raises it
        raise InexactResumeError(
            f"{checkpoint}: {path} holds the ranks' state of a later save of this checkpoint "
            f"(id {str(found[_TOKEN])[:16]}, not {ident[:16]}): it was replaced while this "
            "file was not; resume from another checkpoint"
        )
    return held.value, info.world_size


def prune_own(checkpoint: str, *, keep: int) -> None:
    """Delete the saved ranks' state of the framework checkpoint ``checkpoint`` but the
    newest ``keep``; on the rank that deletes the framework's checkpoints (rank 0), alone.
    What cannot be deleted is logged, never raised (the checkpoint itself is intact)."""
    directory, name = _split(checkpoint)
    sidecars = _join(directory, SIDECARS)
    store = storage_for(sidecars)
    try:
        names = store.list(sidecars)
    except FileNotFoundError:
        return
    except OSError as exc:
        _log.warning("could not list %s to delete the ranks' state of %s: %s", sidecars, name, exc)
        return
    found = sorted(
        (int(m["step"]), entry)
        for entry in names
        if (m := _SAVED.fullmatch(f"{SIDECARS}/{entry}")) is not None and m["name"] == name
    )
    for _, entry in found[: max(len(found) - keep, 0)]:
        try:
            ddpckpt.remove_checkpoint(_join(sidecars, entry))
        except (OSError, ddpckpt.CheckpointError) as exc:
            _log.warning("could not delete %s, the ranks' state of a deleted checkpoint: %s",
                         _join(sidecars, entry), exc)  # fmt: skip
