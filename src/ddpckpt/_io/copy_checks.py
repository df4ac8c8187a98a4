"""Whether a copy that staging left to the background (:class:`Deferred`,
:mod:`ddpckpt._io.staging`) may not hold its source as of the save: the source was written
after it was staged.

Each deferred tensor's version counter is read when it is staged and again once its copy
has landed, and, for writes through ``.data`` (which leave the counter alone), a CPU
tensor's copy is compared with the tensor itself and a CUDA tensor's bytes are summed on
its GPU twice: when it is staged, on its device's current stream (so before any kernel the
training thread queues later), and right after its copy read them, on the copy's stream.
Sums that differ mean a write landed before or while the copy read the tensor: a copy that
may not hold the value as of the save, torn or whole, is caught, and nothing is summed on
the host (a host-side sum of a 4 GB state took seconds, which the next
``optimizer.step()`` waited for). Not caught: a write undone before the second sum, one
that only moves words around, one from a stream the current stream did not wait for, and
writes through ``.data`` to non-contiguous tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Deferred:
    """A copy left to the background and the source's version counter when staged; for a
    contiguous CUDA source, also two :func:`digest` of its bytes on its device: as of the
    save, and right after the copy read them."""

    name: str
    host: torch.Tensor
    source: torch.Tensor
    version: int
    digests: tuple[torch.Tensor, torch.Tensor] | None = None


def written_since_staged(deferred: Sequence[Deferred]) -> list[Deferred]:
    """The deferred copies whose source was written after it was staged. Call it once the
    copies (and digests) have landed. Written means: its version counter moved; or, for
    writes through ``.data``, which leave the counter alone, a CPU source no longer equals
    its copy, or a CUDA source's bytes as of the save differ from its bytes right after the
    copy read them (a write that landed before or while the copy read it: the copy may not
    hold the saved value). Both CUDA digests are sums on the GPU: nothing is summed on the
    host. Other devices: the counter only."""
    summed = [d for d in deferred if d.digests is not None]
    values = _fetch([digest for d in summed for digest in d.digests or ()])
    pairs = {id(d): (values[2 * i], values[2 * i + 1]) for i, d in enumerate(summed)}
    return [d for d in deferred if differs(d, pairs.get(id(d)))]


def _fetch(digests: list[torch.Tensor]) -> list[int]:
    """The values of device digests, one transfer per device."""
    values: dict[int, int] = {}
    by_device: dict[Any, list[int]] = {}
    for i, digest in enumerate(digests):
        by_device.setdefault(digest.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([digests[i] for i in indices]).tolist()
        values.update(zip(indices, stacked, strict=True))
    return [values[i] for i in range(len(digests))]


def differs(d: Deferred, digests: tuple[int, int] | None) -> bool:
    """Whether ``d``'s copy may not hold its source as staged (``digests``: the values of
    its CUDA digests, as of the save and after the copy)."""
    if d.source._version != d.version:
        return True
    if d.source.device.type == "cpu":
        return not torch.equal(_as_compared(d.host), _as_compared(d.source))
    return digests is not None and digests[0] != digests[1]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # NaNs compare as the bytes they are


def _as_compared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as 64-bit words where they divide so and are aligned (eight times
    fewer elements to compare than bytes), else as bytes."""
    flat = _as_bytes(tensor)
    if flat.numel() % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64)
    return flat


_DIGEST_CHUNK = 16 << 20  # bytes widened at a time when a tensor's bytes are summed one by one


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """The sum (wrapping) of a contiguous tensor's bytes on its device, as 64-bit or 32-bit
    words where they divide so and its data is aligned to them, else as single bytes: equal
    bytes give equal sums, and a GPU reads them at memory speed, far faster than the copy
    to the host. Each sum accumulates in its words' own type, so it allocates nothing the
    size of the tensor (a sum of 32-bit words into 64 bits widened a copy of all of them
    first); single bytes are widened a chunk at a time."""
    flat = _as_bytes(tensor)
    nbytes, at = flat.numel(), flat.data_ptr()
    if nbytes % 8 == 0 and at % 8 == 0:
        return flat.view(torch.int64).sum()
    if nbytes % 4 == 0 and at % 4 == 0:
        return flat.view(torch.int32).sum(dtype=torch.int32)
    parts = [
        flat[i : i + _DIGEST_CHUNK].to(torch.int32).sum(dtype=torch.int32)
        for i in range(0, nbytes, _DIGEST_CHUNK)
    ]
    return (
        torch.stack(parts).sum(dtype=torch.int32)
        if parts
        else flat.new_zeros((), dtype=torch.int32)
    )
