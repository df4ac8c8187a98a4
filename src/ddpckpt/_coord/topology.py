"""Which ranks see the same storage at the checkpoint directory.

A checkpoint directory is either *shared* (a parallel or network file system every node
mounts) or *node-local* (each node's own disk under the same path). Host names alone
cannot tell, so :func:`storage_domains` asks the file system: one rank per node writes a
probe file, every such rank looks for the others', and ranks that see the same probes
form one *storage domain*. ddpckpt writes one complete copy of a checkpoint per domain.

The answer is kept for the job (per directory, mode and group of ranks): a later call
only creates the directory and checks, in the same exchange, that every rank still sees
it on the file system it saw then (its device; another file system mounted there, or the
directory replaced by a link to one, probes again).

``sharing="shared"`` or ``"local"`` (or ``$DDPCKPT_STORAGE``) skips the probe and is
honoured as given: ``"shared"`` puts all ranks in one domain, ``"local"`` makes one
domain per node. Nodes are told apart by :func:`node_id` (host name and
boot id); if that identity still collides (more ranks claim one machine than its
``LOCAL_WORLD_SIZE``), ``"auto"`` and ``"local"`` refuse rather than mix machines.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ddpckpt._coord.store import namespace
from ddpckpt.errors import CheckpointError
from ddpckpt.storage._location import Location
from ddpckpt.storage._posix import PosixStorage

StorageMode = Literal["auto", "shared", "local"]
_MODES = ("auto", "shared", "local")


class Collective(Protocol):
    """One rank's side of a collective call (a :class:`~ddpckpt._coord.comm.Comm`): what
    :func:`storage_domains` uses of it."""

    rank: int
    world_size: int
    token: str

    @property
    def nodes(self) -> list[str]: ...

    def run(self, tag: str, step: Callable[[], Any]) -> Any: ...

    def run_reduce(
        self, tag: str, step: Callable[[], Any], reduce: Callable[[list[Any]], Any]
    ) -> Any: ...


def resolve_storage_mode(mode: str | None) -> StorageMode:
    """``mode``, else ``$DDPCKPT_STORAGE``, else ``"auto"``; validated."""
    source = "sharing"
    if mode is None:
        mode = os.environ.get("DDPCKPT_STORAGE", "").strip() or "auto"
        source = "DDPCKPT_STORAGE"
    if mode not in _MODES:
        raise ValueError(f"{source} must be one of {', '.join(_MODES)}; got {mode!r}")
    return mode  # type: ignore[return-value]


def node_id() -> str:
    """Names the machine this process runs on: ``host/machine[/group]``.

    The host name alone can collide (cloned images, containers all called ``localhost``),
    so it is qualified by the kernel's boot id (random for each boot of each machine; else
    ``/etc/machine-id``), and by torchrun's node rank (``GROUP_RANK``) when set, so that
    several simulated nodes on one host are told apart too.
    """
    name = f"{platform.node()}/{_machine_token()}"
    group = os.environ.get("GROUP_RANK")
    return f"{name}/{group}" if group is not None else name


_MACHINE_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id")


def _machine_token() -> str:
    """A short identifier of this machine's running system, or ``"?"`` where none exists."""
    for path in _MACHINE_FILES:
        try:
            with open(path) as f:
                token = f.read().strip().replace("-", "")
        except OSError:
            continue
        if token:
            return token[:12]
    return "?"


def _by_node(comm: Collective) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(comm.nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def colliding_nodes(nodes: list[list[int]], local_sizes: list[str | None]) -> list[list[int]]:
    """The groups of ranks that claim one machine but hold more ranks than it runs.

    ``local_sizes[rank]`` is that rank's ``LOCAL_WORLD_SIZE`` (set by torchrun and most
    launchers: how many ranks its machine, or simulated node, runs), ``None`` if unset.
    """
    colliding = []
    for ranks in nodes:
        sizes = {int(s) for r in ranks if (s := local_sizes[r]) and s.isdigit()}
        if sizes and len(ranks) > max(sizes):
            colliding.append(ranks)
    return colliding


def _check_nodes(comm: Collective, nodes: list[list[int]], directory: str) -> None:
    """Raise if node identities collide: grouping by node would then mix machines."""

    def first_collision(local_sizes: list[str | None]) -> tuple[list[int], str | None] | None:
        colliding = colliding_nodes(nodes, local_sizes)
        return (colliding[0], local_sizes[colliding[0][0]]) if colliding else None

    local_world = lambda: os.environ.get("LOCAL_WORLD_SIZE")  # noqa: E731
    collision = comm.run_reduce("local-world", local_world, first_collision)
    if collision:
        ranks, size = collision
        raise CheckpointError(
            f"{directory}: ranks {ranks} report the same machine ({comm.nodes[ranks[0]]}) but "
            f"LOCAL_WORLD_SIZE says each machine runs {size}: several machines "
            "share this identity (same host name, no boot id), so ddpckpt cannot tell which "
            "ranks share a disk. Give the machines distinct host names, or pass "
            "sharing='shared' if this directory is one file system that every machine mounts"
        )


def _probe_name(directory: str, token: str, rank: int) -> str:
    return os.path.join(directory, f".probe-{rank}.tmp-{token}")


@dataclass
class _Known:
    """Storage domains found earlier in this job, and what every rank saw of the directory
    then (on rank 0; the other ranks keep ``None``)."""

    group: Any  # the group of ranks they were found for (kept, so that it stays the same)
    domains: list[list[int]]
    seen: list[Any] | None


_known: dict[tuple[str, int, str, str], _Known] = {}


def _directory_identity(store: Any, directory: str) -> int | None:
    """The file system this rank sees ``directory`` on (its device), which decides what it
    shares; ``None`` on stores whose directories are only names."""
    if not isinstance(store, PosixStorage):
        return None
    return os.stat(directory).st_dev


def storage_domains(
    comm: Collective, location: Location, mode: str | None = None
) -> list[list[int]]:
    """Partition the ranks into groups that share storage at the directory ``location``.
    Collective.

    Creates ``directory`` where missing. Returns the groups ordered by lowest rank, each
    sorted. Found once per job, directory and mode (see the module's docstring).
    """
    mode = resolve_storage_mode(mode)
    store, directory = location.storage, location.path
    everyone = [list(range(comm.world_size))]
    if comm.world_size == 1 or mode == "shared":
        comm.run("mkdir", lambda: store.make_dirs(directory))
        return everyone
    group = getattr(comm, "group", None)
    key = (namespace(), id(group), directory, mode)
    known = _known.get(key)
    if known is not None and known.group is not group:  # another group, at the same address
        known = None
    seen: list[Any] = []

    def look_again() -> list[Any]:
        store.make_dirs(directory)
        return [known is not None, _directory_identity(store, directory)]

    def unchanged(found: list[list[Any]]) -> bool:  # on rank 0
        seen[:] = [identity for _, identity in found]
        return known is not None and all(k for k, _ in found) and seen == known.seen

    if comm.run_reduce("known", look_again, unchanged):
        return known.domains  # type: ignore[union-attr]
    domains = _probe(comm, store, directory, mode)
    _known[key] = _Known(group, domains, seen if comm.rank == 0 else None)
    return domains


def _probe(comm: Collective, store: Any, directory: str, mode: StorageMode) -> list[list[int]]:
    """:func:`storage_domains` the first time (the directory exists on every rank by now),
    for several ranks and modes other than shared."""
    nodes = _by_node(comm)
    _check_nodes(comm, nodes, directory)
    if mode == "local" or len(nodes) == 1:  # ranks on one machine see the same file system
        return sorted(nodes, key=lambda d: d[0])
    probers = [ranks[0] for ranks in nodes]
    mine = _probe_name(directory, comm.token, comm.rank)

    def write_probe() -> None:
        store.make_dirs(directory)
        if comm.rank in probers:
            store.write_new(mine, b"")

    comm.run("probe", write_probe)

    def look() -> list[int] | None:
        if comm.rank not in probers:
            return None
        return [r for r in probers if store.exists(_probe_name(directory, comm.token, r))]

    def by_prober(seen: list[list[int] | None]) -> dict[str, Any]:  # on rank 0
        """Each node's domain number (O(nodes) for every rank), or what the nodes saw."""
        visible = {rank: frozenset(seen[rank] or []) for rank in probers}
        for rank, others in visible.items():
            if rank not in others or any(visible.get(other) != others for other in others):
                return {"inconsistent": {r: sorted(v) for r, v in visible.items()}}
        numbers: dict[frozenset[int], int] = {}
        return {"domain": [numbers.setdefault(visible[rank], len(numbers)) for rank in probers]}

    verdict = comm.run_reduce("look", look, by_prober)
    if comm.rank in probers:
        # another node's leader, already cleaning the directory's temporaries for
        # Checkpointer.resume, may have removed it: gone either way
        with contextlib.suppress(FileNotFoundError):
            store.delete(mine)
    if "inconsistent" in verdict:
        raise CheckpointError(
            f"{directory}: nodes see inconsistent sets of each other's files "
            f"({verdict['inconsistent']}); pass sharing='shared' or "
            "sharing='local' to say how this directory is shared"
        )
    domains: dict[int, list[int]] = {}
    for ranks, number in zip(nodes, verdict["domain"], strict=True):
        domains.setdefault(number, []).extend(ranks)
    return sorted((sorted(d) for d in domains.values()), key=lambda d: d[0])
