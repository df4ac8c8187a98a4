"""Ranks as threads of one process, each with its own client of one real TCPStore.

For the tests of ddpckpt._coord's store coordination (see ``ddpckpt._coord.store.StoreGroup``);
the simulation is the coordination benchmark's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ddpckpt._coord.store import StoreGroup


def _load_simulation() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "coordination.py"
    spec = importlib.util.spec_from_file_location("coordination_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


sim = _load_simulation()


def ranks(n: int, body, server=None) -> tuple[list, list]:
    """Run ``body(group)`` on ``n`` thread ranks; each rank's result (or exception) and stats."""
    return sim.run_ranks(n, lambda rank, store: body(StoreGroup(store, rank, n)), server)
