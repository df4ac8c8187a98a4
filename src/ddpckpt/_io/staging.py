"""Host copies of the tensors a rank writes, for saves that persist in the background.

A :class:`StagingPool` owns one flat host buffer (pinned when the tensors live on a CUDA
device, so device-to-host copies run asynchronously at full speed) and carves each
save's tensors out of it. The buffer is allocated once and reused by every later save;
it grows only if a save needs more. Its size is this rank's share of the checkpoint:
about the replicated state's size divided by the number of ranks writing it, plus (on
rank 0) the buffers and other state that is stored as rank 0 holds it. Pinning memory is
slow (about 0.5 s per GB), so :meth:`StagingPool.reserve` can allocate the buffer on a
helper thread before the first save needs it.

:meth:`StagingPool.stage` copies CPU tensors at once; the copies it is told to defer, it
leaves to a helper thread. CUDA tensors are copied on side streams, ordered after the work
already queued on each device's current stream, and each device's current stream waits
for the copies of the tensors not deferred: the training thread does not block (no
``torch.cuda.synchronize()``), yet every kernel it queues afterwards sees the copies
done. The returned :class:`Fence` completes when every copy has landed; the background
writer waits on it. Deferring is safe only for tensors nothing writes to before the
fence is waited on: parameters and optimizer state, which change only in
``optimizer.step()``. Work queued on other streams than a device's current one is not
ordered before the copies.

That assumption is checked, not trusted (:mod:`ddpckpt._io.copy_checks`): a tensor
written in between is copied again at once, so the checkpoint is never torn, and reported
to the fence's ``on_written`` (the saver warns and stops deferring it).

CUDA copies are grouped by the source tensor's device, and each group has its own
stream and event on its own device. Waiting on the current device alone would let a
rank that never called ``torch.cuda.set_device`` write its buffer before the copies
from its own GPU landed.
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ddpckpt._format.tensorfile import tensor_nbytes
from ddpckpt._io.copy_checks import Deferred, differs, digest, written_since_staged
from ddpckpt._log import get_logger
from ddpckpt.errors import CheckpointWriteError

_log = get_logger(__name__)
_ALIGN = 64
_cuda: Any = torch.cuda  # the CUDA calls staging makes, replaceable in CPU-only tests

_Pair = tuple[torch.Tensor, torch.Tensor]  # (host destination, source)


class Fence:
    """Completion of deferred copies; :meth:`wait` blocks until they are done.

    Thread-safe: the training thread (``optimizer.step()``) and the background writer
    may wait at the same time; each waiter returns once the copies are done (and checked,
    see the module docstring) and raises their error, if any.
    """

    def __init__(self, events: Sequence[Any] = (), thread: threading.Thread | None = None) -> None:
        self._lock = threading.Lock()
        self._events = list(events)
        self._thread = thread
        self._error: BaseException | None = None

    def wait(self) -> None:
        error = self.outcome()
        if error is not None:
            raise error

    def outcome(self) -> BaseException | None:
        """Block until the copies are done; their error or ``None``, without raising it."""
        with self._lock:
            for event in self._events:
                event.synchronize()
            self._events = []
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        return self._error

    def done(self) -> bool:
        events, thread = self._events, self._thread  # one read each: a waiter may clear them
        if not all(event.query() for event in events):
            return False
        return thread is None or not thread.is_alive()


def staged_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of host buffer :meth:`StagingPool.stage` needs for ``tensors``."""
    return sum(_aligned(tensor_nbytes(t)) for t in tensors)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pinned_for(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors) and torch.cuda.is_available()


class StagingPool:
    """Reusable host memory for the tensors one rank writes (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._unpin: weakref.finalize | None = None
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        self._settle()
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        """Free the buffer; the next :meth:`stage` allocates it again."""
        self._settle()
        self._drop()

    def _drop(self) -> None:
        if self._unpin is not None:
            self._unpin()
        self._buffer = self._unpin = None

    def _allocate(self, total: int, pinned: bool) -> None:
        self._drop()  # the old buffer goes first
        self._buffer, self._unpin = _host_buffer(self, max(total, 1), pinned)

    def reserve(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Start allocating, on a helper thread, the buffer a save of ``tensors`` needs.

        Does nothing (returns False) if the buffer or an allocation under way is already
        large enough. The next :meth:`stage` waits for the allocation (a failed one is
        logged and retried there), so a save never holds more than one buffer.
        """
        total, pinned = staged_nbytes(tensors), _pinned_for(tensors)
        if self._reserving is not None or self._fits(total, pinned):
            return False

        def allocate() -> None:
            try:
                self._allocate(total, pinned)
            except BaseException as exc:  # reported by the next stage(), which retries
                self._reserve_error = exc

        self._reserving = threading.Thread(target=allocate, name="ddpckpt-reserve", daemon=True)
        self._reserving.start()
        return True

    def _settle(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        error, self._reserve_error = self._reserve_error, None
        if error is not None:
            _log.warning(
                "allocating the host buffer for asynchronous saves ahead of time failed (%s); "
                "the next save allocates it instead",
                error,
            )

    def _fits(self, total: int, pinned: bool) -> bool:
        buffer = self._buffer
        return buffer is not None and buffer.numel() >= total and buffer.is_pinned() == pinned

    def _reserve(self, total: int, pinned: bool) -> torch.Tensor:
        self._settle()
        if not self._fits(total, pinned):
            self._allocate(total, pinned)
        return self._buffer  # type: ignore[return-value]

    def stage(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        defer: Callable[[str], bool] | None = None,
        on_written: Callable[[list[str]], None] | None = None,
    ) -> tuple[list[tuple[str, torch.Tensor]], Fence]:
        """Copy ``items`` into the pool; the names for which ``defer`` is true are copied
        in the background. Returns the host copies (valid until the next ``stage``) and the
        fence to wait on before reading them: it covers the deferred copies and every CUDA
        copy. The previous save's copies must no longer be in use. ``on_written`` is called
        (once, by the fence's first waiter or the copy thread) with the names of deferred
        tensors written before their copy landed; they have been copied again.
        """
        tensors = [t for _, t in items]
        buffer = self._reserve(staged_nbytes(tensors), _pinned_for(tensors))
        staged, now, later = [], [], []
        offset = 0
        for name, tensor in items:
            nbytes = tensor_nbytes(tensor)
            if nbytes == 0:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
            else:
                host = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            offset += _aligned(nbytes)
            staged.append((name, host))
            source = tensor.detach()  # shares the tensor's version counter
            if nbytes and defer is not None and defer(name):
                later.append(Deferred(name, host, source, source._version))
            else:
                now.append((host, source))
        events = _start_copies(now)
        for device, event in events:  # later kernels there run after the copies
            _cuda.current_stream(device).wait_event(event)
        return staged, _copy_later(later, [event for _, event in events], on_written)


def _host_buffer(
    owner: object, nbytes: int, pinned: bool
) -> tuple[torch.Tensor, weakref.finalize | None]:
    """A host buffer of exactly ``nbytes`` and, if pinned, the finalizer that unpins it.

    Pinned memory is page-locked here (``cudaHostRegister``) rather than taken from
    torch's pinned allocator, which rounds every block up to a power of two (a 4.03 GB
    share would hold 4.29 GB). The pages are touched first, outside the driver call, which
    then holds the driver's lock (and delays the training thread's kernel launches) for
    less time. The finalizer unpins the memory when ``owner`` goes away, or when called.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned:
        return buffer, None
    buffer.fill_(0)
    error = int(_cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if error != 0:
        _log.warning(
            "page-locking %d bytes for asynchronous saves failed (CUDA error %d); using "
            "torch's pinned allocator, which rounds the size up to a power of two",
            nbytes,
            error,
        )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    return buffer, weakref.finalize(owner, _unregister, buffer)


def _unregister(buffer: torch.Tensor) -> None:
    error = int(_cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if error != 0:
        _log.warning("unpinning the asynchronous saves' host buffer failed (CUDA error %d)", error)


def by_device(pairs: Sequence[_Pair]) -> dict[torch.device, list[_Pair]]:
    """``pairs`` grouped by the source tensor's device, in order of first appearance."""
    groups: dict[torch.device, list[_Pair]] = {}
    for host, tensor in pairs:
        groups.setdefault(tensor.device, []).append((host, tensor))
    return groups


def _start_copies(
    pairs: Sequence[_Pair], digests: dict[int, torch.Tensor] | None = None
) -> list[tuple[torch.device, Any]]:
    """Copy every pair; returns each CUDA device with the event recorded after its copies.

    CPU sources are copied before this returns. Each CUDA device's copies are queued on a
    new stream of that device which first waits for the device's current stream, so they
    see the values as of now while the training thread goes on. With ``digests``, each
    contiguous CUDA source's :func:`~ddpckpt._io.copy_checks.digest` is queued right after
    its copy, on the same stream, by ``id()`` of its host copy.
    """
    events = []
    for device, group in by_device(pairs).items():
        if device.type != "cuda":
            _copy(group)
            continue
        with _cuda.device(device):
            stream = _cuda.Stream(device)
            stream.wait_stream(_cuda.current_stream(device))
            with _cuda.stream(stream):
                for host, tensor in group:
                    host.copy_(tensor, non_blocking=True)
                    tensor.record_stream(stream)  # not reused by the allocator meanwhile
                    if digests is not None and tensor.is_contiguous():
                        digests[id(host)] = digest(tensor)
                event = _cuda.Event()
                event.record(stream)
        events.append((device, event))
    return events


def _digests_now(deferred: Sequence[Deferred]) -> tuple[dict[int, torch.Tensor], list[Any]]:
    """The digest of each contiguous CUDA source in ``deferred`` as of now, by ``id()`` of
    its host copy, queued on its device's current stream (every kernel the training thread
    queues later runs after it, so it reads the value the save is of); and the events
    recorded after them."""
    digests: dict[int, torch.Tensor] = {}
    events = []
    for device, group in by_device([(d.host, d.source) for d in deferred]).items():
        if device.type != "cuda":
            continue
        with _cuda.device(device):
            for host, source in group:
                if source.is_contiguous():
                    digests[id(host)] = digest(source)
            event = _cuda.Event()
            event.record(_cuda.current_stream(device))
        events.append(event)
    return digests, events


def _copy(pairs: Sequence[_Pair]) -> None:
    """Copy pairs whose sources are not on a CUDA device (blocking)."""
    for host, tensor in pairs:
        host.copy_(tensor)


_RECOPIES = 3  # tries at a copy nothing writes meanwhile, before the save fails


def _recopy(d: Deferred) -> bool:
    """Copy ``d`` again, after every write queued on its device so far; True once a copy was
    taken that nothing wrote during (the version counter and the bytes agree after it)."""
    for _ in range(_RECOPIES):
        digests = None
        if d.source.is_cuda:
            _cuda.synchronize(d.source.device)  # the writes of every stream, the user's own too
        taken = replace(d, version=d.source._version)
        if d.source.is_cuda and d.source.is_contiguous():
            before = int(digest(d.source))
            d.host.copy_(d.source)
            digests = (before, int(digest(d.source)))
        else:
            d.host.copy_(d.source)
        if not differs(taken, digests):
            return True
    return False


def _checked(
    deferred: Sequence[Deferred], on_written: Callable[[list[str]], None] | None
) -> Callable[[], None]:
    """The check run once the copies have landed: copy again what was written meanwhile
    (the checkpoint then holds one value of it, never a mix, or the save fails), and
    report it."""

    def check() -> None:
        written = written_since_staged(deferred)
        if not written:
            return
        unsettled = [d.name for d in written if not _recopy(d)]
        if unsettled:
            raise CheckpointWriteError(
                errno.EBUSY,
                f"{', '.join(unsettled[:5])} kept changing while they were copied for "
                f"async_save='overlap' ({_RECOPIES} tries): this checkpoint is not written, "
                "and the previous one stays the newest. Write them only in optimizer.step() "
                "or before save(), or use async_save=True",
            )
        if on_written is not None:
            on_written([d.name for d in written])

    return check


def _copy_later(
    deferred: Sequence[Deferred],
    events: list[Any],
    on_written: Callable[[list[str]], None] | None = None,
) -> Fence:
    """The fence of ``events`` and of copying ``deferred`` in the background: a helper
    thread waits for the copies (CUDA: queued on side streams here; CPU: made there), then
    checks them (see :func:`~ddpckpt._io.copy_checks.written_since_staged`), so that a
    waiter on the training thread pays for neither."""
    if not deferred:
        return Fence(events=events)
    pairs = [(d.host, d.source) for d in deferred]
    if any(t.is_cuda for _, t in pairs):
        at_save, summed = _digests_now(deferred)
        after: dict[int, torch.Tensor] = {}
        landed = events + summed + [event for _, event in _start_copies(pairs, after)]
        deferred = [
            replace(d, digests=(at_save[id(d.host)], after[id(d.host)]))
            if id(d.host) in at_save
            else d
            for d in deferred
        ]

        def land() -> None:
            for event in landed:
                event.synchronize()

    else:
        events_before = list(events)

        def land() -> None:
            for event in events_before:
                event.synchronize()
            _copy(pairs)

    check = _checked(deferred, on_written)
    fence = Fence()

    def copy() -> None:
        try:
            land()
            check()
        except BaseException as exc:  # re-raised by Fence.wait on the training thread
            fence._error = exc

    fence._thread = threading.Thread(target=copy, name="ddpckpt-snapshot", daemon=True)
    fence._thread.start()
    return fence
