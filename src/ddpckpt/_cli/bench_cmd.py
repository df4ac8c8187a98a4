"""``ddpckpt bench``: a launcher of the benchmark, which is not part of the installed package.

The harness, ``benchmarks/bench.py`` and its torchrun job ``benchmarks/_bench_worker.py``,
lives in the source tree next to ``src/``. From a source checkout installed in place
(``pip install -e '.[bench]'``, as ``make`` does) this command loads and runs it; from a
plain install it says, in one line, how to run it from a clone.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from ddpckpt._cli.command import CannotRun, Command

NOT_INSTALLED = (
    "the benchmark is not part of the installed package: in a clone of the ddpckpt "
    "repository, `pip install -e '.[bench]'` and run `python benchmarks/bench.py` "
    "(the same options)"
)


def harness_path() -> Path | None:
    """``benchmarks/bench.py`` of the source checkout this package is imported from, if any."""
    root = Path(__file__).resolve().parents[3]  # <root>/src/ddpckpt/_cli/bench_cmd.py
    harness = root / "benchmarks" / "bench.py"
    return harness if harness.is_file() and (root / "pyproject.toml").is_file() else None


def load_harness() -> ModuleType:
    """The benchmark harness module; :class:`CannotRun` from a plain install."""
    path = harness_path()
    if path is None:
        raise CannotRun(NOT_INSTALLED)
    spec = importlib.util.spec_from_file_location("ddpckpt_benchmarks_bench", path)
    if spec is None or spec.loader is None:
        raise CannotRun(f"{path}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (also those of ``python benchmarks/bench.py``)."""
    p.add_argument("--out", default="bench-output", help="output directory (default bench-output)")
    p.add_argument(
        "--dir", default=None, help="where checkpoints are written (default OUT/checkpoints)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the training state lives (default cuda when a GPU is present)",
    )
    p.add_argument(
        "--nproc",
        default=None,
        help="world sizes to run, comma-separated (default 1,2; on one GPU 1)",
    )
    p.add_argument(
        "--params",
        type=int,
        default=None,
        help="fp32 parameters (default CPU 100M: 1.2 GB with AdamW; GPU 335M: 4.03 GB)",
    )
    p.add_argument(
        "--every",
        type=int,
        default=None,
        help="checkpoint interval of the training loop (default CPU 20, GPU 50)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="steps of the training loop (default 60, GPU 150)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="saves and loads per method; medians reported"
    )
    p.add_argument(
        "--compute",
        type=float,
        default=None,
        help="seconds of compute per training step (default CPU 0.2, GPU 0.12)",
    )


def _bench(args: argparse.Namespace) -> int:
    return int(load_harness().run_from_args(args))


BENCH = Command(
    "bench",
    "measure checkpointing against torch.save, DCP and the hardware",
    add_arguments,
    _bench,
    description="Measure save stall, time until durable, load time and peak memory of "
    "ddpckpt (sync, async, overlap) against torch.save on rank 0, safetensors and "
    "torch.distributed.checkpoint, with the machine's own write, read and copy speeds "
    "measured in the same run. Runs benchmarks/bench.py of a source checkout (pip install "
    "-e '.[bench]'); the benchmark is not part of the installed package.",
)
