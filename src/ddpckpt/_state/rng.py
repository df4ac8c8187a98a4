"""Capture and restore every random number generator a training step draws from.

Covered: Python's ``random``, numpy's legacy global generator (when numpy is installed),
torch's CPU generator, and the generator of every CUDA device this process has
initialised. The state is per process: under ``torch.distributed`` each rank's is stored
separately and restored on the same rank.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch

from ddpckpt._format.tensorfile import byte_view
from ddpckpt._log import get_logger
from ddpckpt.errors import CorruptCheckpointError

_log = get_logger(__name__)


def capture_rng() -> dict[str, Any]:
    """This process's generator states (tensors and plain values, ready for the tree codec)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state(legacy=False)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], where: str) -> None:
    """Put every generator back to ``state``; a missing or unreadable part is an error."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: RNG state is a {type(state).__name__}")
    for part in ("python", "torch"):
        if part not in state:
            raise CorruptCheckpointError(f"{where}: RNG state lacks its {part!r} generator")
    try:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy

            numpy.random.set_state(state["numpy"])
    except (TypeError, ValueError, RuntimeError, OverflowError, KeyError, IndexError) as exc:
        # what random, torch and numpy raise for a state that is not one of theirs
        raise CorruptCheckpointError(f"{where}: RNG state cannot be restored ({exc})") from exc
    except ImportError:
        _log.warning("%s: numpy RNG state not restored: numpy is not installed", where)
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda):
            _log.warning(
                "%s: checkpoint has CUDA RNG state for %d devices, this process sees %d; "
                "restoring the first %d",
                where,
                len(cuda),
                count,
                min(count, len(cuda)),
            )
        for device, device_state in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(device_state, device)


def numpy_key_as_tensor(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (of :func:`capture_rng`) with numpy's key as an int64 tensor, as the
    integrations keep the streams (a framework's own checkpoint stores tensors, not arrays)."""
    if "numpy" not in state:
        return state
    numpy_state = dict(state["numpy"])
    inner = dict(numpy_state["state"])
    inner["key"] = torch.from_numpy(inner["key"].astype("int64"))
    return {**state, "numpy": {**numpy_state, "state": inner}}


def derive_rng(base: dict[str, Any], rank: int) -> dict[str, Any]:
    """A deterministic, rank-distinct RNG state for a rank the checkpoint has none for.

    Seeds every generator from a hash of ``base`` (rank 0's stored state) and ``rank``,
    so the same checkpoint resumed at the same world size always gives the same streams.
    """
    state_bytes = base["torch"].contiguous()  # kept alive while its bytes are viewed
    digest = hashlib.sha256(bytes(byte_view(state_bytes)) + rank.to_bytes(8, "little"))
    seed = int.from_bytes(digest.digest()[:8], "little")
    python = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"python": python.getstate(), "torch": generator.get_state()}
    if "numpy" in base:
        import numpy

        state["numpy"] = numpy.random.RandomState(seed % 2**32).get_state(legacy=False)
    if "cuda" in base:
        state["cuda"] = _cuda_states_from_seeds(seed, len(base["cuda"]))
    return state


def _cuda_states_from_seeds(seed: int, count: int) -> list[torch.Tensor]:
    """CUDA generator states seeded with ``seed + 1 + device``, built without a GPU.

    A CUDA generator's state is its 64-bit seed followed by its 64-bit offset.
    """
    states = []
    for index in range(count):
        value = (seed + 1 + index) % 2**64
        raw = value.to_bytes(8, "little") + (0).to_bytes(8, "little")
        states.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    return states
