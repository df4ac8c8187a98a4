"""Peak extra memory of a load, as a share of the weights, on the code path GPU models take.

A GPU model's tensors are read through the pinned ring (two 32 MiB buffers) into the live
tensors. Without a GPU the same code runs on CPU tensors with the ring forced on
(``pinned_ring._RING_FOR_CPU``), so the memory a load adds shows in this process's
anonymous resident memory instead of the device's. Three loads of one checkpoint into a
fresh model, each measured from the same baseline:

* ``in place``: the GPU path (each tensor read into the live tensor);
* ``separate buffer``: the GPU path for a model whose load hooks must see the incoming
  value apart from the current one (a ``load_state_dict`` pre-hook), which is what every
  GPU load did before: a new tensor per weight, then ``load_state_dict``;
* ``CPU path``: a CPU model (read straight into its parameters).

The ring itself (64 MiB of host memory, pinned on a GPU machine) is made once per process
and kept; it is made before the measurements and not counted.

    PYTHONPATH=src python benchmarks/load_memory.py --mib 512
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import ddpckpt
from ddpckpt._format import pinned_ring


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_extra(action: Callable[[], object]) -> int:
    """The most anonymous memory ``action`` added while it ran (sampled every millisecond)."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = peak = _anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, _anon())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return max(peak, _anon()) - base


def model(mib: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = max(1, mib // 64)  # 64 MiB layers: 4096 x 4096 fp32
    return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(layers)))


def _measure(path: str, target: nn.Module, weights: int) -> dict[str, float]:
    started = time.perf_counter()
    extra = peak_extra(lambda: ddpckpt.load(path, model=target, rng=False))
    return {
        "extra_bytes": extra,
        "extra_over_weights": round(extra / weights, 3),
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the weights")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        saved = model(args.mib, seed=0)
        weights = sum(p.numel() * p.element_size() for p in saved.parameters())
        path = ddpckpt.save(f"{root}/ck", model=saved)
        del saved
        results = {}
        for name, ring, hook in (
            ("in place", True, False),
            ("separate buffer", True, True),
            ("CPU path", False, False),
        ):
            pinned_ring._RING_FOR_CPU = ring
            target = model(args.mib, seed=1)
            if hook:  # its hooks must see the incoming value: a separate buffer per tensor
                target._register_load_state_dict_pre_hook(lambda *a: None)
            if ring:  # the ring (host memory, pinned on a GPU) is made once and kept
                with pinned_ring.ring_for([torch.empty(0)]) as made:
                    for buffer in made.buffers:  # type: ignore[union-attr]
                        buffer.fill_(0)  # resident, as pinned memory is
            results[name] = _measure(path, target, weights)
            del target
        pinned_ring._RING_FOR_CPU = False
    print(json.dumps({"weights_bytes": weights, "loads": results}, indent=1))
    for name, found in results.items():
        print(f"{name}: peak extra {found['extra_over_weights']:.3f}x the weights")


if __name__ == "__main__":
    main()
