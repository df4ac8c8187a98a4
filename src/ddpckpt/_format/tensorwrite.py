"""Writing tensor data files: streamed tensor by tensor, hashed while written.

The files are written here rather than with ``safetensors.torch.save_file`` because that
function first builds the whole file in memory, and a checkpoint writer must not hold a
second copy of the training state: :func:`write_file` streams tensor by tensor and
computes an xxh3-64 digest of the whole file and of each tensor on the bytes as they are
written. CPU tensors are written from their own memory; CUDA tensors pass through the two
pinned buffers of a :class:`~ddpckpt._format.pinned_ring.Ring`, the copy of the next piece
running while the previous one is hashed and written.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Generator, Sequence
from typing import Any

import torch
import xxhash

from ddpckpt._format.pinned_ring import Ring, ring_for
from ddpckpt._format.tensorfile import (
    CHUNK,
    FileEntry,
    TensorEntry,
    byte_view,
    check_storable,
    dtype_name,
    encode_header,
    host_contiguous,
    layout,
    tensor_nbytes,
)
from ddpckpt.storage._location import Location

_HASH_AHEAD_BYTES = 1 << 20  # chunks from this size are hashed on a helper thread


def write_file(
    location: Location,
    items: Sequence[tuple[str, torch.Tensor]],
    *,
    writer: int,
    metadata: dict[str, str],
    progress: Callable[[int], None] | None = None,
    chunked: Collection[str] = (),
    produce: Callable[[str], torch.Tensor] | None = None,
) -> tuple[FileEntry, list[TensorEntry]]:
    """Write ``items`` to a new safetensors file at ``location`` and fsync it.

    The file must not exist (``O_EXCL``): a file is only ever written by one process.
    Returns the file's entry and each tensor's entry with absolute offsets and digests;
    those of the keys in ``chunked`` also with the digest of each :data:`CHUNK` bytes.
    ``progress`` is called with the size of every chunk of tensor data written. With
    ``produce``, an item may be a ``meta`` tensor (its dtype and shape): ``produce(key)``
    makes the real one when its turn comes, so a file of tensors that do not fit in
    memory together is written one tensor at a time.
    """
    for key, tensor in items:  # before creating the file: a refused save leaves nothing
        if produce is None or tensor.device.type != "meta":
            check_storable(key, tensor)
    with location.storage.create(location.path) as out:
        with ring_for([t for _, t in items]) as ring:
            result = _emit(
                location.name, items, writer, metadata, out.write, progress, ring,
                chunked, produce,
            )  # fmt: skip
        out.sync()
    return result


def serialize(
    name: str, items: Sequence[tuple[str, torch.Tensor]], *, writer: int, metadata: dict[str, str]
) -> tuple[bytes, FileEntry, list[TensorEntry]]:
    """The bytes :func:`write_file` would write to a file called ``name`` (for small files)."""
    buffer = bytearray()
    entry, entries = _emit(name, items, writer, metadata, buffer.extend)
    return bytes(buffer), entry, entries


def _emit(
    name: str,
    items: Sequence[tuple[str, torch.Tensor]],
    writer: int,
    metadata: dict[str, str],
    sink: Callable[[memoryview], object],
    progress: Callable[[int], None] | None = None,
    ring: Ring | None = None,
    chunked: Collection[str] = (),
    produce: Callable[[str], torch.Tensor] | None = None,
) -> tuple[FileEntry, list[TensorEntry]]:
    items = layout(items)
    for key, tensor in items:
        if produce is None or tensor.device.type != "meta":
            check_storable(key, tensor)
    file_hash = xxhash.xxh3_64()
    header = memoryview(encode_header(items, metadata))
    file_hash.update(header)
    sink(header)
    offset = len(header)
    entries: list[TensorEntry] = []
    # xxhash and write() both release the GIL: each chunk is hashed on a helper thread
    # while it is being written, which takes hashing off the save's critical path.
    blocks = _host_blocks(items, ring, produce)
    try:
        with _Hasher() as hasher:
            block = next(blocks, None)
            for index, (key, tensor) in enumerate(items):
                tensor_hash, length = xxhash.xxh3_64(), 0
                chunks = _ChunkDigests() if key in chunked else None
                hashes = (
                    (file_hash, tensor_hash) if chunks is None else (file_hash, tensor_hash, chunks)
                )
                while block is not None and block[0] == index:
                    data = block[1]
                    for start in range(0, len(data), CHUNK):
                        chunk = data[start : start + CHUNK]
                        if len(chunk) >= _HASH_AHEAD_BYTES:
                            hasher.start(hashes, chunk)
                            sink(chunk)
                            hasher.wait()
                        else:  # handing a small chunk over would cost more than hashing it here
                            _update(hashes, chunk)
                            sink(chunk)
                        if progress is not None:
                            progress(len(chunk))
                    length += len(data)
                    # Only now may the ring reuse this buffer; and nothing here holds it while
                    # the next tensor is made (an export holds one tensor at a time).
                    block = data = chunk = None  # type: ignore[assignment]
                    block = next(blocks, None)
                entries.append(
                    TensorEntry(
                        file=name,
                        key=key,
                        dtype=dtype_name(tensor.dtype, key),
                        shape=tuple(tensor.shape),
                        begin=offset,
                        end=offset + length,
                        digest=tensor_hash.hexdigest(),
                        chunks=() if chunks is None else chunks.finish(),
                    )
                )
                offset += length
    finally:
        blocks.close()  # on failure: wait for copies in flight before the buffers are reused
    return FileEntry(name=name, size=offset, digest=file_hash.hexdigest(), writer=writer), entries


def _host_blocks(
    items: Sequence[tuple[str, torch.Tensor]],
    ring: Ring | None,
    produce: Callable[[str], torch.Tensor] | None = None,
) -> Generator[tuple[int, memoryview], None, None]:
    """Each tensor's bytes in order, as ``(index in items, bytes)`` blocks on the host.

    CPU tensors come as one view of their own memory (or through ``ring`` when it is
    meant for them); device tensors through ``ring``; a meta tensor is made by
    ``produce`` first. A ring block is valid until the next block is asked for.
    """
    for index, (key, tensor) in enumerate(items):
        if produce is not None and tensor.device.type == "meta":
            tensor = produce(key)
            check_storable(key, tensor)
        if ring is not None and ring.takes(tensor):
            yield from ring.pass_through(index, items[index:])
            return
        host = host_contiguous(tensor)
        if tensor_nbytes(host):
            yield index, byte_view(host)
        del host  # freed (if produced) before the next one is made


def _update(hashes: Sequence[Any], chunk: memoryview) -> None:
    for digest in hashes:
        digest.update(chunk)


class _ChunkDigests:
    """The digest of each :data:`CHUNK` bytes of one tensor, whatever pieces they come in."""

    def __init__(self) -> None:
        self._digests: list[str] = []
        self._hash = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), CHUNK - self._filled)
            self._hash.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == CHUNK:
                self._digests.append(self._hash.hexdigest())
                self._hash, self._filled = xxhash.xxh3_64(), 0

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self._digests.append(self._hash.hexdigest())
        return tuple(self._digests)


class _Hasher:
    """A thread that hashes one chunk at a time while the caller writes it.

    A plain thread, not ``concurrent.futures``: executors refuse work once the interpreter
    starts exiting, and an asynchronous save must still finish then.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Sequence[Any], memoryview] | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ddpckpt-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            error = None
            try:
                _update(*task)
            except BaseException as exc:  # handed to the writing thread by wait()
                error = exc
            task = None  # holds the chunk: its memory is the writer's again
            self._done.put(error)

    def start(self, hashes: Sequence[Any], chunk: memoryview) -> None:
        self._tasks.put((hashes, chunk))

    def wait(self) -> None:
        error = self._done.get()
        if error is not None:
            raise error

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tasks.put(None)  # after any chunk in hand: the writer's memory outlives it
        self._thread.join()
