"""Bulk bytes between ranks, point to point over a gloo group of ddpckpt's own.

Rank files and tensors that every storage domain's copy needs (node-local storage) never
travel through the key-value store: each rank sends its bundle straight to the first rank
of every other domain (:func:`send_to_leaders`), on a gloo group made once for ddpckpt
(:func:`tensor_group`), so the store carries only small messages whatever the model's size.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["send_to_leaders", "tensor_group"]

_tensor_groups: dict[int, Any] = {}


def tensor_group(device: torch.device, timeout: float) -> Any:
    """The process group to move tensors on ``device`` with; every rank must ask together.

    A gloo group made once per default group (its operations time out after ``timeout``
    seconds), or ``None`` for device tensors under a non-gloo default group (NCCL), which
    carries them itself.
    """
    if device.type != "cpu" and dist.get_backend() != "gloo":
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _tensor_groups:
        _tensor_groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return _tensor_groups[key]


def send_to_leaders(comm: Any, domains: list[list[int]], bundle: bytes) -> dict[int, bytes]:
    """Send this rank's ``bundle`` to the first rank of every other storage domain; every
    rank calls it (inside a ``comm.run``, which reports a failure on every rank).

    Returns what this rank received: every rank's bundle outside its domain if it leads
    one, else nothing. Sizes go first, then the bytes, all non-blocking, so no order of
    sends and receives can deadlock.
    """
    group = tensor_group(torch.device("cpu"), comm.timeout)
    domain = next(d for d in domains if comm.rank in d)
    leaders = [d[0] for d in domains if d is not domain]
    senders = [r for d in domains if d is not domain for r in d] if domain[0] == comm.rank else []
    size = torch.tensor([len(bundle)], dtype=torch.int64)
    sizes = {r: torch.zeros(1, dtype=torch.int64) for r in senders}
    _exchange(group, [(size, to) for to in leaders], [(sizes[r], r) for r in senders])
    data = torch.frombuffer(bytearray(bundle), dtype=torch.uint8)
    buffers = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in senders}
    _exchange(group, [(data, to) for to in leaders], [(buffers[r], r) for r in senders])
    return {r: buffers[r].numpy().tobytes() for r in senders}


def _exchange(
    group: Any, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]
) -> None:
    """Post every send and receive at once (global ranks), then wait for all of them."""
    works = [dist.isend(t, dst=to, group=group) for t, to in sends]
    works += [dist.irecv(t, src=sender, group=group) for t, sender in receives]
    for work in works:
        work.wait()
