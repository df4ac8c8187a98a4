"""The uninterrupted run a check leaves for ``--reference``: which command it ran, and that
its records are still as that check wrote them.

Once the uninterrupted run has succeeded, the checker seals its directory
(:func:`seal`): ``OUT/runs/reference/reference.json`` holds the launch command and the
xxh3-64 digest of each rank's records. A later check given ``--reference OUT`` reuses the
run only for the same command, with the same records (:func:`open_reference`): a reference
of another command (other epochs, another save cadence, another number of ranks) compared
with this command's killed runs made the report blame the script for the difference, and a
record changed since (a damaged disk, a hand edit) made it name a bug the script does not
have. A reference made before this seal existed has no ``reference.json``: its command is
read from that check's ``report.json`` where there is one, and a note says that its records
could not be checked.

Only the checker's process calls these, once per check. Both files are read as untrusted
input (:mod:`ddpckpt._format.boundary`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence

import xxhash

from ddpckpt._format.boundary import Fields, describe, load_json, read_small
from ddpckpt._resumecheck.records import MAX_RECORDS_BYTES, RECORDS, is_rank_file
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate

SEAL = "reference.json"
_MAX_SEAL_BYTES = 16 << 20
_MAX_REPORT_BYTES = 256 << 20  # an earlier release's report.json, read for its command only
_MAX_ARGUMENTS = 4096
_RERUN = "run the check again without --reference"


def seal(run_dir: str, command: Sequence[str]) -> None:
    """Write ``reference.json`` into the uninterrupted run's directory ``run_dir``."""
    digests = {name: _digest(os.path.join(run_dir, RECORDS, name)) for name in _rank_files(run_dir)}
    doc = {"format": 1, "command": list(command), "records": digests}
    with open(os.path.join(run_dir, SEAL), "w") as f:
        json.dump(doc, f, indent=1)


def open_reference(reference: str, command: Sequence[str]) -> tuple[str, list[str]]:
    """The uninterrupted run of the earlier check whose ``--out`` is ``reference``, and notes
    for the report. Raises :class:`ValueError` if it holds none or ran another command, and
    :class:`~ddpckpt.errors.CorruptCheckpointError` if its records changed since."""
    top = os.path.abspath(reference)
    run_dir = os.path.join(top, "runs", "reference")
    if not os.path.isdir(os.path.join(run_dir, RECORDS)):
        raise ValueError(
            f"--reference {reference}: holds no uninterrupted run of an earlier "
            "check-resume (give the --out directory of that check)"
        )
    sealed = os.path.join(run_dir, SEAL)
    ran: list[str] | None
    if os.path.lexists(sealed):
        try:
            ran, digests = _read_seal(sealed)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{exc}; {_RERUN}") from None
        _same_records(run_dir, digests)
        notes = []
    else:
        try:
            ran = _command_of_report(os.path.join(top, "report.json"))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{exc}; {_RERUN}") from None
        notes = [
            f"--reference {reference}: made by an earlier release, whose check did not record "
            "its records' digests: they are used as they are"
        ]
        if ran is None:
            notes.append(
                f"--reference {reference}: the command it ran is not recorded (no report.json): "
                "make sure it was this one"
            )
    if ran is not None and list(ran) != list(command):
        raise ValueError(
            f"--reference {reference}: its uninterrupted run is of the command "
            f"`{shlex.join(ran)}`, not of this one, `{shlex.join(command)}`; a run of another "
            "command is no reference for this one (its steps, saves and ranks differ): run the "
            "check without --reference, or give the --out of a check of this command"
        )
    return run_dir, notes


def _rank_files(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(run_dir, RECORDS)) if is_rank_file(n))


def _digest(path: str) -> str:
    raw = read_small(locate(path), MAX_RECORDS_BYTES, "check-resume record file")
    return xxhash.xxh3_64(raw).hexdigest()


def _read_seal(path: str) -> tuple[list[str], dict[str, str]]:
    raw = read_small(locate(path), _MAX_SEAL_BYTES, "check-resume reference seal")
    fields = Fields(load_json(raw, path, "reference seal", limit=_MAX_SEAL_BYTES), path, "seal")
    fields.integer("format", 1, 1)
    command = _arguments(fields, path)
    records = fields.mapping("records")
    for name, digest in records.items():
        if not is_rank_file(name) or not isinstance(digest, str) or len(digest) != 16:
            raise CorruptCheckpointError(
                f"{path}: the entry {name!r} of 'records' is no rank file's digest "
                f"({describe(digest)})"
            )
    return command, records


def _arguments(fields: Fields, path: str) -> list[str]:
    command = fields.sequence("command")
    if (
        not command
        or len(command) > _MAX_ARGUMENTS
        or not all(isinstance(a, str) and len(a) <= 65536 for a in command)
    ):
        raise CorruptCheckpointError(f"{path}: 'command' is no launch command")
    return command


def _same_records(run_dir: str, digests: dict[str, str]) -> None:
    found = _rank_files(run_dir)
    if sorted(digests) != found:
        raise CorruptCheckpointError(
            f"{os.path.join(run_dir, RECORDS)}: holds the records {found}, but its check "
            f"wrote {sorted(digests)}; {_RERUN}"
        )
    for name in found:
        path = os.path.join(run_dir, RECORDS, name)
        if _digest(path) != digests[name]:
            raise CorruptCheckpointError(
                f"{path}: changed since the check that ran it wrote it (its digest differs); "
                f"{_RERUN}"
            )


def _command_of_report(path: str) -> list[str] | None:
    """The command in an earlier release's ``report.json``; ``None`` if there is none."""
    try:
        raw = read_small(locate(path), _MAX_REPORT_BYTES, "check-resume report")
    except FileNotFoundError:
        return None
    fields = Fields(load_json(raw, path, "report", limit=_MAX_REPORT_BYTES), path, "report")
    return _arguments(fields, path)
