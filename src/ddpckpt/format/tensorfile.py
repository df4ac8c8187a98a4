"""Tensor data files: the safetensors format, written as a stream and hashed while written.

The files are plain safetensors (an 8-byte little-endian header length, a JSON header with
each tensor's dtype, shape and byte range, then the raw bytes), so any safetensors reader
opens them. They are written here rather than with ``safetensors.torch.save_file``
because that function first builds the whole file in memory, and a checkpoint writer must
not hold a second copy of the training state: :func:`write_file` streams tensor by tensor
and computes an xxh3-64 digest of the whole file and of each tensor on the bytes as they
are written. CPU tensors are written from their own memory. CUDA tensors pass through a
:class:`_Ring` of two pinned buffers: the device-to-host copy of the next piece runs
while the previous piece is hashed and written, so the copy engine and the disk work at
once and a save holds at most two pieces (``_PIECE`` bytes each) of extra host memory.

Tensors are laid out widest element first, so every tensor starts at an offset aligned to
its element size (the header is padded to 8 bytes) and memory-mapped views are aligned.

:class:`TensorFile` memory-maps a file and hands out zero-copy CPU views, each verified
against its digest before it is returned.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import json
import os
import queue
import struct
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedValueError
from ddpckpt.storage import storage_for

__all__ = [
    "FileEntry",
    "TensorEntry",
    "TensorFile",
    "byte_view",
    "can_read_into",
    "deserialize",
    "dtype_from_name",
    "dtype_name",
    "serialize",
    "tensor_nbytes",
    "write_file",
]

_CHUNK = 8 << 20
_HASH_AHEAD_BYTES = 1 << 20  # chunks from this size are hashed on a helper thread
_PIECE = 32 << 20  # bytes of each of the two pinned buffers a save from a GPU passes through

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in (
    ("uint64", "U64"),
    ("uint32", "U32"),
    ("uint16", "U16"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ``key`` names the tensor in the error if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _DTYPE_NAMES))
        raise UnsupportedValueError(
            f"{key}: dtype {dtype} cannot be stored in a safetensors file "
            f"(supported: {supported}); convert the tensor before saving"
        ) from None


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: unknown tensor dtype {name!r}") from None


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file``, its key there, and its absolute byte range."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    digest: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileEntry:
    """A whole data file: its size, xxh3-64 digest, and the rank that wrote it."""

    name: str
    size: int
    digest: str
    writer: int


def check_storable(key: str, tensor: torch.Tensor) -> None:
    """Raise :class:`UnsupportedValueError` naming ``key`` if ``tensor`` cannot be written."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise UnsupportedValueError(
            f"{key}: tensor subclass {type(tensor).__qualname__} cannot be stored; "
            "convert it to a plain tensor (e.g. DTensor.full_tensor()) before saving"
        )
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(
            f"{key}: {tensor.layout} tensors cannot be stored; call .to_dense() before saving"
        )
    if tensor.is_quantized or tensor.device.type == "meta":
        what = "quantized" if tensor.is_quantized else "meta"
        raise UnsupportedValueError(f"{key}: {what} tensors hold no storable data")
    dtype_name(tensor.dtype, key)


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (valid while ``tensor`` lives)."""
    nbytes = tensor_nbytes(tensor)
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _header(items: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, tensor in items:
        nbytes = tensor_nbytes(tensor)
        header[key] = {
            "dtype": dtype_name(tensor.dtype, key),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def layout(items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The order tensors are written in: widest element first, otherwise as given."""
    return sorted(items, key=lambda item: -item[1].element_size())


def write_file(
    path: str,
    items: Sequence[tuple[str, torch.Tensor]],
    *,
    writer: int,
    metadata: dict[str, str],
    progress: Callable[[int], None] | None = None,
) -> tuple[FileEntry, list[TensorEntry]]:
    """Write ``items`` to a new safetensors file at ``path`` and fsync it.

    The file must not exist (``O_EXCL``): a file is only ever written by one process.
    Returns the file's entry and each tensor's entry with absolute offsets and digests.
    ``progress`` is called with the size of every chunk of tensor data written.
    """
    for key, tensor in items:  # before creating the file: a refused save leaves nothing
        check_storable(key, tensor)
    with storage_for(path).create(path) as out:
        with _ring_for([t for _, t in items]) as ring:
            result = _emit(
                os.path.basename(path), items, writer, metadata, out.write, progress, ring
            )
        out.sync()
    return result


def serialize(
    name: str, items: Sequence[tuple[str, torch.Tensor]], *, writer: int, metadata: dict[str, str]
) -> tuple[bytes, FileEntry, list[TensorEntry]]:
    """The bytes :func:`write_file` would write to a file called ``name`` (for small files)."""
    buffer = bytearray()
    entry, entries = _emit(name, items, writer, metadata, buffer.extend)
    return bytes(buffer), entry, entries


def deserialize(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a file :func:`serialize` produced, as private CPU tensors."""
    (length,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + length])
    start = 8 + length
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = dtype_from_name(info["dtype"], where)
        raw = bytearray(blob[start + begin : start + end])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        tensors[key] = flat.view(dtype).reshape(info["shape"])
    return tensors


def _emit(
    name: str,
    items: Sequence[tuple[str, torch.Tensor]],
    writer: int,
    metadata: dict[str, str],
    sink: Callable[[memoryview], object],
    progress: Callable[[int], None] | None = None,
    ring: _Ring | None = None,
) -> tuple[FileEntry, list[TensorEntry]]:
    items = layout(items)
    for key, tensor in items:
        check_storable(key, tensor)
    file_hash = xxhash.xxh3_64()
    header = memoryview(_header(items, metadata))
    file_hash.update(header)
    sink(header)
    offset = len(header)
    entries: list[TensorEntry] = []
    # xxhash and write() both release the GIL: each chunk is hashed on a helper thread
    # while it is being written, which takes hashing off the save's critical path.
    blocks = _host_blocks(items, ring)
    try:
        with _Hasher() as hasher:
            block = next(blocks, None)
            for index, (key, tensor) in enumerate(items):
                tensor_hash, length = xxhash.xxh3_64(), 0
                while block is not None and block[0] == index:
                    data = block[1]
                    for start in range(0, len(data), _CHUNK):
                        chunk = data[start : start + _CHUNK]
                        if len(chunk) >= _HASH_AHEAD_BYTES:
                            hasher.start((file_hash, tensor_hash), chunk)
                            sink(chunk)
                            hasher.wait()
                        else:  # handing a small chunk over would cost more than hashing it here
                            _update((file_hash, tensor_hash), chunk)
                            sink(chunk)
                        if progress is not None:
                            progress(len(chunk))
                    length += len(data)
                    block = next(blocks, None)  # only now may the ring reuse this buffer
                entries.append(
                    TensorEntry(
                        file=name,
                        key=key,
                        dtype=dtype_name(tensor.dtype, key),
                        shape=tuple(tensor.shape),
                        begin=offset,
                        end=offset + length,
                        digest=tensor_hash.hexdigest(),
                    )
                )
                offset += length
    finally:
        blocks.close()  # on failure: wait for copies in flight before the buffers are reused
    return FileEntry(name=name, size=offset, digest=file_hash.hexdigest(), writer=writer), entries


def _host_blocks(
    items: Sequence[tuple[str, torch.Tensor]], ring: _Ring | None
) -> Iterator[tuple[int, memoryview]]:
    """Each tensor's bytes in order, as ``(index in items, bytes)`` blocks on the host.

    CPU tensors come as one view of their own memory (or through ``ring`` when it is
    meant for them); device tensors through ``ring``. A ring block is valid until the
    next block is asked for.
    """
    for index, (_, tensor) in enumerate(items):
        if ring is not None and ring.takes(tensor):
            yield from ring.pass_through(index, items[index:])
            return
        host = _host_contiguous(tensor)
        if tensor_nbytes(host):
            yield index, byte_view(host)


def _device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor on its own device."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _Ring:
    """Two host buffers that tensors pass through on their way to the file.

    While the caller hashes and writes one buffer, the other is being filled with the
    next piece (an asynchronous device-to-host copy on a side stream of the tensor's
    device, ordered after the work queued on its current stream). Rings are kept for
    reuse (:func:`_ring_for`); a save that fails midway waits for its copies in flight,
    so the buffers are reusable at once.
    """

    def __init__(self, pinned: bool, for_cpu: bool = False) -> None:
        self.pinned, self.for_cpu, self.piece = pinned, for_cpu, _PIECE
        self.buffers = [torch.empty(_PIECE, dtype=torch.uint8, pin_memory=pinned) for _ in "ab"]

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda or (self.for_cpu and tensor.device.type == "cpu")

    def pass_through(
        self, first: int, items: Sequence[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[int, memoryview]]:
        """Blocks of every tensor of ``items`` (indexed from ``first``), double-buffered."""
        streams: dict[torch.device, Any] = {}
        in_flight: collections.deque[tuple[int, int, int, Any]] = collections.deque()
        pieces = self._pieces(first, items)
        try:
            for slot in range(len(self.buffers)):
                self._issue(next(pieces, None), slot, streams, in_flight)
            while in_flight:
                index, slot, length, event = in_flight.popleft()
                if event is not None:
                    event.synchronize()
                yield index, byte_view(self.buffers[slot])[:length]
                self._issue(next(pieces, None), slot, streams, in_flight)
        finally:
            for *_, event in in_flight:
                if event is not None:
                    event.synchronize()

    def _pieces(
        self, first: int, items: Sequence[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        for offset, (_, tensor) in enumerate(items):
            if not self.takes(tensor):
                flat = _host_contiguous(tensor).reshape(-1).view(torch.uint8)
            else:
                flat = _device_bytes(tensor)
            for start in range(0, flat.numel(), self.piece):
                yield first + offset, flat[start : start + self.piece]

    def _issue(
        self,
        piece: tuple[int, torch.Tensor] | None,
        slot: int,
        streams: dict[torch.device, Any],
        in_flight: collections.deque[tuple[int, int, int, Any]],
    ) -> None:
        if piece is None:
            return
        index, source = piece
        length = source.numel()
        target = self.buffers[slot][:length]
        stream = None
        if source.is_cuda:
            if source.device not in streams:
                streams[source.device] = _copy_stream(source.device)
            stream = streams[source.device]
        event = _copy_on(stream, target, source)
        in_flight.append((index, slot, length, event))


def _copy_stream(device: torch.device) -> Any:
    """A side stream of CUDA ``device`` that starts after its current stream (else None)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _copy_on(stream: Any, target: torch.Tensor, source: torch.Tensor) -> Any:
    """Copy ``source`` into ``target`` on ``stream`` (at once without one); its event."""
    if stream is None:
        target.copy_(source)
        return None
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        target.copy_(source, non_blocking=True)
        if source.is_cuda:  # a temporary: the allocator must not reuse it meanwhile
            source.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
    return event


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


_rings: list[_Ring] = []
_rings_lock = threading.Lock()
_RING_FOR_CPU = False  # tests route CPU tensors through the ring too


@contextlib.contextmanager
def _ring_for(tensors: Sequence[torch.Tensor]) -> Iterator[_Ring | None]:
    """A ring if any of ``tensors`` must pass through one (kept for the next save)."""
    pinned = any(t.is_cuda for t in tensors)
    if not (pinned or _RING_FOR_CPU):
        yield None
        return
    with _rings_lock:
        found = next((r for r in _rings if r.pinned == pinned), None)
        if found is not None:
            _rings.remove(found)
    ring = found or _Ring(pinned, for_cpu=_RING_FOR_CPU)
    ring.for_cpu = _RING_FOR_CPU
    try:
        yield ring
    finally:
        with _rings_lock:
            _rings.append(ring)


def _update(hashes: Sequence[Any], chunk: memoryview) -> None:
    for digest in hashes:
        digest.update(chunk)


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
            try:
                _update(*task)
            except BaseException as exc:  # handed to the writing thread by wait()
                self._done.put(exc)
            else:
                self._done.put(None)

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


def can_read_into(target: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether :meth:`TensorFile.read_into` can fill ``target`` with ``entry``."""
    return (
        entry.nbytes > 0
        and (target.device.type == "cpu" or target.is_cuda)
        and target.is_contiguous()
        and _DTYPES_BY_NAME.get(entry.dtype) == target.dtype
        and tuple(target.shape) == tuple(entry.shape)
    )


class TensorFile:
    """A memory-mapped data file of a checkpoint.

    ``size`` is the size the manifest records; a file of another size is reported as
    truncated or corrupt before any tensor is read.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        try:
            reader = storage_for(path).open(path)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{path}: data file listed in the manifest is missing"
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
        try:
            (length,) = struct.unpack_from("<Q", self._read_range(0, 8))
            header = json.loads(self._read_range(8, length))
        except (struct.error, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{self.path}: damaged safetensors header ({exc})"
            ) from exc
        start = 8 + length
        header.pop("__metadata__", None)
        expected = {
            e.key: {
                "dtype": e.dtype,
                "shape": list(e.shape),
                "data_offsets": [e.begin - start, e.end - start],
            }
            for e in entries
        }
        if header != expected:
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
        if target.is_cuda or _RING_FOR_CPU:
            with _ring_for([target]) as ring:
                if ring is not None:  # always, for a CUDA tensor
                    self._check_digest(entry, self._read_through(ring, entry, target))
                    return target
        destination = byte_view(target)
        hasher = xxhash.xxh3_64()
        for start in range(0, len(destination), _CHUNK):
            chunk = destination[start : start + _CHUNK]
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

    def _read_through(self, ring: _Ring, entry: TensorEntry, target: torch.Tensor) -> Any:
        """Fill the CUDA tensor ``target`` with ``entry`` through ``ring``; the hash."""
        destination = _device_bytes(target)  # a view: target is contiguous
        hasher = xxhash.xxh3_64()
        pieces = [
            (s, min(ring.piece, entry.nbytes - s)) for s in range(0, entry.nbytes, ring.piece)
        ]
        landed: list[Any] = [None] * len(ring.buffers)
        reads: list[list[Any]] = [[] for _ in ring.buffers]
        stream = _copy_stream(target.device)

        def start_read(index: int) -> None:
            start, length = pieces[index]
            slot = index % len(ring.buffers)
            if landed[slot] is not None:  # its previous piece must be on the device
                landed[slot].synchronize()
            view = byte_view(ring.buffers[slot])[:length]
            reads[slot] = [
                _readers().submit(self._pread, entry, view[a : a + _CHUNK], entry.begin + start + a)
                for a in range(0, length, _CHUNK)
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
                landed[slot] = _copy_on(stream, destination[start : start + length], host)
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
            for start in range(0, len(view), _CHUNK):
                hasher.update(view[start : start + _CHUNK])
        return hasher.hexdigest()
