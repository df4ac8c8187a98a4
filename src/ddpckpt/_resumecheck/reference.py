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
from collections.abc import Mapping, Sequence

from ddpckpt._format.boundary import Fields, describe, load_json, read_small
from ddpckpt._resumecheck.records import RECORDS, Records, is_rank_file, read_run
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate

SEAL = "reference.json"
_MAX_SEAL_BYTES = 16 << 20
_MAX_REPORT_BYTES = 256 << 20  # an earlier release's report.json, read for its command only
_MAX_ARGUMENTS = 4096
_RERUN = "run the check again without --reference"


def seal(run_dir: str, command: Sequence[str], digests: Mapping[str, str]) -> None:
    """Write ``reference.json`` into the uninterrupted run's directory ``run_dir``, with the
    digests of its records as the check read them (:func:`~.records.read_run`)."""
    doc = {"format": 1, "command": list(command), "records": dict(digests)}
    with open(os.path.join(run_dir, SEAL), "w") as f:
        json.dump(doc, f, indent=1)


def open_reference(reference: str, command: Sequence[str]) -> tuple[str, Records, list[str]]:
    """The uninterrupted run of the earlier check whose ``--out`` is ``reference``: its
    directory, its records and notes for the report. Raises :class:`ValueError` if it holds
    none or ran another command, and :class:`~ddpckpt.errors.CorruptCheckpointError` if its
    records are damaged or changed since."""
    top = os.path.abspath(reference)
    run_dir = os.path.join(top, "runs", "reference")
    if not os.path.isdir(os.path.join(run_dir, RECORDS)):
        raise ValueError(
            f"--reference {reference}: holds no uninterrupted run of an earlier "
            "check-resume (give the --out directory of that check)"
        )
    sealed = os.path.join(run_dir, SEAL)
    ran: list[str] | None
    digests: dict[str, str] | None = None
    if os.path.lexists(sealed):
        try:
            ran, digests = _read_seal(sealed)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{exc}; {_RERUN}") from None
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
    records, found = read_run(run_dir)
    if digests is not None:
        _same_records(run_dir, digests, found)
    return run_dir, records, notes


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


def _same_records(run_dir: str, sealed: dict[str, str], found: dict[str, str]) -> None:
    """Raise unless the records ``found`` (digests by file name) are those ``sealed``."""
    if sorted(sealed) != sorted(found):
        raise CorruptCheckpointError(
            f"{os.path.join(run_dir, RECORDS)}: holds the records {sorted(found)}, but its "
            f"check wrote {sorted(sealed)}; {_RERUN}"
        )
    for name, digest in found.items():
        if digest != sealed[name]:
            raise CorruptCheckpointError(
                f"{os.path.join(run_dir, RECORDS, name)}: changed since the check that ran it "
                f"wrote it (its digest differs); {_RERUN}"
            )


def _command_of_report(path: str) -> list[str] | None:
    """The command in an earlier release's ``report.json``; ``None`` if there is none."""
    try:
        raw = read_small(locate(path), _MAX_REPORT_BYTES, "check-resume report")
    except FileNotFoundError:
        return None
    fields = Fields(load_json(raw, path, "report", limit=_MAX_REPORT_BYTES), path, "report")
    return _arguments(fields, path)
