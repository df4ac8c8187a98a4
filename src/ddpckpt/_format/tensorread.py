"""Reading tensor data files: :class:`TensorFile` memory-maps a file and hands out
zero-copy CPU views, or reads straight into a live CPU or CUDA tensor, each verified
against its digest before it is used."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from ddpckpt._format.boundary import open_checked
from ddpckpt._format.pinned_ring import (
    Ring,
    copy_on,
    copy_stream,
    device_bytes,
    passes_through,
    ring_for,
)
from ddpckpt._format.tensorfile import CHUNK, TensorEntry, byte_view, dtype_from_name, read_header
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage._location import Location

_READ_THREADS = 4  # parallel reads of one piece when loading onto a GPU
_read_pool: concurrent.futures.ThreadPoolExecutor | None = None
_read_pool_lock = threading.Lock()


def _readers() -> concurrent.futures.ThreadPoolExecutor:
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = concurrent.futures.ThreadPoolExecutor(
                _READ_THREADS, thread_name_prefix="ddpckpt-read"
            )
        return _read_pool


class TensorFile:
    """A memory-mapped data file of a checkpoint.

    ``size`` is the size the manifest records; a file of another size is reported as
    truncated or corrupt before any tensor is read, and one that is no regular file (a
    link, FIFO or device) as corrupt before it is read at all.
    """

    def __init__(self, location: Location, size: int) -> None:
        self.path = path = location.path
        try:
            reader = open_checked(location, "data file")
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{path}: missing, a data file the checkpoint lists"
            ) from None
        try:
            if reader.size != size:
                kind = IncompleteCheckpointError if reader.size < size else CorruptCheckpointError
                raise kind(f"{path}: file is {reader.size} bytes, the manifest records {size}")
        except BaseException:
            reader.close()
            raise
        # Kept open, so read_into reads the very object that was checked even if the path
        # is replaced meanwhile; closed with this object.
        self._reader = reader
        self._mapped: Any = None
        weakref.finalize(self, reader.close)

    @property
    def _map(self) -> Any:
        """The whole file as a private buffer, made on first use: a copy-on-write memory
        map on disk (nothing read until touched), a download on an object store."""
        if self._mapped is None:
            self._mapped = self._reader.map()
        return self._mapped

    def _read_range(self, offset: int, length: int) -> bytes:
        buffer = bytearray(max(0, min(length, self._reader.size - offset)))
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            count = self._reader.read_into(view[done:], offset + done)
            if count == 0:
                break
            done += count
        return bytes(buffer[:done])

    def check_header(self, entries: Sequence[TensorEntry]) -> None:
        """Raise :class:`CorruptCheckpointError` unless the file's own header (every byte
        before the tensor data) describes exactly ``entries``, as the manifest does."""
        header = read_header(
            self._read_range, self._reader.size, self.path, os.path.basename(self.path)
        )
        found = {e.key: (e.dtype, e.shape, e.begin, e.end) for e in header.entries}
        expected = {e.key: (e.dtype, tuple(e.shape), e.begin, e.end) for e in entries}
        if found != expected:
            raise CorruptCheckpointError(
                f"{self.path}: the file's safetensors header does not match the manifest; the "
                "file is damaged"
            )

    def view(self, entry: TensorEntry, *, verify: bool = True) -> torch.Tensor:
        """A CPU tensor viewing ``entry``'s bytes in the mapping (no copy).

        With ``verify`` the bytes are hashed first and a mismatch raises
        :class:`CorruptCheckpointError` naming the file and key.
        """
        dtype = dtype_from_name(entry.dtype, self.path)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        if self._map is None or entry.end > len(self._map):
            raise IncompleteCheckpointError(f"{self.path}: {entry.key} lies past the end of file")
        if verify:
            self._check_digest(
                entry, xxhash.xxh3_64(memoryview(self._map)[entry.begin : entry.end])
            )
        flat = torch.frombuffer(
            self._map, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin
        )
        return flat.view(dtype).reshape(entry.shape)

    def read_into(self, entry: TensorEntry, target: torch.Tensor) -> torch.Tensor:
        """Read ``entry``'s bytes straight into ``target`` and verify them; returns it.

        ``target`` must be a contiguous CPU or CUDA tensor of the entry's dtype and shape
        (see :func:`can_read_into`). One copy instead of mapping then copying; a checksum
        mismatch raises :class:`CorruptCheckpointError` after ``target`` was written. A
        CUDA target is filled through two pinned buffers: each piece is read with parallel
        reads and hashed while the previous one is copied to the device; work queued on
        the device's current stream afterwards sees the data.
        """
        if passes_through(target):
            with ring_for([target]) as ring:
                if ring is not None:  # always, for a CUDA tensor
                    self._check_digest(entry, self._read_through(ring, entry, target))
                    return target
        destination = byte_view(target)
        hasher = xxhash.xxh3_64()
        for start in range(0, len(destination), CHUNK):
            chunk = destination[start : start + CHUNK]
            self._pread(entry, chunk, entry.begin + start)
            hasher.update(chunk)  # while the chunk is still in the CPU's cache
        self._check_digest(entry, hasher)
        return target

    def _pread(self, entry: TensorEntry, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            count = self._reader.read_into(view[done:], offset + done)
            if count == 0:
                raise IncompleteCheckpointError(
                    f"{self.path}: {entry.key} lies past the end of file"
                )
            done += count

    def _read_through(self, ring: Ring, entry: TensorEntry, target: torch.Tensor) -> Any:
        """Fill the CUDA tensor ``target`` with ``entry`` through ``ring``; the hash."""
        destination = device_bytes(target)  # a view: target is contiguous
        hasher = xxhash.xxh3_64()
        pieces = [
            (s, min(ring.piece, entry.nbytes - s)) for s in range(0, entry.nbytes, ring.piece)
        ]
        landed: list[Any] = [None] * len(ring.buffers)
        reads: list[list[Any]] = [[] for _ in ring.buffers]
        stream = copy_stream(target.device)

        def start_read(index: int) -> None:
            start, length = pieces[index]
            slot = index % len(ring.buffers)
            if landed[slot] is not None:  # its previous piece must be on the device
                landed[slot].synchronize()
            view = byte_view(ring.buffers[slot])[:length]
            reads[slot] = [
                _readers().submit(self._pread, entry, view[a : a + CHUNK], entry.begin + start + a)
                for a in range(0, length, CHUNK)
            ]

        try:
            start_read(0)
            for index, (start, length) in enumerate(pieces):
                if index + 1 < len(pieces):
                    start_read(index + 1)
                slot = index % len(ring.buffers)
                for read in reads[slot]:
                    read.result()
                host = ring.buffers[slot][:length]
                hasher.update(byte_view(host))
                landed[slot] = copy_on(stream, destination[start : start + length], host)
        finally:  # nothing may still write into the buffers once they are handed back
            for pending in reads:
                for read in pending:
                    read.exception()
            for event in landed:
                if event is not None:
                    event.synchronize()
            if stream is not None:  # later work on the current stream sees the data
                torch.cuda.current_stream(target.device).wait_stream(stream)
        return hasher

    def read_chunks(self, entry: TensorEntry, first: int, last: int, chunk: int) -> torch.Tensor:
        """The bytes of chunks ``[first, last)`` of ``entry`` (``chunk`` bytes each, the last
        one short), read with ranged reads into a new CPU buffer and each checked against
        its chunk digest; a mismatch raises :class:`CorruptCheckpointError`."""
        begin, end = first * chunk, min(last * chunk, entry.nbytes)
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        view = byte_view(buffer)
        self._pread(entry, view, entry.begin + begin)
        for index in range(first, last):
            part = view[(index - first) * chunk : (index - first + 1) * chunk]
            if xxhash.xxh3_64(part).hexdigest() != entry.chunks[index]:
                raise CorruptCheckpointError(
                    f"{self.path}: checksum mismatch in chunk {index} of {entry.key!r} (bytes "
                    f"{entry.begin + index * chunk}-{entry.begin + index * chunk + len(part)}): "
                    "the file is corrupt; restore it or load an earlier checkpoint"
                )
        return buffer

    def chunk_problems(self, entry: TensorEntry, chunk: int) -> list[str]:
        """The chunks of ``entry`` whose bytes do not match their digests (``verify``)."""
        view = memoryview(self._map)[entry.begin : entry.end] if entry.nbytes else b""
        return [
            f"{self.path}: checksum mismatch in chunk {i} of {entry.key!r}"
            for i, digest in enumerate(entry.chunks)
            if xxhash.xxh3_64(view[i * chunk : (i + 1) * chunk]).hexdigest() != digest
        ]

    def _check_digest(self, entry: TensorEntry, hasher: Any) -> None:
        if hasher.hexdigest() != entry.digest:
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch in tensor {entry.key!r} (bytes "
                f"{entry.begin}-{entry.end}): the file is corrupt; restore it or load an "
                "earlier checkpoint"
            )

    def digest(self) -> str:
        """The xxh3-64 digest of the whole file."""
        hasher = xxhash.xxh3_64()
        if self._map is not None:
            view = memoryview(self._map)
            for start in range(0, len(view), CHUNK):
                hasher.update(view[start : start + CHUNK])
        return hasher.hexdigest()
