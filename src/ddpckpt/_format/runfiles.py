"""The files of a run directory (a :class:`~ddpckpt.Checkpointer`'s), parsed as typed records::

    run/step-00000100/   a checkpoint: the name is ``step-`` and the step in 8 digits or more
    run/latest           "step-00000100": the newest checkpoint
    run/run.json         {"retention": ...}: the retention policy, for ``ddpckpt ls``
    run/.lock            {"host", "pid", "job", "since"}: the job writing here
    run/fast-tier-owner  "<run>#<token>": the run's identity, for its fast tier (made by the
                         first resume() or save() of a Checkpointer with ``fast_tier=``;
                         plain UTF-8 text, unchanged since it was introduced)
    fast/owner.json      in a fast-tier directory (itself laid out as a run directory, with
                         its own ``latest``, ``run.json`` and ``.lock``): the marker saying it
                         is a fast tier and which run its steps belong to, JSON
                         ``{"format": 1, "kind": "ddpckpt-fast-tier", "run": "<identity>"}``;
                         the previous release wrote the bare identity (read as format 0)

Like a checkpoint's, their content is untrusted input (see
:mod:`ddpckpt._format.boundary`): each is read as a bounded regular file and parsed into a
record, or raises :class:`~ddpckpt.errors.CorruptCheckpointError` naming the file and the
field. Callers decide what damage means: a damaged ``latest`` or ``run.json`` is reported and
treated as absent, a damaged ``.lock`` as a torn one.

:func:`describe_path` says what a path that is no checkpoint is (a run directory, one of its
files, a directory holding checkpoints), for the errors of the functions that expected one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ddpckpt._format.boundary import (
    MAX_RUN_FILE_BYTES,
    Fields,
    load_json,
    read_bounded,
    read_small,
)
from ddpckpt._log import get_logger
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._layout import MANIFEST, is_temp_name
from ddpckpt.storage._location import Location

_log = get_logger(__name__)

LATEST = "latest"
RUN_FILE = "run.json"
LOCK_NAME = ".lock"
RUN_DIR_IDENTITY = "fast-tier-owner"  # in a run directory that has a fast tier
FAST_TIER_MARKER = "owner.json"  # in a fast-tier directory: its marker (FastTierMarker)
RUN_MARKS = frozenset({LATEST, RUN_FILE, LOCK_NAME, RUN_DIR_IDENTITY, FAST_TIER_MARKER})
FAST_TIER_KIND = "ddpckpt-fast-tier"
FAST_TIER_FORMAT = 1  # the marker's format this release writes (0: the previous, bare text)
MAX_IDENTITY_BYTES = 16 << 10  # a run's identity: its path (at most PATH_MAX) and a token
_MAX_IDENTITY_CHARS = 8192
CORRUPT_MARK = ".corrupt-"  # step-N.corrupt-<token>: moved aside by Checkpointer.resume
_STEP = re.compile(r"step-([0-9]{8,19})", re.ASCII)
_MAX_PID = 2**31 - 1
_NUMBERS = re.compile(r"([0-9]+)", re.ASCII)  # natural_key: digits apart from the rest
_DATA_FILE_LIKE = re.compile(r"(?:model|state|rank)-[0-9]+\.safetensors", re.ASCII)  # describing
_warned: set[str] = set()  # stray names already reported by this process


def step_dirname(step: int) -> str:
    """The directory name of checkpoint ``step`` in a run directory."""
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory named as ddpckpt names them, else ``None``.

    Only the spelling :func:`step_dirname` writes counts (``step-00000005``, not ``step-5``,
    ``step-000000005`` or other digits), so no two names ever mean the same step.
    """
    match = _STEP.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dirname(step) == name else None


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key ordering the numbers in a name as numbers (``step-9`` before
    ``step-19``, ``checkpoint-8`` before ``checkpoint-64``), the rest as text."""
    return tuple(
        (1, int(part)) if part.isdigit() else (0, part) for part in _NUMBERS.split(name) if part
    )


def is_stray_step(name: str) -> bool:
    """A name that looks like a checkpoint of the run but is not ddpckpt's spelling
    (``step-5``, ``step-00000005.bak``): never loaded or deleted, and reported."""
    return name.startswith("step-") and parse_step(name) is None and CORRUPT_MARK not in name


def warn_stray(directory: str, name: str) -> None:
    """Report, once per process, a stray name in a run directory."""
    path = os.path.join(directory, name)
    if path in _warned:
        return
    _warned.add(path)
    match = re.match(r"step-([0-9]+)", name, re.ASCII)
    spelled = f" (ddpckpt writes {step_dirname(int(match.group(1)))})" if match else ""
    _log.warning(
        "%s: skipped: not a checkpoint name ddpckpt writes%s; it is never loaded, kept or "
        "deleted by the run",
        path,
        spelled,
    )


def parse_latest(data: bytes, where: str) -> str:
    """The checkpoint name a ``latest`` file holds (``step-00000100``)."""
    try:
        name = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{where}: not a checkpoint name (not ASCII text)") from None
    if parse_step(name) is None:
        raise CorruptCheckpointError(f"{where}: {name[:80]!r} is not a checkpoint name")
    return name


def read_latest(directory: Location) -> str | None:
    """What the run's ``latest`` names, or ``None`` if it is missing; a damaged one is
    reported as a warning and counts as missing (nothing loads through it: the run's
    checkpoints are listed, and the next save rewrites it)."""
    location = directory.join(LATEST)
    try:
        return parse_latest(read_small(location, MAX_RUN_FILE_BYTES, "latest file"), location.path)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        _log.warning("%s; ignored (the run's checkpoints are listed instead)", exc)
        return None


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run's lock: host name, process id, job id (``TORCHELASTIC_RUN_ID`` or
    ``SLURM_JOB_ID``, or ``None``) and since when (seconds since the epoch)."""

    host: str
    pid: int
    job: str | None
    since: float

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "job": self.job, "since": self.since}


def parse_lock(data: bytes, where: str) -> LockHolder:
    """The holder a ``.lock`` file names."""
    fields = Fields(
        load_json(data, where, "lock file", limit=MAX_RUN_FILE_BYTES), where, "lock file"
    )
    job = fields.text("job", None, max_length=256)
    return LockHolder(
        fields.text("host", max_length=256),
        fields.integer("pid", 1, _MAX_PID),
        job,
        fields.number("since", 0.0),
    )


def read_lock(location: Location) -> LockHolder | None:
    """The holder of the lock file at ``location``, ``None`` if there is none; raises :class:`CorruptCheckpointError` if
    it is torn or damaged, an :class:`OSError` if it cannot be read (also when it is no
    regular file: a directory or FIFO there is a storage failure, not a torn lock)."""
    try:
        data = read_bounded(location, MAX_RUN_FILE_BYTES, "lock file")
    except FileNotFoundError:
        return None
    return parse_lock(data, location.path)


def parse_run_file(data: bytes, where: str) -> dict[str, Any]:
    """The retention description ``run.json`` holds (``{}`` if none); the policies
    :func:`ddpckpt.policies._retention_from` rebuilds are checked field by field (others,
    a user's own, are returned as they are and rebuilt as none)."""
    fields = Fields(load_json(data, where, RUN_FILE, limit=MAX_RUN_FILE_BYTES), where, RUN_FILE)
    retention = fields.mapping("retention", {})
    _check_retention(retention, where)
    return retention


def _check_retention(doc: Any, where: str) -> None:
    fields = Fields(doc, where, "retention policy")
    kind = doc.get("type")
    if kind == "KeepLast":
        fields.integer("n", 1)
    elif kind == "KeepBest":
        fields.integer("k", 1)
        if not fields.text("monitor", max_length=1024):
            raise fields.error("is empty", "monitor")
        if fields.text("mode", "min") not in ("min", "max"):
            raise fields.error("is neither 'min' nor 'max'", "mode")
    elif kind == "Union":
        for policy in fields.sequence("policies", []):
            _check_retention(policy, where)


def read_retention(directory: Location) -> dict[str, Any]:
    """The retention description of the run in ``directory`` (``{}`` when none is recorded;
    a damaged ``run.json`` is reported as a warning and counts as none)."""
    location = directory.join(RUN_FILE)
    try:
        return parse_run_file(read_small(location, MAX_RUN_FILE_BYTES, RUN_FILE), location.path)
    except FileNotFoundError:
        return {}
    except CorruptCheckpointError as exc:
        _log.warning("%s; ignored (`ddpckpt ls` shows no retention notes)", exc)
        return {}


def run_file_text(policy: dict[str, Any]) -> bytes:
    """The ``run.json`` holding ``policy`` (``{"retention": ...}``)."""
    return json.dumps(policy, indent=1).encode()


def parse_run_identity(data: bytes, where: str) -> str:
    """The identity a run directory's ``fast-tier-owner`` holds (``"<run>#<token>"``, as
    UTF-8 text): compared, never interpreted, so any text but an empty one, one with a NUL
    or one longer than 8192 characters is accepted."""
    if len(data) > MAX_IDENTITY_BYTES:
        raise CorruptCheckpointError(
            f"{where}: the run's identity is {len(data)} bytes, more than the "
            f"{MAX_IDENTITY_BYTES} it may have; refused"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(
            f"{where}: the run's identity is not UTF-8 text; refused"
        ) from None
    return _check_identity(text, where, "the run's identity")


def _check_identity(text: str, where: str, what: str) -> str:
    if not text:
        raise CorruptCheckpointError(f"{where}: {what} is empty; refused")
    if len(text) > _MAX_IDENTITY_CHARS:
        raise CorruptCheckpointError(
            f"{where}: {what} is {len(text)} characters long (at most "
            f"{_MAX_IDENTITY_CHARS}); refused"
        )
    if "\0" in text:
        raise CorruptCheckpointError(f"{where}: {what} holds a NUL character; refused")
    return text


def read_run_identity(directory: Location) -> str | None:
    """The identity of the run in ``directory`` (its ``fast-tier-owner``), ``None`` if it
    has none; :class:`CorruptCheckpointError` if that file is no regular file (a FIFO is
    never opened for long), is larger than :data:`MAX_IDENTITY_BYTES` (checked before
    reading) or is not an identity; an :class:`OSError` if it cannot be read."""
    location = directory.join(RUN_DIR_IDENTITY)
    data = _read_if_there(location, "run's identity file")
    return None if data is None else parse_run_identity(data, location.path)


def _read_if_there(location: Location, what: str) -> bytes | None:
    """The bytes of the small file ``location`` (at most :data:`MAX_IDENTITY_BYTES`, a
    regular file), ``None`` if there is none."""
    try:
        return read_small(location, MAX_IDENTITY_BYTES, what)
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class FastTierMarker:
    """What a fast-tier directory's marker (``owner.json``) says: the ``run`` whose steps
    it holds (the identity in that run directory's ``fast-tier-owner``) and the marker's
    ``format`` (1; 0 for the bare identity the previous release wrote)."""

    run: str
    format: int = FAST_TIER_FORMAT

    @property
    def run_directory(self) -> str:
        """The run directory named in the identity, for messages (``"<run>#<token>"``)."""
        return self.run.rpartition("#")[0] or self.run

    def as_bytes(self) -> bytes:
        """The marker as this release writes it (format 1, whatever it was read as)."""
        document = {"format": FAST_TIER_FORMAT, "kind": FAST_TIER_KIND, "run": self.run}
        return json.dumps(document).encode()


def parse_fast_tier_marker(data: bytes, where: str) -> FastTierMarker:
    """The marker of a fast-tier directory: a JSON object (format 1; a later format is
    refused, naming it), or, where the first byte that is not white space is no ``{``, the
    bare identity the previous release wrote (format 0). Anything else raises
    :class:`CorruptCheckpointError` naming ``where`` and the field."""
    if len(data) > MAX_IDENTITY_BYTES:
        raise CorruptCheckpointError(
            f"{where}: the fast tier's marker is {len(data)} bytes, more than the "
            f"{MAX_IDENTITY_BYTES} it may have; refused"
        )
    if data.lstrip()[:1] != b"{":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptCheckpointError(
                f"{where}: the fast tier's marker is neither JSON nor the UTF-8 text an "
                "earlier release wrote; refused"
            ) from None
        return FastTierMarker(_check_identity(text, where, "the fast tier's marker"), 0)
    what = "fast tier's marker"
    fields = Fields(load_json(data, where, what, limit=MAX_IDENTITY_BYTES), where, what)
    version = fields.integer("format", 0)
    if version != FAST_TIER_FORMAT:
        raise fields.error(
            f"is {version}: this release reads format {FAST_TIER_FORMAT} (written by another "
            "release of ddpckpt?)",
            "format",
        )
    if fields.text("kind", max_length=64) != FAST_TIER_KIND:
        raise fields.error(f"is not {FAST_TIER_KIND!r}", "kind")
    run = fields.text("run", max_length=_MAX_IDENTITY_CHARS)
    return FastTierMarker(_check_identity(run, where, "the marker's run"), version)


def read_fast_tier_marker(directory: Location) -> FastTierMarker | None:
    """The marker of the fast tier ``directory``, ``None`` if it has none; as
    :func:`read_run_identity` otherwise (:class:`CorruptCheckpointError` for any damage)."""
    location = directory.join(FAST_TIER_MARKER)
    data = _read_if_there(location, "fast tier's marker")
    return None if data is None else parse_fast_tier_marker(data, location.path)


def describe_path(place: Location) -> str | None:
    """What ``place`` is, when it is not a checkpoint directory, as a message saying what was
    expected; ``None`` when it is a checkpoint (complete or not) or does not exist."""
    store, path = place.storage, place.path
    if not store.is_dir(path):
        return _describe_run_file(place) if store.exists(path) else None
    names = store.list(path)
    if MANIFEST in names or any(_DATA_FILE_LIKE.fullmatch(n) for n in names):
        return None
    base = os.path.basename(path.rstrip("/"))
    if parse_step(base) is not None or is_temp_name(base) or CORRUPT_MARK in base:
        return None  # a checkpoint directory whose save never wrote anything
    stepped = [(n, step) for n in names if (step := parse_step(n)) is not None]
    steps = [n for n, _ in sorted(stepped, key=lambda pair: pair[1])]
    if steps or RUN_MARKS & set(names):
        latest = read_latest(place) or (steps[-1] if steps else None)
        example = (
            f", or name one of its checkpoints, e.g. {os.path.join(path, latest)}"
            if latest
            else " (it holds no checkpoint yet)"
        )
        return f"{path}: a run directory, not a checkpoint: try `ddpckpt ls {path}`{example}"
    inner = sorted(
        (n for n in names if not is_temp_name(n) and store.exists(os.path.join(path, n, MANIFEST))),
        key=natural_key,
    )
    if inner:
        shown = ", ".join(inner) if len(inner) <= 4 else f"{inner[0]}, ..., {', '.join(inner[-2:])}"
        return (
            f"{path}: a directory holding checkpoints ({shown}), not a checkpoint itself: "
            f"`ddpckpt ls {path}` lists them and says which one ddpckpt.load_latest picks; "
            f"or name one of them, e.g. {os.path.join(path, inner[-1])}"
        )
    if not names:
        return f"{path}: an empty directory, not a checkpoint"
    return (
        f"{path}: not a ddpckpt checkpoint: it has no {MANIFEST} and no checkpoint "
        "files (expected a directory written by ddpckpt.save or a Checkpointer's step-N)"
    )


def _describe_run_file(place: Location) -> str | None:
    """The message for a file of a run directory (``latest``, ``run.json``, ``.lock``)."""
    path = place.path
    run, base = os.path.split(path.rstrip("/"))
    if base not in (LATEST, RUN_FILE, LOCK_NAME):
        return None
    newest = read_latest(Location(place.storage, run or ".")) if base == LATEST else None
    if newest:
        return (
            f"{path}: the run's pointer to its newest checkpoint, not a checkpoint: name that "
            f"checkpoint, {os.path.join(run, newest)}"
        )
    return f"{path}: a file of the run directory {run or '.'}, not a checkpoint: try `ddpckpt ls {run or '.'}`"
