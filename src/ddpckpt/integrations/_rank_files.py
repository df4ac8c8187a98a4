"""Each rank's own state beside a framework's checkpoint, written by that rank.

A framework that writes its checkpoint from global rank 0 alone (Lightning) cannot hold
every rank's random streams and loader position without gathering them at rank 0: about
21 kB per rank through rank 0's store into every checkpoint, which every rank then reads,
O(N) per rank and O(N²) in all. Instead, every rank saves its own state in a ddpckpt
checkpoint beside the framework's (:func:`save_own`, collective: each rank writes its own
rank file, rank 0 the manifest), and the framework's checkpoint keeps only a reference,
``{"saved": ".ddpckpt-ranks/<its file name>@<token>", "id": <token>}``. The token is agreed
by the ranks at each save (rank 0's clock in nanoseconds, then random digits), saved with
their state and part of its name: every save has its own, so a later save under the same
name never replaces what an earlier file refers to, and the tokens order the saves.
At a resume every rank reads the manifest and its own rank file (:func:`load_own`; from
129 ranks on, through one file table: :mod:`ddpckpt._format.filetable`), so no rank's cost
grows with the number of ranks.

:func:`prune_own` deletes the saves of a framework checkpoint older than the one its file
was last written with (once that write has returned), or all of them when the framework
deletes the checkpoint.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
import uuid
from typing import Any

import xxhash

import ddpckpt
from ddpckpt._coord.comm import Comm
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, InexactResumeError
from ddpckpt.storage._location import locate

SIDECARS = ".ddpckpt-ranks"
_KEY = "ranks_own_state"
_TOKEN = "token"  # the same on every rank: what the framework checkpoint's reference names
_TOKEN_FORM = re.compile(r"[0-9a-f]{24}", re.ASCII)  # 16 hex digits of nanoseconds, 8 random
_NAME = r"[^/\\\x00-\x1f\x7f]{1,200}"
_SAVED = re.compile(rf"\.ddpckpt-ranks/(?P<name>{_NAME})@(?P<token>[0-9a-f]{{24}})", re.ASCII)
# what an interrupted save or deletion of one leaves: ".<name>@<token>.tmp-...", renamed away
_LEFT = re.compile(rf"\.(?P<name>{_NAME})@(?P<token>[0-9a-f]{{24}})\..+", re.ASCII)
_SAFE = re.compile(_NAME, re.ASCII)
_LONGEST = 200  # a longer file name is shortened (the sidecar's name stays under 255 bytes)
_last_time = 0  # the last token's time this process issued: tokens only grow

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
    """The directory of the framework checkpoint ``checkpoint`` and the name its saves are
    kept under (its file name; a long one shortened, with a digest of the whole)."""
    checkpoint = checkpoint.rstrip("/") if "://" in checkpoint else os.path.normpath(checkpoint)
    directory, name = (posixpath.split if "://" in checkpoint else os.path.split)(checkpoint)
    if len(name.encode()) > _LONGEST or not _SAFE.fullmatch(name) or name in (".", ".."):
        plain = re.sub(r"[\\\x00-\x1f\x7f]", "_", name.encode()[:150].decode(errors="ignore"))
        name = f"{plain}~{xxhash.xxh3_64_hexdigest(name.encode())}"
    return directory, name


def _next_token() -> str:
    """Nanoseconds of this process's clock (never less than the last token's: a clock set
    back must not make a later save look older), then 8 random hex digits."""
    global _last_time
    _last_time = max(time.time_ns(), _last_time + 1)
    return f"{_last_time:016x}{uuid.uuid4().hex[:8]}"


def save_own(checkpoint: str, state: Any, *, timeout: float | None = None) -> dict[str, Any]:
    """Save this rank's ``state`` (tensors and plain values) for the framework checkpoint
    about to be written at ``checkpoint``; collective: every rank calls it, with the same
    ``checkpoint``. Returns the reference the framework checkpoint keeps."""
    directory, name = _split(checkpoint)
    with Comm.open("ddpckpt.integrations (ranks' own state)", timeout=timeout) as comm:
        token = comm.run_reduce("token", _next_token, lambda found: found[0])
    relative = f"{SIDECARS}/{name}@{token}"
    own = ddpckpt.TrainingState({_KEY: ddpckpt.PerRank(_Held(state)), _TOKEN: token}, rng=False)
    ddpckpt.save(_join(directory, relative), own, timeout=timeout)
    return {"saved": relative, "id": token}


def token_of(reference: Any) -> str | None:
    """The token of a reference :func:`save_own` returned, or ``None``."""
    found = reference.get("id") if isinstance(reference, dict) else None
    return found if isinstance(found, str) and _TOKEN_FORM.fullmatch(found) else None


def load_own(checkpoint: str, reference: Any, *, timeout: float | None = None) -> tuple[Any, int]:
    """This rank's state saved for the framework checkpoint ``checkpoint`` whose reference
    is ``reference`` (what :func:`save_own` returned), and the number of ranks that saved
    it; collective. A rank the save did not have gets rank 0's state, with a warning.
    Raises :class:`~ddpckpt.errors.CorruptCheckpointError` for a reference that is not one,
    :class:`~ddpckpt.errors.InexactResumeError` if the state it names is missing or is not
    the one it names."""
    fields = reference if isinstance(reference, dict) else {}
    relative, ident = fields.get("saved"), token_of(reference)
    found = _SAVED.fullmatch(relative) if isinstance(relative, str) else None
    if not isinstance(relative, str) or found is None or ident is None or found["token"] != ident:
        raise CorruptCheckpointError(
            f"{checkpoint}: the reference to its ranks' own state is not one ddpckpt writes"
        )
    path = _join(_split(checkpoint)[0], relative)
    values: dict[str, Any]  # the slots load() fills with what the checkpoint holds
    held, values = _Held(), {_KEY: None, _TOKEN: None}
    values[_KEY] = ddpckpt.PerRank(held)
    try:
        info = ddpckpt.load(path, ddpckpt.TrainingState(values, rng=False), timeout=timeout)
    except CheckpointNotFoundError:
        raise InexactResumeError(
            f"{checkpoint}: its ranks' random streams and data positions were saved in {path}, "
            f"which is missing (a checkpoint copied or moved needs its {SIDECARS} entry beside "
            "it). Resume from another checkpoint, or without ExactResume to continue from "
            "this one with new random streams and data order for the rest of its epoch"
        ) from None
    if values[_TOKEN] != ident:  # the same on every rank: every rank raises it
        raise InexactResumeError(
            f"{checkpoint}: {path} holds the ranks' state of another save (token "
            f"{str(values[_TOKEN])[:24]}, not {ident}); resume from another checkpoint"
        )
    return held.value, info.world_size


def prune_own(checkpoint: str, *, older_than: str | None) -> None:
    """Delete the ranks' state saved for the framework checkpoint ``checkpoint`` by saves
    before the one of token ``older_than`` (its file was just written with it), or every
    save's (``None``: the checkpoint was deleted); by the rank that writes and deletes the
    framework's checkpoints, alone. What cannot be deleted is logged, never raised (the
    checkpoint itself is intact)."""
    directory, name = _split(checkpoint)
    sidecars = _join(directory, SIDECARS)
    store = locate(sidecars).storage
    try:
        entries = store.list(sidecars)
    except FileNotFoundError:
        return
    except OSError as exc:
        _log.warning("could not list %s to delete older states of %s: %s", sidecars, name, exc)
        return
    for entry in sorted(entries):
        saved, left = _SAVED.fullmatch(f"{SIDECARS}/{entry}"), _LEFT.fullmatch(entry)
        found = saved or left
        if found is None or found["name"] != name:
            continue
        if older_than is not None and found["token"] >= older_than:
            continue  # this save's, or a later one whose file may not be written yet
        path = _join(sidecars, entry)
        try:
            if saved is not None:
                try:
                    ddpckpt.remove_checkpoint(path)
                    continue
                except CheckpointNotFoundError:
                    pass  # no manifest: a save of it interrupted, never committed
            store.delete_tree(path)
        except (OSError, ddpckpt.CheckpointError) as exc:
            _log.warning("could not delete %s, the ranks' state of an older save of %s: %s",
                         path, name, exc)  # fmt: skip
