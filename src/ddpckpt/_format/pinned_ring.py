"""Pinned host buffers that GPU tensors pass through on their way to and from a file.

A :class:`Ring` holds two buffers of ``_PIECE`` bytes: while one piece is hashed and
written (or read and hashed), the other is being copied between the device and the host
on a side stream, so the copy engine and the disk work at once and a save or load holds at
most two pieces of extra host memory. Rings are kept for reuse (:func:`ring_for`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ddpckpt._format.tensorfile import byte_view, host_contiguous

_PIECE = 32 << 20  # bytes of each of the two pinned buffers a save from a GPU passes through


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor on its own device."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class Ring:
    """Two host buffers that tensors pass through on their way to the file.

    While the caller hashes and writes one buffer, the other is being filled with the
    next piece (an asynchronous device-to-host copy on a side stream of the tensor's
    device, ordered after the work queued on its current stream). Rings are kept for
    reuse (:func:`ring_for`); a save that fails midway waits for its copies in flight,
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
                flat = host_contiguous(tensor).reshape(-1).view(torch.uint8)
            else:
                flat = device_bytes(tensor)
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
                streams[source.device] = copy_stream(source.device)
            stream = streams[source.device]
        event = copy_on(stream, target, source)
        in_flight.append((index, slot, length, event))


def copy_stream(device: torch.device) -> Any:
    """A side stream of CUDA ``device`` that starts after its current stream (else None)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def copy_on(stream: Any, target: torch.Tensor, source: torch.Tensor) -> Any:
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


_rings: list[Ring] = []
_rings_lock = threading.Lock()
_RING_FOR_CPU = False  # tests route CPU tensors through the ring too


def passes_through(tensor: torch.Tensor) -> bool:
    """Whether reads into (and writes from) ``tensor`` pass through a ring: a CUDA tensor
    (a CPU one too where tests ask for it)."""
    return tensor.is_cuda or _RING_FOR_CPU


@contextlib.contextmanager
def ring_for(tensors: Sequence[torch.Tensor]) -> Iterator[Ring | None]:
    """A ring if any of ``tensors`` must pass through one (kept for the next save)."""
    pinned = any(t.is_cuda for t in tensors)
    if not (pinned or _RING_FOR_CPU):
        yield None
        return
    with _rings_lock:
        found = next((r for r in _rings if r.pinned == pinned), None)
        if found is not None:
            _rings.remove(found)
    ring = found or Ring(pinned, for_cpu=_RING_FOR_CPU)
    ring.for_cpu = _RING_FOR_CPU
    try:
        yield ring
    finally:
        with _rings_lock:
            _rings.append(ring)
