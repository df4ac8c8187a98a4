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

import os
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
from ddpckpt._format.manifest import MANIFEST_NAME, Manifest
from ddpckpt._format.rankparts import kept_ranks
from ddpckpt._format.tensorfile import byte_view
from ddpckpt._log import get_logger
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage import storage_for

_log = get_logger(__name__)
_CHUNK = 16 << 20


def repair_copies(comm: Comm, path: str, have: list[bool], sharing: str | None = None) -> None:
    """Give every storage domain lacking the checkpoint at ``path`` a verified copy.

    ``have[r]`` says whether rank ``r`` can read a good copy (all with the same id); a
    domain whose copy is another one (another id) gets it replaced. ``sharing`` as for
    :func:`~ddpckpt._coord.topology.storage_domains`.

    A copy holds the shared state and the own files of some ranks (every rank's, or with
    the fast tier's partners its domain's and its partners'): a domain lacking the
    checkpoint receives the copy of the first domain that has it and keeps its ranks'
    files (:func:`_sources`). Domains receiving the same copy form one fan-out; a
    :class:`CorruptCheckpointError` (on every rank) says whose files no copy keeps.
    """
    store = storage_for(path)
    domains = storage_domains(comm, store.parent(path), sharing)
    complete = [d for d in domains if all(have[r] for r in d)]
    if not complete:
        raise CorruptCheckpointError(
            f"{path}: no node holds the checkpoint with the own files of all its ranks "
            f"(ranks with it: {RankSet.of(r for r, h in enumerate(have) if h)})"
        )
    leads = [d for d in complete if d[0] == comm.rank]
    groups = comm.run_reduce(
        "sources",
        lambda: _kept_here(path) if leads else None,
        lambda kept: _sources(path, domains, have, kept),
    )
    for source, receivers in groups:
        ours = next(d for d in domains if d[0] == source)
        if comm.rank in ours or comm.rank in receivers:
            _fan_out(comm, path, ours, receivers)
            return
    comm.run_transfer("repair", lambda: None)  # nothing to send or receive here


def _kept_here(path: str) -> list[list[int]]:
    """The ranks whose own files this rank's copy of ``path`` keeps (as RankSet spans)."""
    return RankSet.of(kept_ranks(Manifest.from_json(_read_text(path), path))).to_json()


def _sources(
    path: str, domains: list[list[int]], have: list[bool], kept: list[Any]
) -> list[list[Any]]:
    """On rank 0: ``[source domain's first rank, [first ranks of the domains receiving its
    copy]]`` for each copy to send, from what each complete domain's first rank reported
    it keeps (``kept[r]``)."""
    copies = [(d[0], RankSet.from_json(kept[d[0]])) for d in domains if kept[d[0]] is not None]
    groups: dict[int, list[int]] = {}
    lost = []
    for domain in domains:
        if all(have[r] for r in domain):
            continue
        source = next((first for first, ranks in copies if all(r in ranks for r in domain)), None)
        if source is None:
            lost.append(domain)
        else:
            groups.setdefault(source, []).append(domain[0])
    if lost:
        ranks = ", ".join(
            str(a) if b == a + 1 else f"{a}-{b - 1}"
            for a, b in RankSet.of(r for d in lost for r in d).spans
        )
        raise CorruptCheckpointError(
            f"{path}: no node that holds this checkpoint keeps the own files (random streams, "
            f"data position) of ranks {ranks}, whose node(s) lack it: more "
            "neighbouring nodes were lost than the copies survive (FastTier(partners=...))"
        )
    return [[source, receivers] for source, receivers in sorted(groups.items())]


def _fan_out(comm: Comm, path: str, source: list[int], receivers: list[int]) -> None:
    """Copy the checkpoint of ``source``'s storage to the first ranks of ``receivers``:
    the manifest from the source's first rank, then each file from one of its ranks, each
    by doubling (:class:`FanOut`, all in one order)."""
    store = storage_for(path)
    line = tuple(receivers)
    place = line.index(comm.rank) + 1 if comm.rank in receivers else -1  # -1: no receiver
    tmp = store.commit.staging(store, path, comm.token)

    def transfer() -> None:
        text = _read_text(path) if comm.rank in source else b""  # its own copy's
        manifest = Manifest.from_json(text, path) if text else None
        had = False
        if comm.rank in receivers:
            had = store.commit.exists(store, path)
            store.commit.begin(store, path, tmp, overwrite=True)
        with ExitStack() as links:
            pairs: dict[int, Pair] = {}

            def link(peer: int) -> Pair:  # made when first needed, in the same order by both
                if peer not in pairs:
                    pairs[peer] = links.enter_context(comm.pair("repair", peer))
                return pairs[peer]

            for part in FanOut(source[0], line).part_at(0 if comm.rank == source[0] else place):
                if part.role == "receive":
                    text = link(part.peer).recv_bytes()
                    manifest = Manifest.from_json(text, path)
                else:
                    link(part.peer).send_bytes(text)
            if manifest is None:
                return
            owners = assign({name: f.size for name, f in manifest.files.items()}, source)
            for name in sorted(manifest.files):  # in one order, and round by round in each
                size, fan = manifest.files[name].size, FanOut(owners[name], line)
                for part in fan.part_at(0 if comm.rank == owners[name] else place):
                    if part.role == "receive":
                        _receive(
                            os.path.join(tmp, name), manifest, name, part.peer, link(part.peer)
                        )
                    else:  # the holder sends its own copy; a receiver passes on what it got
                        held = path if comm.rank == owners[name] else tmp
                        _send(os.path.join(held, name), size, link(part.peer))
        if comm.rank in receivers:
            assert manifest is not None
            store.write_new(os.path.join(tmp, MANIFEST_NAME), text)
            store.commit.publish(store, tmp, path, overwrite=True)
            _log.warning(
                "%s: this node %s; received the %d files (%d bytes) of rank %d's copy",
                path,
                "held the checkpoint without the own files of the ranks now on it (they ran "
                "on another node when it was saved)"
                if had
                else "had no copy of the checkpoint",
                len(manifest.files),
                manifest.nbytes,
                source[0],
            )

    try:
        comm.run_transfer("repair", transfer)
    except BaseException:
        if comm.rank in receivers:
            store.commit.abort(store, tmp, path)
        raise


def _read_text(path: str) -> bytes:
    text = read_small(os.path.join(path, MANIFEST_NAME), MAX_MANIFEST_BYTES, MANIFEST_NAME)
    Manifest.from_json(text, path)  # checked before it is sent (every rank checks it again)
    return text


def _send(path: str, size: int, link: Pair) -> None:
    """Send the file in chunks of exactly the sizes :func:`_receive` expects."""
    reader = open_checked(path, "data file")
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


def _receive(path: str, manifest: Manifest, name: str, sender: int, link: Pair) -> None:
    """Write the file ``name`` at ``path`` (inside the checkpoint: the manifest's names
    passed :func:`~ddpckpt._format.boundary.check_file_name` when it was parsed)."""
    entry = manifest.files[name]
    hasher = xxhash.xxh3_64()
    chunk = torch.empty(_CHUNK, dtype=torch.uint8)
    with storage_for(path).create(path) as out:
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
