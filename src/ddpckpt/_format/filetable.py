"""The files of a checkpoint, and (format 7) the tables that list them beside its manifest.

Every file of a checkpoint has an entry: its size, its xxh3-64 digest and the rank that
wrote it (:class:`~ddpckpt._format.tensorfile.FileEntry`). A job of N ranks writes about
four files per rank (its model and state files, its own file, its shard index), so a
manifest that listed them all would grow with N (about 390 bytes per rank: 6.4 MB at
16,384 ranks), and every rank would parse all of it at every load.

From :data:`TABLE_RANKS` + 1 ranks on, the manifest lists only the files its own records
refer to (those holding tensors stored whole) and one table per :data:`TABLE_RANKS` ranks,
``files-GGGGG.json``, which lists the other files whose names carry a rank of that group::

    {"format": "ddpckpt-files", "id": "<the checkpoint's id>", "group": 3,
     "files": {"rank-00384.safetensors": {"size": ..., "xxh3_64": ..., "writer": 384}, ...}}

The manifest keeps each table's own entry (so a table is verified, copied and checked
like any other file) and, under ``file_tables``, how many files it lists and their bytes.
:class:`FileTable` reads a table only when a name of its group is first asked for, so a
rank that loads its own files reads the manifest and one table, whatever N: the manifest
grows by one table's entry (about 150 bytes) per :data:`TABLE_RANKS` ranks, and no table
lists more than the files of :data:`TABLE_RANKS` ranks.

The names a table lists are relative to the table's own directory: an object store's
replacement committed under a prefix (:func:`ddpckpt._format.manifest.relocated`) renames
the tables in the manifest, and their names resolve under the same prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import xxhash

from ddpckpt._format.boundary import (
    MAX_MANIFEST_BYTES,
    Fields,
    check_file_name,
    load_json,
    read_listed,
)
from ddpckpt._format.tensorfile import FileEntry
from ddpckpt.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage._location import Location

# Ranks per table. A job of at most this many ranks lists its files in the manifest, as
# format 6 does, so that it stays readable by the releases before format 7. 128 balances
# the two documents a rank reads at 16,384 ranks: 128 tables' entries in the manifest
# (about 19 kB) and one table of 128 ranks' files (about 50 kB).
TABLE_RANKS = 128
TABLE_FORMAT = "ddpckpt-files"

_RANKED = re.compile(
    r"(?P<prefix>(?:\.next-[0-9A-Za-z_-]{1,64}/)?)"
    r"(?:model|state|rank|shards)-(?P<rank>[0-9]{5,10})\.(?:safetensors|json)",
    re.ASCII,
)
_TABLE = re.compile(
    r"(?P<prefix>(?:\.next-[0-9A-Za-z_-]{1,64}/)?)files-(?P<group>[0-9]{5,10})\.json"
)
DIGEST = re.compile(r"[0-9a-f]{16}", re.ASCII)


def table_name(group: int) -> str:
    """The name of the table of ranks ``group * ranks`` on, in a checkpoint directory."""
    return f"files-{group:05d}.json"


def is_table(name: str) -> bool:
    """Whether ``name`` (as a manifest lists it) is a file table."""
    return _TABLE.fullmatch(name) is not None


def file_to_json(entry: FileEntry) -> dict[str, Any]:
    return {"size": entry.size, "xxh3_64": entry.digest, "writer": entry.writer}


def file_entry(
    name: str, doc: Any, where: str, world_size: int, what: str = "manifest"
) -> FileEntry:
    """The entry of file ``name`` from ``doc`` read in ``where``, every field checked."""
    fields = Fields(doc, where, lambda: f"{what} entry of file {name[:200]!r}")
    return FileEntry(
        name,
        fields.integer("size"),
        digest_field(fields, "xxh3_64"),
        fields.integer("writer", 0, world_size - 1),
    )


def digest_field(fields: Fields, key: str) -> str:
    """The xxh3-64 digest (16 lowercase hex digits) in field ``key``."""
    value = fields.text(key, max_length=16)
    if not DIGEST.fullmatch(value):
        raise fields.error(f"is {value!r}, not an xxh3-64 digest", key)
    return value


@dataclass(frozen=True)
class TableRef:
    """What the manifest records of one table besides its file entry: how many files it
    lists and their bytes (so a checkpoint's size is known without reading its tables)."""

    files: int
    nbytes: int


class FileTable(MutableMapping[str, FileEntry]):
    """The files of one checkpoint: a mapping of each file's name (as the manifest lists
    it) to its entry, local to the calling process.

    ``inline`` are the entries the manifest holds itself; ``tables`` (format 7) maps the
    name of each table (one of ``inline``) to its :class:`TableRef`, ``ranks`` is the
    ranks per table, and ``location`` the checkpoint directory (as messages name it) whose
    tables are read from where :meth:`bind` says, ``token`` the checkpoint's id. Looking a
    name up reads at most the one table of its group, once; iterating reads every table.
    """

    def __init__(
        self,
        inline: dict[str, FileEntry] | None = None,
        tables: dict[str, TableRef] | None = None,
        *,
        ranks: int | None = None,
        location: str = "",
        token: str = "",
        world_size: int = 1,
    ) -> None:
        self.inline: dict[str, FileEntry] = dict(inline or {})
        self.tables: dict[str, TableRef] = dict(tables or {})
        self.ranks = TABLE_RANKS if ranks is None else ranks  # the module's, when called
        self.location, self.token, self.world_size = location, token, world_size
        self._at: Location | None = None  # where the tables are read: bound by the reader
        self._read: dict[str, dict[str, FileEntry]] = {}
        self._failed: dict[str, CheckpointError] = {}
        self._groups: dict[tuple[str, int], str] = {}
        for listed in self.tables:
            found = _TABLE.fullmatch(listed)
            if found is None:
                raise ValueError(f"{listed!r} is no table's name")
            self._groups[(found["prefix"], int(found["group"]))] = listed
        self._prefixes: set[str] | None = None

    def bind(self, location: Location) -> None:
        """Read the tables not read yet from the checkpoint directory ``location``."""
        self.location, self._at = location.path, location

    # -- the mapping ---------------------------------------------------------------
    def __getitem__(self, name: str) -> FileEntry:
        found = self.inline.get(name)
        if found is not None:
            return found
        table = self._table_of(name)
        if table is None or name not in table:
            raise KeyError(name)
        return table[name]

    def __setitem__(self, name: str, entry: FileEntry) -> None:
        if self.tables:
            raise TypeError("the files of a checkpoint with file tables are read only")
        self.inline[name] = entry
        self._prefixes = None

    def __delitem__(self, name: str) -> None:
        if self.tables:
            raise TypeError("the files of a checkpoint with file tables are read only")
        del self.inline[name]
        self._prefixes = None

    def __iter__(self) -> Iterator[str]:
        yield from self.inline
        for listed in sorted(self.tables):
            yield from self._load(listed)

    def __len__(self) -> int:
        return len(self.inline) + sum(ref.files for ref in self.tables.values())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __repr__(self) -> str:
        return f"FileTable({len(self.inline)} listed, {len(self.tables)} tables)"

    @property
    def nbytes(self) -> int:
        """The bytes of every file, without reading a table."""
        inline = sum(f.size for f in self.inline.values())
        return inline + sum(ref.nbytes for ref in self.tables.values())

    def readable(self, problems: list[str]) -> dict[str, FileEntry]:
        """Every file listed where it can be read: the manifest's own, and those of each
        table that reads and checks; what is wrong with each other table is appended to
        ``problems`` (for the scans and tools that report a damaged checkpoint rather than
        stop at it)."""
        found = dict(self.inline)
        for listed in sorted(self.tables):
            try:
                found.update(self._load(listed))
            except CheckpointError as exc:
                problems.append(str(exc))
        return found

    def find(self, base: str) -> str | None:
        """The name under which the file ``base`` is listed: ``base`` itself, or
        ``<prefix>/<base>`` where an overwrite on an object store committed the
        replacement under a prefix; ``None`` if neither is listed."""
        if self._prefixes is None:
            self._prefixes = {"", *(m["prefix"] for m in map(_RANKED.fullmatch, self.inline) if m)}
            self._prefixes.update(prefix for prefix, _ in self._groups)
        return next((p + base for p in sorted(self._prefixes) if p + base in self), None)

    def relocated(self, prefix: str) -> FileTable:
        """These files as listed under ``prefix/`` (the tables' names resolve under it too)."""
        moved = FileTable(
            {f"{prefix}/{n}": FileEntry(f"{prefix}/{n}", e.size, e.digest, e.writer)
             for n, e in self.inline.items()},
            {f"{prefix}/{n}": ref for n, ref in self.tables.items()},
            ranks=self.ranks, location=self.location, token=self.token, world_size=self.world_size,
        )  # fmt: skip
        moved._at = self._at
        return moved

    # -- writing ---------------------------------------------------------------------
    def tabulate(self, keep: Collection[str], token: str, writer: int) -> dict[str, bytes]:
        """Move every file not in ``keep`` whose name carries a rank into the tables of
        :attr:`ranks` ranks each, and return the tables' documents by name, to be written
        beside the manifest (which lists their entries, written by ``writer``). Called by
        the rank that writes the manifest, once, before it is written."""
        groups: dict[int, dict[str, dict[str, Any]]] = {}
        for name in sorted(self.inline):
            found = _RANKED.fullmatch(name)
            if name in keep or found is None or found["prefix"]:
                continue
            entry = self.inline.pop(name)
            groups.setdefault(int(found["rank"]) // self.ranks, {})[name] = file_to_json(entry)
        blobs = {}
        for group, files in sorted(groups.items()):
            doc = {"format": TABLE_FORMAT, "id": token, "group": group, "files": files}
            blob = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            name = table_name(group)
            self.inline[name] = FileEntry(name, len(blob), xxhash.xxh3_64(blob).hexdigest(), writer)
            total = sum(f["size"] for f in files.values())
            self.tables[name] = TableRef(len(files), total)
            self._groups[("", group)] = name
            blobs[name] = blob
        self.token, self._prefixes = token, None
        return blobs

    def tables_to_json(self) -> dict[str, Any]:
        """The manifest's ``file_tables`` field."""
        return {
            "ranks": self.ranks,
            "tables": {
                name: {"files": ref.files, "bytes": ref.nbytes}
                for name, ref in sorted(self.tables.items())
            },
        }

    # -- reading ---------------------------------------------------------------------
    def _table_of(self, name: str) -> dict[str, FileEntry] | None:
        found = _RANKED.fullmatch(name)
        if found is None:
            return None
        listed = self._groups.get((found["prefix"], int(found["rank"]) // self.ranks))
        return None if listed is None else self._load(listed)

    def _load(self, listed: str) -> dict[str, FileEntry]:
        found = self._read.get(listed)
        if found is None:
            failed = self._failed.get(listed)
            if failed is not None:  # read once: the same error for every name of its group
                raise failed
            try:
                found = self._read[listed] = self._parse_table(listed)
            except CheckpointError as exc:
                self._failed[listed] = exc
                raise
        return found

    def unreadable_ranks(self) -> set[int]:
        """The ranks whose files are listed in a table that failed to read."""
        found: set[int] = set()
        for listed in self._failed:
            match = _TABLE.fullmatch(listed)
            if match is not None:
                group = int(match["group"])
                found.update(range(group * self.ranks, (group + 1) * self.ranks))
        return found

    def _parse_table(self, listed: str) -> dict[str, FileEntry]:
        """The table ``listed``, read once and checked against the manifest: its digest,
        id and group, and each entry (a file of its group, listed once, not in the
        manifest itself), their count and bytes as the manifest records them."""
        ref, entry = self.tables[listed], self.inline.get(listed)
        if self._at is None:
            raise RuntimeError(f"{self.location}: file tables read before the manifest was bound")
        at = self._at.join(listed)
        location = at.path
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.location}: malformed manifest: the file table {listed[:200]!r} has no "
                "entry in its files"
            )
        try:
            raw = read_listed(at, entry.size, entry.digest, "file table", MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{self.location}: {listed}, listed in the manifest, is missing"
            ) from None
        match = _TABLE.fullmatch(listed)
        assert match is not None  # checked in __init__
        prefix, group = match["prefix"], int(match["group"])
        fields = Fields(load_json(raw, location, "file table"), location, "file table")
        if (
            fields.value("format", None) != TABLE_FORMAT
            or fields.value("id", None) != self.token
            or fields.value("group", None) != group
        ):
            raise CorruptCheckpointError(
                f"{location}: not the file table of ranks {group * self.ranks} to "
                f"{(group + 1) * self.ranks - 1} of this checkpoint"
            )
        files = {}
        for name, doc in fields.mapping("files").items():
            ranked = _RANKED.fullmatch(name) if isinstance(name, str) else None
            if ranked is None or ranked["prefix"] or int(ranked["rank"]) // self.ranks != group:
                raise fields.error(
                    f"lists {str(name)[:200]!r}, no file of ranks {group * self.ranks} to "
                    f"{(group + 1) * self.ranks - 1}",
                    "files",
                )
            full = check_file_name(prefix + name, location)
            if full in self.inline:
                raise fields.error(f"lists {name[:200]!r}, which the manifest lists", "files")
            files[full] = file_entry(full, doc, location, self.world_size, "file table")
        nbytes = sum(f.size for f in files.values())
        if (len(files), nbytes) != (ref.files, ref.nbytes):
            raise CorruptCheckpointError(
                f"{location}: lists {len(files)} files of {nbytes} bytes, where the manifest "
                f"records {ref.files} files of {ref.nbytes} bytes"
            )
        return files


def tables_from_json(
    doc: Any, where: str, inline: dict[str, FileEntry], token: str, world_size: int
) -> FileTable:
    """The files of a manifest read at ``where``: ``inline`` and, from its ``file_tables``
    field ``doc`` (``None`` before format 7), the tables, each checked to be one of
    ``inline`` and of a group of the job's ranks."""
    if doc is None:
        return FileTable(inline, location=where, token=token, world_size=world_size)
    fields = Fields(doc, where, "manifest field 'file_tables'")
    ranks = fields.integer("ranks", 1, world_size)
    tables, groups = {}, set()
    for listed, ref_doc in fields.mapping("tables").items():
        found = _TABLE.fullmatch(listed)
        group = int(found["group"]) if found is not None else -1
        if (
            found is None
            or listed != found["prefix"] + table_name(group)  # one name per group
            or listed not in inline
            or group * ranks >= world_size
        ):
            raise fields.error(
                f"names {listed[:200]!r}, no file table of the {world_size} ranks it lists",
                "tables",
            )
        if group in groups:
            raise fields.error(f"names two tables of ranks {group * ranks} on", "tables")
        groups.add(group)
        ref = Fields(ref_doc, where, f"manifest entry of file table {listed!r}")
        tables[listed] = TableRef(ref.integer("files", 1, 64 * ranks), ref.integer("bytes"))
    return FileTable(
        inline, tables, ranks=ranks, location=where, token=token, world_size=world_size
    )
