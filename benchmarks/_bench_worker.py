"""The measuring job of the benchmark (``bench.py`` next to this file starts it under torchrun).

Every rank builds the same training state (a model of ``--params`` fp32 parameters and
fused AdamW moments: 12 bytes per parameter) on ``--device`` (``cuda``: one GPU per rank,
NCCL for the training group; the harness's own collectives use gloo), then, in one run
and on the same state:

* references: sequential write bandwidth with fsync on the target directory (the write
  ceiling), the copy floor (CPU: single-thread memcpy; GPU: device-to-host copy into
  pinned memory), cold read bandwidth;
* per asynchronous method: the stall of the first save of a fresh instance (pinned memory
  not yet allocated; for ddpckpt a ``Checkpointer`` used as documented: ``resume()``,
  then ``should_save`` every step);
* per method: the training stall, the time until durable, the peak extra resident memory
  while saving, and a cold load that touches every byte;
* per method: the wall time of a training loop that checkpoints every ``--every`` steps,
  against the same loop without checkpoints;
* with one rank: the slowdown of training while a background thread, or a background
  process, writes a checkpoint-sized buffer (the GIL question).

Rank 0 writes the results as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ddpckpt
from ddpckpt._format.tensorwrite import write_file
from ddpckpt.storage._location import locate

_CHUNK = 8 << 20


# --------------------------------------------------------------------------- the state


class Model(nn.Module):
    def __init__(self, params: int, pieces: int = 50, device: str = "cpu") -> None:
        super().__init__()
        size = params // pieces
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(size, device=device)) for _ in range(pieces)
        )


def build(params: int, device: str = "cpu") -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model(params, pieces=20 if device == "cuda" else 50, device=device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    optimizer.step()
    return model, optimizer


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


class Trainer:
    """A synthetic training step: fixed compute, then the optimizer step (which mutates all state)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, compute_seconds: float
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.cuda = next(model.parameters()).is_cuda
        side = 4096 if self.cuda else 512
        self.a = torch.randn(side, side, device="cuda" if self.cuda else "cpu")
        self.before_step: Callable[[], None] = lambda: None
        self.step_seconds = 0.0  # measured by main
        self.a @ self.a
        sync()
        start = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        sync()
        per = (time.perf_counter() - start) / 20
        self.repeats = max(1, round(compute_seconds / per))

    def step(self) -> None:
        """Queue one step; on a GPU it returns before the GPU has run it, as training does."""
        for _ in range(self.repeats):
            self.a @ self.a
        self.before_step()
        self.optimizer.step()

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        sync()
        return time.perf_counter() - start


def sync() -> None:
    """Wait for the GPU, if training runs on one (before reading a clock)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def empty_pinned_cache() -> None:
    """Return cached pinned blocks, so the next method's first save allocates its own."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if torch.cuda.is_available() and empty is not None:
        empty()


def pinned_peak_reset() -> None:
    with contextlib.suppress(Exception):  # statistics of this torch's pinned allocator
        torch.cuda.memory.reset_peak_host_memory_stats()


def pinned_peak() -> float:
    """Peak bytes of pinned memory torch's host allocator held since the last reset, plus
    the buffer ddpckpt's asynchronous saves page-locked themselves (held until released)."""
    try:
        from ddpckpt._io.async_saver import DEFAULT_SAVER

        staging = DEFAULT_SAVER.pool
    except ImportError:  # versions before the AsyncSaver
        from ddpckpt._io.checkpoint import _POOL as staging

    pool = getattr(staging, "_unpin", None) is not None and staging.nbytes  # old versions: no
    try:
        stats = torch.cuda.memory.host_memory_stats()
        return float(stats.get("allocated_bytes.peak", 0)) + float(pool or 0)
    except Exception:  # no such statistics in this torch
        return float("nan")


# --------------------------------------------------------------------------- measuring


class PeakRSS:
    """Samples this process's resident memory every 2 ms."""

    def __init__(self) -> None:
        self.base = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.read()) - self.base


def _files(path: str) -> list[str]:
    """``path`` if it is a file, else every file below it."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def evict(path: str) -> None:
    """Drop ``path`` (a file or every file below a directory) from the page cache."""
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: str) -> None:
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def references(
    directory: str, nbytes: int, model: nn.Module, optimizer: torch.optim.Optimizer, repeat: int
) -> dict[str, float]:
    """Write ceiling, read ceiling and memcpy floor (the best of ``repeat`` tries), rank 0.

    The write ceiling is the faster of two plain ways to make ``nbytes`` durable: write
    everything then fsync (``dd conv=fsync``), and the same while asking the kernel to start
    writeback every 32 MiB. Each try writes a new file; all are deleted at the end.
    """
    paths = [os.path.join(directory, f"ceiling-{i}.bin") for i in range(repeat)]
    tries = [_references_once(path, nbytes, model, optimizer) for path in paths]
    for path in paths:
        os.unlink(path)
    return {key: max(t[key] for t in tries) for key in tries[0]}


def _write_rate(path: str, nbytes: int, writeback: bool) -> float:
    block = torch.randint(0, 255, (_CHUNK,), dtype=torch.uint8).numpy().tobytes()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = flushed = 0
    while written < nbytes:
        written += os.write(fd, block)
        if writeback and written - flushed >= 32 << 20:
            os.posix_fadvise(fd, flushed, written - flushed, os.POSIX_FADV_DONTNEED)
            flushed = written
    os.fsync(fd)
    os.close(fd)
    return written / (time.perf_counter() - start)


def _references_once(
    path: str, nbytes: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    plain = _write_rate(path, nbytes, writeback=False)
    os.unlink(path)
    early = _write_rate(path, nbytes, writeback=True)
    evict(path)
    buffer = bytearray(_CHUNK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    read = os.path.getsize(path) / (time.perf_counter() - start)
    tensors = [p.detach() for p in model.parameters()]
    tensors += [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    ]
    pinned = tensors[0].is_cuda  # GPU: the pinned device-to-host copy is the floor
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    for c, t in zip(copies, tensors, strict=True):  # touch the destination pages first
        c.copy_(t, non_blocking=pinned)
    sync()
    start = time.perf_counter()
    for c, t in zip(copies, tensors, strict=True):
        c.copy_(t, non_blocking=pinned)
    sync()
    memcpy = sum(t.numel() * t.element_size() for t in tensors) / (time.perf_counter() - start)
    del copies
    empty_pinned_cache()
    return {
        "write_ceiling": max(plain, early),
        "write_plain": plain,
        "write_writeback": early,
        "read_ceiling": read,
        "memcpy": memcpy,
    }


# --------------------------------------------------------------------------- methods


class Method:
    """One way to checkpoint: start a save (returns something to wait on), and load."""

    name = ""
    rank0_only = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def start(self, path: str) -> Callable[[], None]:
        raise NotImplementedError

    def load(self, path: str) -> None:
        raise NotImplementedError

    def before_step(self) -> None:
        """What the training step must wait for after a save (nothing, for most)."""


def on_rank0(write: Callable[[], None], path: str) -> Callable[[], None]:
    """The seeds' pattern: ``write`` on rank 0, then a barrier; the returned wait fsyncs
    ``path`` on rank 0 (the recipe itself never does) and barriers again."""
    if dist.get_rank() == 0:
        write()
    dist.barrier()

    def durable() -> None:
        if dist.get_rank() == 0:
            fsync_tree(path)
        dist.barrier()

    return durable


class TorchSaveRank0(Method):
    """The seeds' recipe: torch.save on rank 0, then dist.barrier(); no fsync."""

    name = "torch.save rank 0 + barrier"

    def start(self, path: str) -> Callable[[], None]:
        def write() -> None:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, path)

        return on_rank0(write, path)

    def load(self, path: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class SafetensorsRank0(Method):
    """safetensors.torch.save_file of model and optimizer tensors on rank 0, then a barrier."""

    name = "safetensors save_file rank 0"

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for i, state in enumerate(self.optimizer.state.values()):
            out.update({f"optim.{i}.{k}": v for k, v in state.items()})
        return out

    def start(self, path: str) -> Callable[[], None]:
        from safetensors.torch import save_file

        return on_rank0(lambda: save_file(self.tensors(), path), path)

    def load(self, path: str) -> None:
        from safetensors.torch import load_file

        loaded = load_file(path)
        with torch.no_grad():
            for name, target in self.tensors().items():
                target.copy_(loaded[name])


class DCP(Method):
    name = "DCP save"

    def state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def start(self, path: str) -> Callable[[], None]:
        dcp.save(self.state(), checkpoint_id=path)
        return lambda: None

    def load(self, path: str) -> None:
        state = self.state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class DCPAsync(DCP):
    name = "DCP async_save"
    _group: Any = None

    def start(self, path: str) -> Callable[[], None]:
        # As PyTorch's async_save guide recommends: the background save's collectives run on
        # their own gloo group, or they interleave with the training thread's and deadlock.
        if DCPAsync._group is None:
            DCPAsync._group = dist.new_group(backend="gloo")
        future = dcp.async_save(self.state(), checkpoint_id=path, process_group=DCPAsync._group)
        return lambda: future.result()


class DCPStager(DCP):
    """DCP async_save with a DefaultStager (pinned memory, staging on a side stream).

    A new stager per save: reusing one raised ``KeyError(<class 'type'>)`` at the second
    save on torch 2.11, so DCP users create one per save. The training step after a save
    waits for its staging to finish (DCP's rule: the state may not change before).
    """

    name = "DCP async_save + DefaultStager"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.staging: Any = None

    def start(self, path: str) -> Callable[[], None]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if DCPAsync._group is None:
            DCPAsync._group = dist.new_group(backend="gloo")
        stager = DefaultStager(StagingOptions(True, False, True, True))
        response = dcp.async_save(
            self.state(), checkpoint_id=path, process_group=DCPAsync._group, async_stager=stager
        )
        self.staging = response.staging_completion

        def durable() -> None:
            response.staging_completion.result()
            response.upload_completion.result()
            stager.close()

        return durable

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None


class Ddpckpt(Method):
    name = "ddpckpt"
    mode: bool | str = False

    def start(self, path: str) -> Callable[[], None]:
        result = ddpckpt.save(
            path, model=self.model, optimizer=self.optimizer, async_save=self.mode
        )
        return result.wait if isinstance(result, ddpckpt.PendingSave) else (lambda: None)

    def load(self, path: str) -> None:
        ddpckpt.load(path, model=self.model, optimizer=self.optimizer)


class DdpckptAsync(Ddpckpt):
    name = "ddpckpt async"
    mode = True


class DdpckptOverlap(Ddpckpt):
    name = "ddpckpt async overlap"
    mode = "overlap"


METHODS = [TorchSaveRank0, SafetensorsRank0, DCP, DCPAsync, Ddpckpt, DdpckptAsync, DdpckptOverlap]
GPU_METHODS = [TorchSaveRank0, DCP, DCPAsync, DCPStager, Ddpckpt, DdpckptAsync, DdpckptOverlap]
ASYNC_METHODS = (DCPAsync, DCPStager, DdpckptAsync)  # DdpckptOverlap is a DdpckptAsync


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


_HARNESS: Any = None  # a gloo group for the harness's own CPU collectives


def all_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_HARNESS)
    return float(tensor)


def release_memory() -> None:
    """Return freed heap memory to the system, so one method's garbage (glibc keeps freed
    chunks) is not counted, or reused, by the next method's peak-RSS measurement."""
    ddpckpt.release_async_buffers()
    gc.collect()
    empty_pinned_cache()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: garbage may then count
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_method(
    method: Method, trainer: Trainer, directory: str, step_seconds: float, repeat: int
) -> dict[str, Any]:
    """Stall and time until durable (medians of ``repeat`` saves), peak extra memory while
    saving (asynchronous methods: including the host buffers they keep between saves),
    then the cold load of each of those checkpoints (best of ``repeat``, as the read
    ceiling is) and the most resident memory one added over what the rank held before it
    (the slowest or largest rank counting, as everywhere)."""
    base = os.path.join(directory, method.name.replace(" ", "_"))
    paths = [f"{base}-{i}" for i in range(repeat)]
    dist.barrier()
    release_memory()
    rss = PeakRSS()
    pinned_peak_reset()
    if isinstance(method, ASYNC_METHODS):  # steady state: staging memory set up once
        method.start(base + "-warmup")()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(base + "-warmup")
    stalls, durables, loads = [], [], []
    for path in paths:  # distinct paths: like a training run, each save writes new files
        dist.barrier()
        sync()  # the save's own time, not the GPU's queue (the loop below counts that)
        started = time.perf_counter()
        durable = method.start(path)
        stall = time.perf_counter() - started
        if isinstance(method, DdpckptOverlap):  # the copy finishes under the next step
            stall += max(0.0, trainer.timed_step() - step_seconds)
        durable()
        finished = time.perf_counter() - started  # before the collective below waits
        stalls.append(all_max(stall))
        durables.append(all_max(finished))
    peak_extra = all_max(float(rss.stop()))
    peak_pinned = all_max(pinned_peak())
    load_peaks: list[float] = []
    for path in paths:
        dist.barrier()
        if dist.get_rank() == 0:
            evict(path)
        dist.barrier()
        release_memory()
        rss = PeakRSS()
        seconds = timed(functools.partial(load_synced, method, path))[0]
        load_peaks.append(all_max(float(rss.stop())))
        loads.append(all_max(seconds))
        dist.barrier()
        if dist.get_rank() == 0:
            remove(path)
    return {
        "stall": statistics.median(stalls),
        "durable": statistics.median(durables),
        "load": min(loads),
        "peak_extra_rss": peak_extra,
        "peak_pinned": peak_pinned,
        "load_peak_extra_rss": max(load_peaks),
        "stalls": stalls,
        "durables": durables,
        "loads": loads,
    }


def first_save_stall(kind: type[Method], trainer: Trainer, directory: str, every: int) -> float:
    """The stall of the first save of a fresh instance of ``kind``, no pinned memory cached.

    ddpckpt is used through a ``Checkpointer`` as documented (``resume()``, then
    ``should_save`` after every step) whose first save comes ``every`` steps in.
    """
    model, optimizer = trainer.model, trainer.optimizer
    dist.barrier()
    release_memory()
    path = os.path.join(directory, "first-" + kind.name.replace(" ", "_").replace("+", ""))
    method = kind(model, optimizer)
    ckpt = None
    if issubclass(kind, DdpckptAsync):
        ckpt = ddpckpt.Checkpointer(
            path, model=model, optimizer=optimizer, async_save=kind.mode, every_steps=every
        )
        ckpt.resume()
        for step in range(1, every):
            trainer.step()
            ckpt.should_save(step)
    trainer.step()
    dist.barrier()
    sync()
    started = time.perf_counter()
    if ckpt is not None:
        ckpt.save(every)
        durable: Callable[[], None] = ckpt.close
    else:
        durable = method.start(path)
    stall = time.perf_counter() - started
    if kind is DdpckptOverlap:
        stall += max(0.0, trainer.timed_step() - trainer.step_seconds)
    durable()
    method.before_step()
    stall = all_max(stall)
    dist.barrier()
    if dist.get_rank() == 0:
        remove(path)
    return stall


def load_synced(method: Method, path: str) -> None:
    method.load(path)
    sync()  # a load is done once the GPU has the data


def remove(path: str) -> None:
    (shutil.rmtree if os.path.isdir(path) else os.unlink)(path)


def loop_seconds(
    trainer: Trainer, method: Method | None, directory: str, steps: int, every: int
) -> float:
    """Wall time of ``steps`` training steps checkpointing every ``every`` with ``method``.

    Saves happen at every multiple of ``every`` before the last step; waiting for the
    last one to become durable is not timed (training would go on meanwhile), but a
    save that finds the previous one still in flight waits inside the timing.
    """
    dist.barrier()
    sync()
    pending: Callable[[], None] | None = None
    paths: list[str] = []
    trainer.before_step = method.before_step if method is not None else (lambda: None)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step()
        if method is not None and step % every == 0 and step < steps:
            if pending is not None:
                pending()
            path = os.path.join(directory, f"loop-{step}")
            paths.append(path)
            pending = method.start(path)
    sync()
    elapsed = all_max(time.perf_counter() - start)
    trainer.before_step = lambda: None
    if pending is not None:
        pending()
    dist.barrier()
    if dist.get_rank() == 0:
        for path in paths:
            remove(path)
    return elapsed


# --------------------------------------------------------------------------- the GIL question


def _write_loop(tensor: torch.Tensor, path: str, seconds: float, ready: Any = None) -> None:
    if ready is not None:
        ready.set()
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        target = f"{path}.{count}"
        write_file(locate(target), [("x", tensor)], writer=0, metadata={})
        os.unlink(target)
        count += 1


def gil_effect(trainer: Trainer, directory: str, nbytes: int, steps: int) -> dict[str, float]:
    """Step time alone, with a writer thread, and with a writer process (same work)."""
    buffer = torch.empty(nbytes // 4, dtype=torch.float32).share_memory_()
    buffer.normal_()
    path = os.path.join(directory, "gil.bin")

    def steps_time() -> float:
        return timed(lambda: [trainer.step() for _ in range(steps)])[0] / steps

    alone = steps_time()
    seconds = alone * steps + 5
    thread = threading.Thread(target=_write_loop, args=(buffer, path + "t", seconds))
    thread.start()
    with_thread = steps_time()
    thread.join()
    context = torch.multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_write_loop, args=(buffer, path + "p", seconds, ready))
    process.start()
    ready.wait()  # measured once the process has imported everything and writes
    with_process = steps_time()
    process.join()
    return {"alone": alone, "thread": with_thread, "process": with_process}


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compute", type=float, default=0.2, help="seconds of compute per step")
    parser.add_argument("--gil", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--first-every", type=int, default=50)
    parser.add_argument("--only", default=None, help="only the methods whose name starts so")
    args = parser.parse_args()
    torch.set_num_threads(1)
    global _HARNESS
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        _HARNESS = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo")
    methods = GPU_METHODS if args.device == "cuda" else METHODS
    if args.only:
        methods = [k for k in methods if k.name.startswith(tuple(args.only.split(",")))]
    rank = dist.get_rank()
    os.makedirs(args.dir, exist_ok=True)
    model, optimizer = build(args.params, args.device)
    trainer = Trainer(model, optimizer, args.compute)
    nbytes = state_bytes(model, optimizer)
    result: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "state_bytes": nbytes,
        "params": args.params,
        "device": args.device,
    }
    if args.device == "cuda":
        result["gpu"] = {
            "name": torch.cuda.get_device_name(),
            "torch_cuda": torch.version.cuda,
            "driver": _driver_version(),
        }
        trainer.step_seconds = all_max(statistics.median(trainer.timed_step() for _ in range(5)))
        result["first_stall"] = {
            kind.name: first_save_stall(kind, trainer, args.dir, args.first_every)
            for kind in methods
            if issubclass(kind, ASYNC_METHODS)
        }
        result["first_every"] = args.first_every
    if rank == 0:
        result["references"] = references(args.dir, nbytes, model, optimizer, args.repeat)
    dist.barrier()
    step_seconds = all_max(statistics.median(trainer.timed_step() for _ in range(3)))
    result["step_seconds"] = step_seconds
    result["methods"] = {}
    for kind in methods:
        method = kind(model, optimizer)
        result["methods"][method.name] = measure_method(
            method, trainer, args.dir, step_seconds, args.repeat
        )
        if rank == 0:  # what is measured so far, should the run be cut short
            with open(args.out + ".partial", "w") as f:
                json.dump(result, f, indent=1)
    if rank == 0:  # the disk drifts too: the ceilings are the best of both ends
        first, last = (
            result["references"],
            references(args.dir, nbytes, model, optimizer, args.repeat),
        )
        result["references"] = {key: max(first[key], last[key]) for key in first}
        result["references_each_end"] = [first, last]
    dist.barrier()
    before = loop_seconds(trainer, None, args.dir, args.steps, args.every)
    result["loop"] = {"every": args.every, "steps": args.steps}
    for kind in methods:
        method = kind(model, optimizer)
        result["loop"][method.name] = loop_seconds(
            trainer, method, args.dir, args.steps, args.every
        )
    after = loop_seconds(trainer, None, args.dir, args.steps, args.every)
    result["loop"]["baseline"] = (before + after) / 2  # the machine drifts: average both ends
    result["loop"]["baselines"] = [before, after]
    if args.gil and dist.get_world_size() == 1 and args.device == "cpu":
        result["gil"] = gil_effect(trainer, args.dir, nbytes, steps=10)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


if __name__ == "__main__":
    main()
