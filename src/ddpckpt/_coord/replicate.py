"""Copy a checkpoint to the nodes whose storage lacks it.

With node-local storage every node keeps its own copy; a node that was replaced (or whose
disk was wiped) has none. Before loading, :func:`repair_copies` gives the first rank of
every storage domain that lacks it the files of one node that has the checkpoint (each
file starts from one of that node's ranks), point to point over gloo groups of two (only
the ranks that send and receive are connected). Each file fans out by doubling
(:class:`~ddpckpt._coord.plan.FanOut`): a node that received it passes it on, so ``D``
replaced nodes are served in ``ceil(log2(D + 1))`` rounds, not ``D``, and no rank sends a
file more than once a round. Each received file is hashed while written and checked
against the manifest before it is passed on; the copy is committed atomically like any
checkpoint. The node then loads its own copy, and keeps it for the next restart.

Every rank calls :func:`repair_copies` (it is collective); ranks with nothing to send or
receive only take part in the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import xxhash

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.copies import Pair
from ddpckpt._coord.plan import FanOut, assign
from ddpckpt._coord.rankset import RankSet
from ddpckpt._coord.topology import storage_domains
from ddpckpt._format.boundary import MAX_MANIFEST_BYTES, open_checked, read_small
from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, manifest_at
from ddpckpt._format.rankparts import file_rank, kept_ranks
from ddpckpt._format.tensorfile import byte_view
from ddpckpt._log import get_logger
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import Location

_log = get_logger(__name__)
_CHUNK = 16 << 20


def repair_copies(
    comm: Comm,
    location: Location,
    have: list[bool],
    sharing: str | None = None,
    copies: list[bool] | None = None,
) -> None:
    """Give every storage domain lacking the checkpoint at ``location`` a verified copy.

    ``have[r]`` says whether rank ``r`` can read a good copy (all with the same id) that
    keeps the files it needs; ``copies[r]`` (by default ``have``) whether its domain holds
    that copy at all. A domain whose copy is another one (another id) gets it replaced.
    ``sharing`` as for :func:`~ddpckpt._coord.topology.storage_domains`.

    A copy holds the shared state and the own files of some ranks (every rank's, or with
    the fast tier's partners its domain's and its partners'): a domain lacking the
    checkpoint, or holding it without the files of the ranks now on it, receives the copy
    of the first domain holding it that keeps its ranks' files (:func:`_sources`; a rank
    the checkpoint did not have needs rank 0's). Domains receiving the same copy form one
    fan-out; fan-outs run one after another in one order, and a received copy replaces
    the old one only once every fan-out is done (a domain may serve one and receive
    another). A :class:`CorruptCheckpointError` (on every rank) says whose files no copy
    keeps.
    """
    copies = have if copies is None else copies
    store, path = location.storage, location.path
    domains = storage_domains(comm, location.parent, sharing)
    holding = [d for d in domains if all(copies[r] for r in d)]
    if not holding or any(any(copies[r] for r in d) and d not in holding for d in domains):
        raise CorruptCheckpointError(
            f"{path}: ranks that share storage disagree on whether the checkpoint exists "
            f"(ranks with it: {_ranks(r for r, h in enumerate(copies) if h)}; storage "
            f"domains: {len(domains)})"
        )
    leads = any(d[0] == comm.rank for d in holding)
    groups = comm.run_reduce(
        "sources",
        lambda: _kept_here(location) if leads else None,
        lambda kept: _sources(path, domains, have, kept),
    )
    receiving = next(
        (d for d in domains if d[0] == comm.rank and not all(have[r] for r in d)), None
    )
    tmp = Location(store, store.commit.staging(store, path, comm.token))
    received: list[tuple[Manifest, bytes]] = []

    def transfer() -> None:
        if receiving is not None:
            store.commit.begin(store, path, tmp.path, overwrite=True)
        with ExitStack() as links:
            pairs: dict[int, Pair] = {}

            def link(peer: int) -> Pair:  # made when first needed, in the same order by both
                if peer not in pairs:
                    pairs[peer] = links.enter_context(comm.pair("repair", peer))
                return pairs[peer]

            for source, receivers in groups:  # one after another, in one order on every rank
                ours = next(d for d in domains if d[0] == source)
                if comm.rank in ours or comm.rank in receivers:
                    got = _fan_out(comm, location, tmp, ours, receivers, link)
                    received.extend([got] if got is not None else [])

    def publish() -> None:
        if receiving is None:
            return
        manifest, text = received[0]
        store.write_new(tmp.join(MANIFEST_NAME).path, text)
        store.commit.publish(store, tmp.path, path, overwrite=True)
        held = all(copies[r] for r in receiving)
        _log.warning(
            "%s: this node %s; received the %d files (%d bytes) of another node's copy",
            path,
            "held the checkpoint without the own files of ranks "
            f"{_ranks(receiving)}, which the restart placed on it"
            if held
            else "had no copy of the checkpoint",
            len(manifest.files),
            manifest.nbytes,
        )

    try:
        comm.run_transfer("repair", transfer)
        comm.run("repair publish", publish)  # no copy is replaced while another is sent
    except BaseException:
        if receiving is not None:
            store.commit.abort(store, tmp.path, path)
        raise


def _ranks(ranks: Any) -> str:
    """Ranks for people: ``0-3, 6``."""
    return (
        ", ".join(str(a) if b == a + 1 else f"{a}-{b - 1}" for a, b in RankSet.of(ranks).spans)
        or "none"
    )


def _kept_here(location: Location) -> dict[str, Any]:
    """The ranks whose own files this rank's copy of ``location`` keeps (as RankSet spans),
    and the number of ranks that saved it."""
    manifest = _own_copy(location)[1]  # kept_ranks may read its file tables
    return {"kept": RankSet.of(kept_ranks(manifest)).to_json(), "world": manifest.world_size}


def _sources(
    path: str, domains: list[list[int]], have: list[bool], kept: list[Any]
) -> list[list[Any]]:
    """On rank 0: ``[source domain's first rank, [first ranks of the domains receiving its
    copy]]`` for each copy to send, from what each holding domain's first rank reported it
    keeps (``kept[r]``): a domain lacking what its ranks need receives the copy of the
    first domain that keeps it (rank 0's file for a rank beyond the saved world)."""
    reported = [(d[0], kept[d[0]]) for d in domains if kept[d[0]] is not None]
    holders = [(first, RankSet.from_json(found["kept"])) for first, found in reported]
    world = reported[0][1]["world"] if reported else 0
    groups: dict[int, list[int]] = {}
    lost: list[int] = []
    for domain in domains:
        if all(have[r] for r in domain):
            continue
        needed = {file_rank(r, world) for r in domain}
        source = next(
            (f for f, ranks in holders if f != domain[0] and all(r in ranks for r in needed)),
            None,
        )
        if source is None:
            lost.extend(needed)
        else:
            groups.setdefault(source, []).append(domain[0])
    if lost:
        raise CorruptCheckpointError(
            f"{path}: no node that holds this checkpoint keeps the own files (random streams, "
            f"data position) of ranks {_ranks(lost)}: the nodes that kept them lost their "
            "copies (the fast tier keeps a node's files on FastTier(partners=...) other nodes)"
        )
    return [[source, receivers] for source, receivers in sorted(groups.items())]


def _fan_out(
    comm: Comm,
    location: Location,
    tmp: Location,
    source: list[int],
    receivers: list[int],
    link: Callable[[int], Pair],
) -> tuple[Manifest, bytes] | None:
    """Copy the checkpoint of ``source``'s storage into ``tmp`` of the first ranks of
    ``receivers``: the manifest from the source's first rank, then each file from one of
    its ranks, each by doubling (:class:`FanOut`, all in one order). A receiver returns the
    manifest it received, and its text."""
    line = tuple(receivers)
    place = line.index(comm.rank) + 1 if comm.rank in receivers else -1  # -1: no receiver
    text = _own_copy(location)[0] if comm.rank in source else b""  # its own copy's
    for part in FanOut(source[0], line).part_at(0 if comm.rank == source[0] else place):
        if part.role == "receive":
            text = link(part.peer).recv_bytes()
        else:
            link(part.peer).send_bytes(text)
    if not text:
        return None
    manifest = manifest_at(text, location)  # a source reads the tables of its own copy
    files = manifest.files
    # The files the manifest lists itself first, among them its file tables (format 7),
    # which list the others: a receiver reads them from what it has just received.
    listed = {name: f.size for name, f in files.inline.items()}
    for batch in (listed, None):
        if batch is None:
            if comm.rank in receivers:
                files.bind(tmp)
            batch = {name: f.size for name, f in files.items() if name not in listed}
        owners = assign(batch, source)
        for name in sorted(batch):  # in one order, and round by round in each
            fan = FanOut(owners[name], line)
            for part in fan.part_at(0 if comm.rank == owners[name] else place):
                if part.role == "receive":
                    _receive(tmp.join(name), manifest, name, part.peer, link(part.peer))
                else:  # the holder sends its own copy; a receiver passes on what it got
                    held = location if comm.rank == owners[name] else tmp
                    _send(held.join(name), batch[name], link(part.peer))
    return (manifest, text) if comm.rank in receivers else None


def _own_copy(location: Location) -> tuple[bytes, Manifest]:
    """The manifest of this rank's copy at ``location``: its text (checked before it is
    sent; every rank checks it again) and the manifest, bound to the copy."""
    text = read_small(location.join(MANIFEST_NAME), MAX_MANIFEST_BYTES, MANIFEST_NAME)
    return text, manifest_at(text, location)


def _send(location: Location, size: int, link: Pair) -> None:
    """Send the file in chunks of exactly the sizes :func:`_receive` expects."""
    path = location.path
    reader = open_checked(location, "data file")
    try:
        if reader.size != size:
            raise CorruptCheckpointError(f"{path}: size differs from the manifest's {size} bytes")
        chunk = torch.empty(_CHUNK, dtype=torch.uint8)
        sent = 0
        while sent < size:
            n = min(size - sent, _CHUNK)
            view, filled = byte_view(chunk)[:n], 0
            while filled < n:  # short reads happen on network file systems
                got = reader.read_into(view[filled:], sent + filled)
                if not got:
                    raise CorruptCheckpointError(f"{path}: ended early while being sent")
                filled += got
            link.finish([link.send(chunk[:n])])
            sent += n
    finally:
        reader.close()


def _receive(location: Location, manifest: Manifest, name: str, sender: int, link: Pair) -> None:
    """Write the file ``name`` at ``location`` (inside the checkpoint: the manifest's names
    passed :func:`~ddpckpt._format.boundary.check_file_name` when it was parsed)."""
    entry = manifest.files[name]
    hasher = xxhash.xxh3_64()
    chunk = torch.empty(_CHUNK, dtype=torch.uint8)
    path = location.path
    with location.storage.create(path) as out:
        remaining = entry.size
        while remaining:
            n = min(remaining, _CHUNK)
            link.finish([link.recv(chunk[:n])])
            data = byte_view(chunk)[:n]
            hasher.update(data)
            out.write(data)
            remaining -= n
        out.sync()
    if hasher.hexdigest() != entry.digest:
        raise CorruptCheckpointError(
            f"{path}: received copy of {name} does not match its checksum (sent by rank {sender})"
        )
