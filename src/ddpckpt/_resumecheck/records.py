"""Reading check-resume's records (``RUN/records/rank<R>.jsonl``, written by :mod:`.record`)
through the trust boundary.

The records of a ``--reference`` directory come from an earlier check, possibly copied from
elsewhere or damaged, and the records of this check's runs sit in a directory anything may
write to while the script runs; so every file is read as untrusted input: only a regular
file is opened (a FIFO, a device or a symbolic link is refused without blocking), at most
:data:`MAX_RECORDS_BYTES` of it, each line is JSON within the boundary's caps, and each event
is checked against the fields its kind must have (:data:`_SCHEMA`) before the checker reads
it. Any violation is a :class:`~ddpckpt.errors.CorruptCheckpointError` naming the file, the
line and the field.

Only the checker's process reads records, except :func:`read_rank_file` of a run's own
files by the recorder (a plain loop's ``ddpckpt.load`` asks at which step this run saved).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ddpckpt._format.boundary import (
    MAX_INT,
    MAX_RANKS,
    Fields,
    describe,
    field_value,
    load_json,
    read_small,
)
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate

MAX_RECORDS_BYTES = 1 << 30  # one rank's records (a few kB a step)
MAX_LINE_BYTES = 64 << 20  # one event
MAX_MARKER_BYTES = 4096  # the ``killed`` marker
RECORDS = "records"
_NAME = re.compile(r"rank(0|[1-9][0-9]{0,6})\.jsonl", re.ASCII)
_MIN_INT = -MAX_INT - 1
_GENERATORS = ("rng.python", "rng.numpy", "rng.torch", "rng.cuda")
_TEXT = 1 << 16  # a warning's text, a refusal's message

Events = list[dict[str, Any]]
Records = dict[int, list[Events]]  # rank -> each process that rank had, in order -> events


class _Event(Fields):
    """One event's fields (``where``: the file and line), with the kinds records use."""

    def flag(self, key: str, *, optional: bool = False) -> bool | None:
        value = field_value(self, key, optional=optional)
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise self.error(f"is {describe(value)}, not true or false", key)
        return value

    def step(self, key: str, *, optional: bool = False) -> int | None:
        return self.integer(key, _MIN_INT, MAX_INT, optional=optional)

    def state(self, key: str, *, optional: bool = False) -> dict[str, Any] | None:
        """A map of component -> digest; the components whose shape the checker reads
        into are checked too."""
        value = field_value(self, key, optional=optional)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            raise self.error(f"is {describe(value)}, not a JSON object", key)
        for component, digest in value.items():
            problem = _component_problem(component, digest)
            if problem is not None:
                raise self.error(f"component {component[:80]!r} {problem}", key)
        return value

    def strings(self, key: str) -> list[str]:
        value = self.sequence(key)
        for item in value:
            if not isinstance(item, str) or len(item) > _PATH:
                raise self.error(f"holds {describe(item)}, not a path", key)
        return value


_PATH = 4096  # a path, a name: what ``Fields.text`` takes by default
_LONG_FIELDS = frozenset({"text", "why"})  # read with ``max_length=_TEXT``


def within_limits(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with its text fields cut to what :func:`check_event` accepts (a
    warning's text, a refusal's message, a path), so that the recorder never writes what
    the checker would refuse as damaged."""

    def cut(value: str, limit: int) -> str:
        return value if len(value) <= limit else value[: limit - 1] + "\u2026"

    fitted: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, str):
            value = cut(value, _TEXT if key in _LONG_FIELDS else _PATH)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = [cut(v, _PATH) for v in value]
        fitted[key] = value
    return fitted


def _component_problem(component: Any, digest: Any) -> str | None:
    if len(component) > _PATH:
        return f"has a name over {_PATH} characters"
    if component.startswith("rng."):  # compared as set members: a digest string
        return None if isinstance(digest, str) else f"is {describe(digest)}, not a digest"
    if component.endswith(".samples"):  # batches of sample indices, or their digest
        if isinstance(digest, str):
            return None
        batches_ok = isinstance(digest, list) and all(
            isinstance(batch, list) and all(type(i) is int for i in batch) for batch in digest
        )
        return None if batches_ok else "is no list of batches of sample indices"
    if component == "loss" and not isinstance(digest, list):
        return f"is {describe(digest)}, not a list of losses"
    if component == "inputs" and not isinstance(digest, dict):
        return f"is {describe(digest)}, not a JSON object"
    return None


def _world(e: _Event) -> int:
    world: int = e.integer("world", 1, MAX_RANKS)
    return world


# What the checker reads of each kind of event (see :mod:`.record` for what each means).
_SCHEMA: dict[str, Callable[[_Event], Any]] = {
    "start": lambda e: (e.integer("pid", 0), _world(e), e.integer("restart", 0),
                        e.state("initial"), e.number("time")),
    "attach": lambda e: e.text("directory"),
    "step": lambda e: (e.step("step"), e.state("start", optional=True), e.state("end")),
    "save": lambda e: (e.step("step"), e.step("label", optional=True), e.integer("n", 1),
                       e.step("epoch", optional=True), e.flag("epoch_end", optional=True),
                       e.text("path"), e.state("state")),
    "resume": lambda e: (e.step("step", optional=True), e.step("label", optional=True),
                         e.step("epoch", optional=True), e.state("state")),
    "seed": lambda e: (_generator(e), e.text("value"), e.text("where"),
                       e.step("after_step", optional=True), e.step("resumed_from", optional=True)),
    "warning": lambda e: (e.text("logger"), e.text("level"), e.text("text", max_length=_TEXT),
                          e.step("after_step", optional=True),
                          e.step("resumed_from", optional=True)),
    "route": lambda e: (e.text("call"), e.text("path"), e.text("to"), e.text("how")),
    "refused": lambda e: (e.text("call"), e.text("path"), e.text("why", max_length=_TEXT)),
    "created": lambda e: e.strings("paths"),
    "exit": lambda e: e.flag("failed"),
}  # fmt: skip


def _generator(e: _Event) -> str:
    generator: str = e.text("generator")
    if generator not in _GENERATORS:
        raise e.error(f"is none of {', '.join(_GENERATORS)}", "generator")
    return generator


def check_event(doc: Any, where: str) -> dict[str, Any]:
    """``doc`` if it is an event the checker can read (its kind known, its fields of their
    types); else :class:`CorruptCheckpointError` naming ``where`` and the field."""
    event = _Event(doc, where, "check-resume record")
    kind = event.text("event", max_length=64)
    if kind not in _SCHEMA:
        raise event.error(f"is {kind[:40]!r}, no kind of record check-resume writes", "event")
    _SCHEMA[kind](event)
    return event.doc


def _damaged(problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{problem}; the records are damaged (a --reference directory: run the check again "
        "without it)"
    )


@dataclass(frozen=True)
class RankFile:
    """One rank's records: each process that rank had (one per start), in order, with its
    events, every one checked by :func:`check_event`; and the xxh3-64 digest of the bytes
    read (a reference's seal compares it, :mod:`.reference`)."""

    path: str
    processes: list[Events]
    digest: str


def read_rank_file(path: str) -> RankFile:
    """The records at ``path`` (see the module docstring for what is refused).

    A line that is no JSON is accepted only as the last line of a process (one killed while
    writing it, which the next process's ``start`` follows, or the file's end), and skipped.
    Raises :class:`CorruptCheckpointError`, or :class:`FileNotFoundError` if it is missing.
    """
    try:
        raw = read_small(locate(path), MAX_RECORDS_BYTES, "check-resume record file")
    except CorruptCheckpointError as exc:
        raise _damaged(str(exc)) from None
    lines = raw.split(b"\n")
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    processes: list[Events] = []
    torn: str | None = None  # why a process's last line (torn by a kill) is no record
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            doc = load_json(line, where, "check-resume record", limit=MAX_LINE_BYTES)
        except CorruptCheckpointError as exc:
            if torn is not None or number == 1:
                raise _damaged(torn or str(exc)) from None
            torn = str(exc)
            if number == last:
                break
            continue
        try:
            event = check_event(doc, where)
        except CorruptCheckpointError as exc:
            raise _damaged(str(exc)) from None
        if event["event"] == "start":
            processes.append([])
        elif torn is not None:
            raise _damaged(torn)
        elif not processes:
            raise _damaged(f"{where}: the file's first check-resume record is no 'start'")
        torn = None
        processes[-1].append(event)
    return RankFile(path, processes, xxhash.xxh3_64(raw).hexdigest())


def is_rank_file(name: str) -> bool:
    """Whether ``name`` is the name of a rank's records (``rank<R>.jsonl``)."""
    return _NAME.fullmatch(name) is not None


def read_records(run_dir: str) -> Records:
    """Each rank's records of the check run ``run_dir``, split into the processes that
    wrote them; ``{}`` if it recorded nothing. Files not named ``rank<R>.jsonl`` are not
    records and not read. Raises :class:`CorruptCheckpointError` (see
    :func:`read_rank_file`)."""
    return read_run(run_dir)[0]


def read_run(run_dir: str) -> tuple[Records, dict[str, str]]:
    """:func:`read_records`, and the digest of each file read, by its name."""
    found: Records = {}
    digests: dict[str, str] = {}
    folder = os.path.join(run_dir, RECORDS)
    if not os.path.isdir(folder):
        return found, digests
    for name in sorted(os.listdir(folder)):
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        rank = int(match.group(1))
        if rank >= MAX_RANKS:
            raise CorruptCheckpointError(
                f"{os.path.join(folder, name)}: rank {rank} is out of range [0, {MAX_RANKS})"
            )
        rank_file = read_rank_file(os.path.join(folder, name))
        found[rank], digests[name] = rank_file.processes, rank_file.digest
    return found, digests


def read_marker(path: str) -> dict[str, Any] | None:
    """The ``killed`` marker of a run (which rank the recorder killed, at which step), or
    ``None`` if there is none."""
    try:
        raw = read_small(locate(path), MAX_MARKER_BYTES, "check-resume kill marker")
    except FileNotFoundError:
        return None
    fields = Fields(load_json(raw, path, "kill marker", limit=MAX_MARKER_BYTES), path, "marker")
    fields.integer("rank", 0, MAX_RANKS)
    fields.integer("step", _MIN_INT, MAX_INT)
    fields.integer("pid", 0)
    fields.text("event", max_length=16)
    return fields.doc


def by_process(records: Mapping[int, list[Events]]) -> dict[int, Events]:
    """Each rank's last process's events."""
    return {rank: processes[-1] for rank, processes in records.items() if processes}
