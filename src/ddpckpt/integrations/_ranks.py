"""Per-rank state for framework checkpoints written by one process.

Lightning writes its checkpoint from global rank 0 only, but each rank has random streams
(and a loader position) of its own. Each rank saves them beside the checkpoint
(:mod:`ddpckpt.integrations._rank_files`); where no save path is known (a checkpoint dict
taken outside a save), :func:`gather` brings every rank's state to rank 0 through ddpckpt's
collective wrapper (the default process group's store, never the training group), so rank
0's checkpoint holds all of them, and at a resume each rank takes its own back
(:func:`own_streams`, :func:`continued_streams`). :func:`capture_streams` holds only tensors
and plain values, which any ``CheckpointIO`` stores (``torch.load(weights_only=True)``
included).
"""

from __future__ import annotations

import base64
import importlib
import sys
from typing import Any

import torch

from ddpckpt._coord.comm import Comm
from ddpckpt._format.codec import JSON, decode, encode
from ddpckpt._format.tensorfile import byte_view, dtype_from_name, dtype_name, host_contiguous
from ddpckpt._log import current_rank, get_logger, same_on_every_rank
from ddpckpt._state.rng import capture_rng, derive_rng, numpy_key_as_tensor, restore_rng
from ddpckpt.errors import CorruptCheckpointError

_log = get_logger(__name__)


def capture_streams() -> dict[str, Any]:
    """This process's random generators (Python, numpy, torch, CUDA), numpy's as a tensor."""
    return numpy_key_as_tensor(capture_rng())


def restore_streams(state: dict[str, Any], where: str) -> None:
    """Set every generator to ``state`` (from :func:`capture_streams`); a state that is not
    one is a :class:`~ddpckpt.errors.CorruptCheckpointError` naming ``where``."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the random streams are a {type(state).__name__}")
    state = dict(state)
    if "numpy" in state:
        numpy = sys.modules.get("numpy")
        if numpy is None:
            numpy = importlib.import_module("numpy")
        try:
            numpy_state = dict(state["numpy"])
            inner = dict(numpy_state["state"])
            inner["key"] = inner["key"].numpy().astype(numpy.uint32)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: numpy's random stream is not one numpy saved ({type(exc).__name__}: "
                f"{exc})"
            ) from exc
        numpy_state["state"] = inner
        state["numpy"] = numpy_state
    restore_rng(state, where)


def pack(value: Any) -> JSON:
    """``value`` (tensors and plain values) as JSON, for the store; :func:`unpack` reverses it."""
    tensors: dict[str, torch.Tensor] = {}
    tree = encode(value, "s", tensors)
    table = {}
    for name, tensor in tensors.items():
        data = host_contiguous(tensor)
        table[name] = {
            "dtype": dtype_name(data.dtype, name),
            "shape": list(data.shape),
            "data": base64.b64encode(bytes(byte_view(data))).decode(),
        }
    return {"tree": tree, "tensors": table}


def unpack(doc: JSON, where: str) -> Any:
    def tensor(name: str) -> torch.Tensor:
        entry = doc["tensors"][name]
        raw = bytearray(base64.b64decode(entry["data"]))
        dtype = dtype_from_name(entry["dtype"], where)
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(entry["shape"]).clone()

    return decode(doc["tree"], tensor, where=where)


def gather(call: str, state: Any, timeout: float | None = None) -> list[Any] | None:
    """Every rank's ``state``, in rank order, on rank 0 (``None`` on the others); collective.

    Every rank calls it, in the same order; a rank that does not come within ``timeout``
    (default ``$DDPCKPT_TIMEOUT`` or 600 s) is named in a ``CollectiveTimeoutError`` on
    every rank. Outside ``torch.distributed`` it returns ``[state]``.
    """
    with Comm.open(call, timeout=timeout) as comm:
        docs = comm.run_gather("state", lambda: pack(state))
    if docs is None:
        return None
    return [unpack(doc, f"{call}: rank {rank}'s state") for rank, doc in enumerate(docs)]


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def own_streams(ranks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """This rank's random streams among every saved rank's (``ranks[r]["rng"]``): see
    :func:`continued_streams`."""
    if not ranks:
        raise CorruptCheckpointError(f"{where}: the saved state holds no rank's random streams")
    rank = current_rank()
    return continued_streams(ranks[rank if rank < len(ranks) else 0]["rng"], len(ranks), where)


def continued_streams(loaded: Any, saved_world: int, where: str) -> dict[str, Any]:
    """This rank's random streams, from ``loaded``: its own, saved by a job of
    ``saved_world`` ranks; or, for a rank that job did not have (the job grew), rank 0's,
    from which streams are derived with its rank, with a warning: deterministic, distinct
    per rank, not a continuation."""
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{where}: the saved random streams are no dict")
    world = world_size()
    if world > saved_world:  # every rank says it; rank 0 prints it
        _log.warning(
            "%s: saved on %d ranks, resumed on %d: ranks %d and up start from random streams "
            "derived from rank 0's, so their randomness does not continue a saved stream",
            where,
            saved_world,
            world,
            saved_world,
            extra=same_on_every_rank(),
        )
    rank = current_rank()
    if rank < saved_world:
        return loaded
    return numpy_key_as_tensor(derive_rng(loaded, rank))
