"""Host copies of the tensors a rank writes, for saves that persist in the background.

A :class:`StagingPool` owns one flat host buffer (pinned when the tensors live on a CUDA
device, so device-to-host copies run asynchronously at full speed) and carves each
save's tensors out of it. The buffer is allocated once and reused by every later save;
it grows only if a save needs more. Its size is this rank's share of the checkpoint:
about the replicated state's size divided by the number of ranks writing it, plus (on
rank 0) the buffers and other state that is stored as rank 0 holds it.

:meth:`StagingPool.stage` copies at once, or leaves the copies it is told to defer to a
side CUDA stream (GPU) or a helper thread (CPU) and returns a :class:`Fence` to wait on.
Deferring is safe only for tensors nothing writes to before the fence is waited on:
parameters and optimizer state, which change only in ``optimizer.step()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from .tensorfile import tensor_nbytes

__all__ = ["Fence", "StagingPool"]

_ALIGN = 64


class Fence:
    """Completion of deferred copies; :meth:`wait` blocks until they are done."""

    def __init__(
        self, event: torch.cuda.Event | None = None, thread: threading.Thread | None = None
    ) -> None:
        self._event = event
        self._thread = thread
        self._error: BaseException | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        if self._event is not None and not self._event.query():
            return False
        return self._thread is None or not self._thread.is_alive()


class StagingPool:
    """Reusable host memory for the tensors one rank writes (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        """Free the buffer; the next :meth:`stage` allocates it again."""
        self._buffer = None

    def _reserve(self, total: int, pinned: bool) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < total or buffer.is_pinned() != pinned:
            self._buffer = None  # free the old buffer before taking a new one
            buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
            self._buffer = buffer
        return buffer

    def stage(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        defer: Callable[[str], bool] | None = None,
    ) -> tuple[list[tuple[str, torch.Tensor]], Fence]:
        """Copy ``items`` into the pool; the names for which ``defer`` is true are copied
        in the background. Returns the host copies (valid until the next ``stage``) and the
        fence of the deferred copies. The previous save's copies must no longer be in use.
        """
        layout, total = [], 0
        for _, tensor in items:
            layout.append(total)
            total += -(-tensor_nbytes(tensor) // _ALIGN) * _ALIGN
        pinned = torch.cuda.is_available() and any(t.is_cuda for _, t in items)
        buffer = self._reserve(total, pinned)
        staged, now, later = [], [], []
        for (name, tensor), offset in zip(items, layout, strict=True):
            nbytes = tensor_nbytes(tensor)
            if nbytes == 0:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
            else:
                host = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            staged.append((name, host))
            (later if defer is not None and defer(name) else now).append((host, tensor.detach()))
        _copy(now)
        return staged, _copy_later(later)


def _copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for host, tensor in pairs:
        host.copy_(tensor, non_blocking=tensor.is_cuda)
    if any(t.is_cuda for _, t in pairs):
        torch.cuda.synchronize()


def _copy_later(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Fence:
    if not pairs:
        return Fence()
    if any(t.is_cuda for _, t in pairs):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # copy the values as of now
        with torch.cuda.stream(stream):
            for host, tensor in pairs:
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return Fence(event=event)
    fence = Fence()

    def copy() -> None:
        try:
            _copy(pairs)
        except BaseException as exc:  # re-raised by Fence.wait on the training thread
            fence._error = exc

    fence._thread = threading.Thread(target=copy, name="ddpckpt-snapshot", daemon=True)
    fence._thread.start()
    return fence
