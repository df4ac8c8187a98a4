"""Scenarios that run in every rank of a multi-process test (see launch.py).

    python dist_worker.py SCENARIO --out DIR [--ckpt PATH] [...]

Each scenario returns a JSON-able dict, written to ``DIR/rank-<global rank>.json``.
Errors the scenario expects are caught and reported in that dict; anything else fails
the process.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
import ddpckpt._io.writing as checkpoint_module
from exiting import exit_now


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def build(seed: int, width: int = 32):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 4)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    return model, ddp, opt, sched, scaler, Counter()


def train(ddp, opt, sched, scaler, counter, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 16)
        scaler.scale(ddp(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        counter.n += 1


def digest(model: nn.Module, opt: torch.optim.Optimizer, buffers: bool = True) -> str:
    """A hash of the model (with or without buffers) and the optimizer state."""
    hasher = xxhash.xxh3_64()
    params = {n for n, _ in model.named_parameters()}
    for name, value in sorted(model.state_dict().items()):
        if not buffers and name not in params:
            continue
        hasher.update(name.encode())
        hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        hasher.update(repr({k: v for k, v in group.items() if k != "params"}).encode())
        for p in group["params"]:
            for key, value in sorted(opt.state[p].items()):
                hasher.update(f"{names[id(p)]}/{key}".encode())
                hasher.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def draws() -> list[float]:
    return [random.random(), *torch.rand(2).tolist()]


def error_report(exc: BaseException, started: float) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()},
        "elapsed": time.monotonic() - started,
        "is_timeout": isinstance(exc, TimeoutError),
        "is_oserror": isinstance(exc, OSError),
        "errno": getattr(exc, "errno", None),
    }


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("ddpckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class AnonPeak:
    """Samples this process's anonymous (non-file) resident memory."""

    def __init__(self) -> None:
        self.base = self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._read()) - self.base


def listing(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


# --------------------------------------------------------------------------- scenarios


def scenario_train_save(args, rank: int) -> dict[str, Any]:
    model, ddp, opt, sched, scaler, counter = build(seed=args.seed, width=args.width)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    train(ddp, opt, sched, scaler, counter, args.steps)
    path = ddpckpt.save(args.ckpt, model=ddp, optimizer=opt, scheduler=sched, scaler=scaler,
                        extra={"counter": counter}, step=args.steps, sharing=args.storage)  # fmt: skip
    with open(os.path.join(args.ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    return {
        "path": path,
        "digest": digest(model, opt),
        "replicated": digest(model, opt, buffers=False),
        "draws": draws(),
        "files": {name: f["writer"] for name, f in manifest["files"].items()},
        "bytes": {name: f["size"] for name, f in manifest["files"].items()},
        "copy": manifest["copy"],
    }


def scenario_load(args, rank: int) -> dict[str, Any]:
    model, ddp, opt, sched, scaler, counter = build(seed=args.seed + 1, width=args.width)
    warnings = Warnings()
    info = ddpckpt.load(args.ckpt, model=ddp, optimizer=opt, scheduler=sched, scaler=scaler,
                        extra={"counter": counter})  # fmt: skip
    return {
        "digest": digest(model, opt),
        "replicated": digest(model, opt, buffers=False),
        "draws": draws(),
        "step": info.step,
        "counter": counter.n,
        "scale": scaler.get_scale(),
        "warnings": warnings.messages,
        "listing": listing(args.ckpt),
    }


def scenario_load_refused(args, rank: int) -> dict[str, Any]:
    """Load a checkpoint the test expects to be refused; reports the error."""
    _, ddp, opt, *_ = build(seed=args.seed + 1, width=args.width)
    started = time.monotonic()
    try:
        ddpckpt.load(args.ckpt, model=ddp, optimizer=opt)
    except ddpckpt.CheckpointError as exc:
        return error_report(exc, started)
    return {"error": None}


def scenario_load_memory(args, rank: int) -> dict[str, Any]:
    model, ddp, *_ = build(seed=args.seed + 1, width=args.width)
    size = sum(os.path.getsize(os.path.join(args.ckpt, f)) for f in os.listdir(args.ckpt))
    meter = AnonPeak()
    ddpckpt.load(args.ckpt, model=ddp, rng=False)
    return {
        "extra_anon": meter.stop(),
        "checkpoint_bytes": size,
        "digest": digest(model, torch.optim.SGD(model.parameters(), lr=1)),
    }


class StampedStderr:
    """Passes stderr through, noting when each line was written (what a user sees, when)."""

    def __init__(self) -> None:
        self.stream = sys.stderr
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines += [(time.monotonic(), line) for line in text.splitlines() if line]
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def scenario_rank0_only(args, rank: int) -> dict[str, Any]:
    """The seeds' pattern: ``if rank == 0: save(...)`` then ``dist.barrier()``."""
    result: dict[str, Any] = {}
    if rank == 0:
        model = nn.Linear(2, 2)  # not DDP: wrapping is itself a collective
        sys.stderr = stderr = StampedStderr()
        started = time.monotonic()
        try:
            ddpckpt.save(args.ckpt, model=model, timeout=args.timeout)
        except Exception as exc:
            result = error_report(exc, started)
        sys.stderr = stderr.stream
        result["stderr"] = [(round(at - started, 2), line) for at, line in stderr.lines]
    dist.barrier()  # the other ranks never called save; they meet rank 0 here
    result["listing"] = listing(os.path.dirname(args.ckpt))
    return result


def scenario_slow_writer(args, rank: int) -> dict[str, Any]:
    _model, ddp, opt, sched, scaler, counter = build(seed=0)
    train(ddp, opt, sched, scaler, counter, 1)
    if rank == 1:
        real = checkpoint_module.write_file

        slept = []

        def slow(*a, **k):  # the first file takes args.sleep seconds
            if not slept:
                slept.append(time.sleep(args.sleep))
            return real(*a, **k)

        checkpoint_module.write_file = slow
    started = time.monotonic()
    ddpckpt.save(args.ckpt, model=ddp, optimizer=opt, step=1)
    elapsed = time.monotonic() - started
    value = torch.ones(1)
    dist.all_reduce(value)  # the training group is still healthy
    train(ddp, opt, sched, scaler, counter, 1)
    return {
        "elapsed": elapsed,
        "all_reduce": value.item(),
        "verified": ddpckpt.verify(args.ckpt).step,
    }


def scenario_disk_full(args, rank: int) -> dict[str, Any]:
    _model, ddp, opt, sched, scaler, counter = build(seed=0)
    train(ddp, opt, sched, scaler, counter, 2)
    first = ddpckpt.save(os.path.join(args.ckpt, "step-1"), model=ddp, optimizer=opt, step=1)
    if rank == 1:

        def full(path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", path)

        checkpoint_module.write_file = full
    started = time.monotonic()
    try:
        ddpckpt.save(os.path.join(args.ckpt, "step-2"), model=ddp, optimizer=opt, step=2)
        result: dict[str, Any] = {"error": None}
    except Exception as exc:
        result = error_report(exc, started)
    dist.barrier()
    result["listing"] = listing(args.ckpt)
    result["first_ok"] = ddpckpt.verify(first).step
    return result


def scenario_killed(args, rank: int) -> dict[str, Any]:
    _model, ddp, opt, sched, scaler, counter = build(seed=0)
    train(ddp, opt, sched, scaler, counter, 1)
    if rank == args.victim:
        real = checkpoint_module.write_file
        calls = []

        def die(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # after its first file: a torn write in progress
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        checkpoint_module.write_file = die
    started = time.monotonic()
    try:
        ddpckpt.save(args.ckpt, model=ddp, optimizer=opt, step=1, timeout=args.timeout)
        result: dict[str, Any] = {"error": None}
    except Exception as exc:
        result = error_report(exc, started)
    time.sleep(0.5)
    result["listing"] = listing(os.path.dirname(args.ckpt))
    return result


def scenario_audit_writers(args, rank: int) -> dict[str, Any]:
    real_open = os.open
    created: list[str] = []

    def recording_open(path, flags, *a, **k):
        parent = os.path.dirname(os.path.abspath(args.ckpt))
        if flags & os.O_CREAT and os.path.abspath(path).startswith(parent):
            created.append(os.path.basename(path))
        return real_open(path, flags, *a, **k)

    os.open = recording_open
    try:
        result = scenario_train_save(args, rank)
    finally:
        os.open = real_open
    result["created"] = created
    return result


def scenario_mismatch(args, rank: int) -> dict[str, Any]:
    _model, ddp, _opt, *_ = build(seed=0)
    started = time.monotonic()
    try:
        if rank == 0:
            ddpckpt.save(args.ckpt, model=ddp, timeout=args.timeout)
        else:
            ddpckpt.load(args.ckpt, model=ddp, timeout=args.timeout)
        return {"error": None}
    except Exception as exc:
        return error_report(exc, started)


def scenario_roundtrip(args, rank: int) -> dict[str, Any]:
    saved = scenario_train_save(args, rank)
    loaded = scenario_load(args, rank)
    return {"saved": saved, "loaded": loaded}


@contextlib.contextmanager
def counted_scans() -> Iterator[list[int]]:
    """How often this rank lists a run directory (each listing parses every manifest)."""
    import ddpckpt._run.durable as durable_module
    import ddpckpt._run.saving as saving_module

    count = [0]
    real = durable_module.scan

    def counting(directory):
        count[0] += 1
        return real(directory)

    durable_module.scan = saving_module.scan = counting
    try:
        yield count
    finally:
        durable_module.scan = saving_module.scan = real


def scenario_checkpointer_run(args, rank: int) -> dict[str, Any]:
    """Train with a Checkpointer (time- and step-based saves), on without saving as far as a
    job restarted from the newest checkpoint will (``continued``: what that job's ``digest``
    must be), then resume in a new Checkpointer."""
    model, ddp, opt, sched, scaler, counter = build(seed=args.seed)
    torch.manual_seed(100 + rank)  # each rank its own batches (identical ones sum exactly)
    saved = []
    with ddpckpt.Checkpointer(
        args.ckpt, model=ddp, optimizer=opt, scheduler=sched, scaler=scaler,
        extra={"counter": counter}, keep_last=2, keep_best=1, monitor="loss",
        every_steps=4, every_seconds=0.3, timeout=30,
    ) as ckpt:  # fmt: skip
        info = ckpt.resume()
        start = info.step + 1 if info else 1
        for step in range(start, start + args.steps):
            train(ddp, opt, sched, scaler, counter, 1)
            time.sleep(0.01 * (rank + 1) * (step % 7))  # ranks' clocks drift apart
            if ckpt.should_save(step):
                ckpt.save(step, metrics={"loss": float(step) if saved else 0.0})  # first is best
                saved.append(step)
    trained = digest(model, opt)
    train(ddp, opt, sched, scaler, counter, saved[-1] + 1 - start)
    continued = digest(model, opt)
    fresh_model, fresh, fresh_opt, fresh_sched, fresh_scaler, fresh_counter = build(
        seed=args.seed + 1
    )
    with ddpckpt.Checkpointer(args.ckpt, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched,
                              scaler=fresh_scaler, extra={"counter": fresh_counter}
                              ) as again, counted_scans() as scans:  # fmt: skip
        resumed = again.resume()
    return {
        "scans": scans[0],
        "started": start,
        "saved": saved,
        "resumed": resumed.step,
        "digest": trained,
        "resumed_digest": digest(fresh_model, fresh_opt),
        "continued": continued,
        "listing": listing(args.ckpt),
    }


def scenario_async_props(args, rank: int) -> dict[str, Any]:
    """Asynchronous Checkpointer saves across ranks: snapshot, durability, errors."""
    model, ddp, opt, sched, scaler, counter = build(seed=0)
    train(ddp, opt, sched, scaler, counter, 2)
    ckpt = ddpckpt.Checkpointer(args.ckpt, model=ddp, optimizer=opt, keep_last=None, on_error="raise",
                                retries=0, async_save=args.mode if args.mode != "True" else True)  # fmt: skip
    result: dict[str, Any] = {"saved_digest": digest(model, opt)}
    started = time.monotonic()
    ckpt.save(1)
    result["stall"] = time.monotonic() - started
    train(ddp, opt, sched, scaler, counter, 2)  # parameters change while step 1 is written
    ckpt.wait()
    real = checkpoint_module.write_file
    if rank == 1:

        def slow(*a, **k):
            time.sleep(1.5)
            return real(*a, **k)

        checkpoint_module.write_file = slow
    ckpt.save(2)
    result["latest_right_after"] = open(os.path.join(args.ckpt, "latest")).read().strip()  # noqa: SIM115
    ckpt.wait()
    result["latest_after_wait"] = open(os.path.join(args.ckpt, "latest")).read().strip()  # noqa: SIM115
    checkpoint_module.write_file = real
    if rank == 1:

        def full(path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", path)

        checkpoint_module.write_file = full
    ckpt.save(3)  # returns; the failure is reported at the next call, on every rank
    started = time.monotonic()
    try:
        ckpt.wait()
        result["error"] = None
    except Exception as exc:
        result.update(error_report(exc, started))
    checkpoint_module.write_file = real
    ckpt.close()
    fresh_model, fresh, fresh_opt, *_ = build(seed=5)
    ddpckpt.load(os.path.join(args.ckpt, "step-00000001"), model=fresh, optimizer=fresh_opt)
    result["loaded_digest"] = digest(fresh_model, fresh_opt)
    dist.barrier()
    result["listing"] = listing(args.ckpt)
    return result


def scenario_wait_cycle(args, rank: int) -> dict[str, Any]:
    """Ranks waiting for each other (rank 0 in one exchange, rank 1 in another) must time out."""
    from ddpckpt._coord.comm import Comm

    outcomes = []
    for delay in (0.0, 1.55):  # 1.55 s used to keep both ranks alive forever
        started = time.monotonic()
        comm = Comm.open("test.cycle", timeout=3.0)
        try:
            if rank == 0:
                comm.barrier(f"a{delay}")
            else:
                time.sleep(delay)  # still working when rank 0 starts waiting
                comm.barrier(f"b{delay}")
            outcomes.append({"delay": delay, "error": None})
        except Exception as exc:
            outcomes.append({"delay": delay, **error_report(exc, started)})
        finally:
            comm.close()
    return {"outcomes": outcomes}


def scenario_per_rank_state(args, rank: int) -> dict[str, Any]:
    """State that is not replicated: DDP-ignored weights, a rank-0-only EMA, plain models."""
    warnings = Warnings()

    def objects(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["2.bias"])
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
        return model, ddp, opt, torch.optim.swa_utils.AveragedModel(model)

    def ema_digest(ema: nn.Module) -> str:
        return digest(ema, torch.optim.SGD(ema.parameters(), lr=1))

    model, ddp, opt, ema = objects(0)
    with torch.no_grad():
        model[2].bias.fill_(float(rank))  # DDP ignores it: each rank has its own
    torch.manual_seed(10 + rank)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        if rank == 0:
            ema.update_parameters(model)  # a common mistake: the EMA differs between ranks
    saved = {"ddp": digest(model, opt), "ema": ema_digest(ema)}
    ddpckpt.save(os.path.join(args.ckpt, "ddp"), model=ddp, optimizer=opt, extra={"ema": ema})
    import ddpckpt._coord.consistency as consistency

    hashed_on: set[str] = set()  # the threads that compared the EMA across ranks
    real_differing = consistency._differing

    def differing(comm, tensors, call, names):
        if any(n.startswith("extra/ema/") for n in names):
            hashed_on.add(threading.current_thread().name.split()[0])
        return real_differing(comm, tensors, call, names)

    consistency._differing = differing
    pending = ddpckpt.save(os.path.join(args.ckpt, "ddp-async"), model=ddp, optimizer=opt,
                           extra={"ema": ema}, async_save=True)  # fmt: skip
    if rank == 0:
        ema.update_parameters(model)  # after save(): not in the checkpoint
    pending.wait()
    consistency._differing = real_differing

    def batchnorm(seed: int):  # an EMA of a BatchNorm model, updated on every rank
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        ddp = DDP(model)
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )
        return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), ema

    bn_model, bn_ddp, bn_opt, bn_ema = batchnorm(11)
    torch.manual_seed(20 + rank)  # each rank's own batch: its own BatchNorm statistics
    bn_ddp(torch.randn(6, 4)).sum().backward()
    bn_opt.step()
    bn_ema.update_parameters(bn_model)  # copies this rank's statistics (use_buffers=False)
    saved["ema_bn"] = ema_digest(bn_ema)
    ddpckpt.save(os.path.join(args.ckpt, "ema_bn"), model=bn_ddp, optimizer=bn_opt,
                 extra={"ema": bn_ema})  # fmt: skip

    torch.manual_seed(rank)  # each rank trains its own plain model
    plain = nn.Linear(4, 2)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.randn(3, 4)).sum().backward()
    plain_opt.step()
    saved["plain"] = digest(plain, plain_opt)
    ddpckpt.save(os.path.join(args.ckpt, "plain"), model=plain, optimizer=plain_opt)

    torch.manual_seed(7)  # the same on every rank: verified, then stored once
    same = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    saved["same"] = digest(same, torch.optim.SGD(same.parameters(), lr=1))
    ddpckpt.save(os.path.join(args.ckpt, "same"), model=same)
    astray, astray_ddp, astray_opt, _ = objects(3)
    with torch.no_grad():
        for param in astray.parameters():
            param.add_(0.5 * rank)  # this rank's replica went astray: DDP no longer agrees
    saved["diverged"] = digest(astray, astray_opt)
    ddpckpt.save(os.path.join(args.ckpt, "diverged"), model=astray_ddp, optimizer=astray_opt)
    saved_warnings = list(warnings.messages)

    model, ddp, opt, ema = objects(5)
    ddpckpt.load(os.path.join(args.ckpt, "ddp-async"), model=ddp, optimizer=opt, extra={"ema": ema})
    loaded_async = {"ddp": digest(model, opt), "ema": ema_digest(ema)}
    model, ddp, opt, ema = objects(5)
    ddpckpt.load(os.path.join(args.ckpt, "ddp"), model=ddp, optimizer=opt, extra={"ema": ema})
    _, bn_ddp, bn_opt, bn_ema = batchnorm(12)
    ddpckpt.load(os.path.join(args.ckpt, "ema_bn"), model=bn_ddp, optimizer=bn_opt,
                 extra={"ema": bn_ema})  # fmt: skip
    plain = nn.Linear(4, 2)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    ddpckpt.load(os.path.join(args.ckpt, "plain"), model=plain, optimizer=plain_opt)
    same_again = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    ddpckpt.load(os.path.join(args.ckpt, "same"), model=same_again)
    astray, astray_ddp, astray_opt, _ = objects(6)
    ddpckpt.load(os.path.join(args.ckpt, "diverged"), model=astray_ddp, optimizer=astray_opt)
    with open(os.path.join(args.ckpt, "same", "manifest.json")) as f:
        writers = sorted({f["writer"] for n, f in json.load(f)["files"].items() if "model" in n})
    return {
        "saved": saved,
        "loaded": {
            "ddp": digest(model, opt),
            "ema": ema_digest(ema),
            "ema_bn": ema_digest(bn_ema),
            "plain": digest(plain, plain_opt),
            "same": digest(same_again, torch.optim.SGD(same_again.parameters(), lr=1)),
            "diverged": digest(astray, astray_opt),
        },
        "loaded_async": loaded_async,
        "ema_hashed_on": sorted(hashed_on),
        "same_writers": writers,
        "warnings": saved_warnings,
    }


def scenario_failing_saves(args, rank: int) -> dict[str, Any]:
    """A Checkpointer whose saves fail on every rank, then on rank 1 only (no logging set up)."""
    _model, ddp, opt, *_ = build(seed=0)
    ckpt = ddpckpt.Checkpointer(args.ckpt, model=ddp, optimizer=opt, retries=0, timeout=60)
    ckpt.save(1)
    real = checkpoint_module.write_file

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    checkpoint_module.write_file = full
    first = ckpt.save(2)  # every rank's disk is full
    if rank == 0:
        checkpoint_module.write_file = real
    second = ckpt.save(3)  # only rank 1's
    checkpoint_module.write_file = real
    ckpt.close()
    return {"results": [first, second], "failed_saves": ckpt.failed_saves}


class _Injected:
    """Makes one function of a module fail on one rank, noting when it failed."""

    def __init__(self) -> None:
        self.failed_at: float | None = None

    def failing(self, error: BaseException):
        def fail(*a, **k):
            self.failed_at = time.time()
            raise error

        return fail


def scenario_one_rank_fails(args, rank: int) -> dict[str, Any]:
    """One ddpckpt call per phase of a save or load, each failing on one rank only (a
    different one from phase to phase): what every rank raised, and when."""
    import ddpckpt._io.load as load_module
    import ddpckpt._io.planning as planning_module
    import ddpckpt._io.staging as staging_module
    import ddpckpt._run.saving as saving_module
    from ddpckpt._io.async_saver import DEFAULT_SAVER

    _model, ddp, opt, sched, scaler, counter = build(seed=0)
    train(ddp, opt, sched, scaler, counter, 1)
    good = ddpckpt.save(os.path.join(args.ckpt, "good"), model=ddp, optimizer=opt, step=1)
    warnings = Warnings()
    interrupt = KeyboardInterrupt()
    enomem = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
    phases = {  # phase: (failing rank, module, function, what it raises)
        "staging": (1, DEFAULT_SAVER.pool, "stage", enomem),
        "planning": (2, planning_module, "plan_owners", enomem),
        "writing": (1, checkpoint_module, "write_file", OSError(errno.ENOSPC, "No space left")),
        "fences": (2, staging_module.Fence, "wait", RuntimeError("CUDA error: illegal access")),
        "commit": (0, checkpoint_module, "_commit", OSError(errno.EIO, "Input/output error")),
        "retention": (0, saving_module, "apply_retention", interrupt),
        "load": (2, load_module, "restore_objects", interrupt),
    }
    run_dir = os.path.join(args.ckpt, "run")
    ckpt = ddpckpt.Checkpointer(run_dir, model=ddp, optimizer=opt, keep_last=1)
    ckpt.save(1)
    actions = {
        "staging": lambda path: ddpckpt.save(path, model=ddp, optimizer=opt, async_save=True),
        "fences": lambda path: ddpckpt.save(path, model=ddp, optimizer=opt, async_save=True),
        "retention": lambda path: ckpt.save(2),
        "load": lambda path: ddpckpt.load(good, model=ddp, optimizer=opt),
    }
    results: dict[str, Any] = {}
    for name, (victim, owner, attr, error) in phases.items():
        injected = _Injected()
        real = getattr(owner, attr)
        if rank == victim:
            setattr(owner, attr, injected.failing(error))
        warnings.messages.clear()
        started = time.monotonic()
        try:
            action = actions.get(name, lambda path: ddpckpt.save(path, model=ddp, optimizer=opt))
            returned = action(os.path.join(args.ckpt, name))
            if hasattr(returned, "wait"):
                returned.wait()
            outcome: dict[str, Any] = {"error": None}
        except BaseException as exc:  # KeyboardInterrupt on the rank it was injected on
            outcome = error_report(exc, started)
        outcome["ended"] = time.time()
        outcome["failed_at"] = injected.failed_at
        outcome["warnings"] = list(warnings.messages)
        setattr(owner, attr, real)
        results[name] = outcome
        dist.barrier()
    ckpt.close()
    return results


def scenario_s3_outage(args, rank: int) -> dict[str, Any]:
    """A Checkpointer on S3 (one retry per request) whose server stops answering while step 2
    is uploaded (the test's s3server.Outage): every rank is told, training goes on."""
    _model, ddp, opt, sched, scaler, counter = build(seed=0)
    options = {"connect_timeout": 2, "read_timeout": 5, "max_attempts": 1}
    ckpt = ddpckpt.Checkpointer(
        args.ckpt, model=ddp, optimizer=opt, retries=0, timeout=60, storage_options=options
    )
    first = ckpt.save(1)
    train(ddp, opt, sched, scaler, counter, 1)
    second = ckpt.save(2)  # on_error="warn": returns None
    train(ddp, opt, sched, scaler, counter, 2)  # the ranks still train together
    error = ckpt.last_error
    ckpt.close()
    return {
        "saved": [first, second],
        "error": type(error).__name__,
        "message": str(error),
        "failed_saves": ckpt.failed_saves,
        "trained": counter.n,
    }


def model_digest(model: nn.Module) -> str:
    hasher = xxhash.xxh3_64()
    for name, value in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _publish(path: str, text: str) -> None:
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def scenario_trainer(args, rank: int) -> dict[str, Any]:
    """Save every step (keep_last=2) until an evaluator has loaded a few checkpoints."""
    model, ddp, opt, sched, scaler, counter = build(seed=0)
    ckpt = ddpckpt.Checkpointer(args.ckpt, model=ddp, optimizer=opt, keep_last=2, every_steps=1,
                                on_error="raise", timeout=60)  # fmt: skip
    loads = os.path.join(args.shared, "loads")
    step, stop = 0, [False]
    while not stop[0]:
        step += 1
        train(ddp, opt, sched, scaler, counter, 1)
        if rank == 0:
            _publish(os.path.join(args.shared, f"digest-{step}"), model_digest(model))
        assert ckpt.should_save(step)
        ckpt.save(step)
        if rank == 0:
            seen = int(open(loads).read()) if os.path.exists(loads) else 0  # noqa: SIM115
            stop = [(step >= args.steps and seen >= 3) or step >= 400]
        dist.broadcast_object_list(stop)
    ckpt.close()
    if rank == 0:
        _publish(os.path.join(args.shared, "done"), str(step))
    return {"steps": step, "failed_saves": ckpt.failed_saves, "last_error": repr(ckpt.last_error)}


def scenario_evaluator(args, rank: int) -> dict[str, Any]:
    """Resume read-only, again and again, from the run the trainer is writing."""
    import shutil

    run = os.path.abspath(args.ckpt)
    changes: list[str] = []

    def audited(name: str, module: Any = os) -> None:
        real = getattr(module, name)

        def call(*a, **k):
            flags = a[1] if name == "open" and len(a) > 1 else 0
            writes = name != "open" or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writes and os.path.abspath(str(a[0])).startswith(run):
                changes.append(f"{name} {a[0]}")
            return real(*a, **k)

        setattr(module, name, call)

    for name in ("open", "rename", "replace", "unlink", "rmdir", "mkdir", "utime"):
        audited(name)
    audited("rmtree", shutil)
    model, ddp, *_ = build(seed=1)
    done = os.path.join(args.shared, "done")
    loaded: list[int] = []
    mismatched: list[int] = []
    while not os.path.exists(done):  # the trainer stops once this has loaded a few
        reader = ddpckpt.Checkpointer(args.ckpt, model=ddp, read_only=True, timeout=60)
        info = reader.resume()
        reader.close()
        if info is None:  # the trainer has not saved yet
            time.sleep(0.05)
            continue
        with open(os.path.join(args.shared, f"digest-{info.step}")) as f:
            if f.read() != model_digest(model):
                mismatched.append(info.step)
        loaded.append(info.step)
        if rank == 0:
            _publish(os.path.join(args.shared, "loads"), str(len(loaded)))
    return {"loaded": loaded, "mismatched": mismatched, "changes": changes}


def scenario_failed_async_asked_on_one_rank(args, rank: int) -> dict[str, Any]:
    """A background save fails on every rank; only rank 0 asks its handle (or waits on its
    Checkpointer). The next collective call must take the same path on both ranks."""
    _model, ddp, opt, *_ = build(seed=0)
    real = checkpoint_module.write_file

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    checkpoint_module.write_file = full
    pending = ddpckpt.save(os.path.join(args.ckpt, "a"), model=ddp, optimizer=opt,
                           async_save=True, timeout=args.timeout)  # fmt: skip
    if rank == 0:
        asked = repr(pending.exception())  # the usual "log it on rank 0" pattern
    checkpoint_module.write_file = real
    outcomes: dict[str, Any] = {}
    try:
        ddpckpt.save(os.path.join(args.ckpt, "b"), model=ddp, optimizer=opt, timeout=args.timeout)
        outcomes["next_save"] = "saved"
    except ddpckpt.CheckpointError as exc:
        outcomes["next_save"] = type(exc).__name__
    ddpckpt.save(os.path.join(args.ckpt, "c"), model=ddp, optimizer=opt, timeout=args.timeout)
    outcomes["third_save"] = ddpckpt.verify(os.path.join(args.ckpt, "c")).path

    ckpt = ddpckpt.Checkpointer(os.path.join(args.ckpt, "run"), model=ddp, optimizer=opt,
                                async_save=True, on_error="raise", retries=0,
                                timeout=args.timeout)  # fmt: skip
    checkpoint_module.write_file = full
    ckpt.save(1)
    if rank == 0:
        try:
            ckpt.wait()  # local: rank 0 alone learns of the failure here
        except ddpckpt.CheckpointWriteError:
            outcomes["rank0_wait"] = "raised"
    checkpoint_module.write_file = real
    try:
        ckpt.save(2)
        outcomes["checkpointer_next_save"] = "saved"
    except ddpckpt.CheckpointError as exc:
        outcomes["checkpointer_next_save"] = type(exc).__name__
    ckpt.save(3)
    ckpt.close()
    outcomes["checkpointer_steps"] = ckpt.steps()
    if rank == 0:
        outcomes["asked"] = asked
    return outcomes


class ByteCountingStore:
    """A store client counting the bytes of every value it sets or reads (and its clones')."""

    def __init__(self, store: Any, counted: list[int]) -> None:
        self._store, self.counted = store, counted

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counting(*args: Any) -> Any:
            result = method(*args)
            for value in [*args, *(result if isinstance(result, list) else [result])]:
                if isinstance(value, (bytes, str)):
                    self.counted[0] += len(value)
            return result

        return counting

    def clone(self) -> ByteCountingStore:
        return ByteCountingStore(self._store.clone(), self.counted)


def scenario_store_bytes(args, rank: int) -> dict[str, Any]:
    """Bytes through the store for saves mid accumulation window, small model and large."""
    from ddpckpt._coord.store import default_group

    group = default_group()
    counted = [0]
    group.store = ByteCountingStore(group.store, counted)
    out: dict[str, Any] = {"store_bytes": {}, "grad_bytes": {}}
    for width in (8, 2048):
        model, ddp, *_ = build(seed=0, width=width)
        accumulation = ddpckpt.GradientAccumulation(ddp, steps=2)
        torch.manual_seed(rank)
        with accumulation.context():  # the first micro-step: gradients differ between ranks
            ddp(torch.randn(8, 16)).pow(2).mean().backward()
        accumulation.step()
        before = counted[0]
        ddpckpt.save(f"{args.ckpt}-{width}", model=ddp, extra={"acc": accumulation})
        out["store_bytes"][width] = counted[0] - before
        out["grad_bytes"][width] = sum(p.grad.nbytes for p in model.parameters())
        fresh, fresh_ddp, *_ = build(seed=1, width=width)
        fresh_acc = ddpckpt.GradientAccumulation(fresh_ddp, steps=2)
        ddpckpt.load(f"{args.ckpt}-{width}", model=fresh_ddp, extra={"acc": fresh_acc})
        pairs = zip(model.parameters(), fresh.parameters(), strict=True)
        out.setdefault("grads_restored", []).append(
            all(torch.equal(p.grad, q.grad) for p, q in pairs)
        )
    return out


def _ddp_gan(seed: int) -> ddpckpt.TrainingState:
    torch.manual_seed(seed)
    gen = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
    disc = DDP(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1)),
        broadcast_buffers=False,  # each rank keeps its own BatchNorm statistics
    )
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)
    return ddpckpt.TrainingState(
        G=gen, D=disc, opt_G=opt_g, opt_D=opt_d,
        sched_G=torch.optim.lr_scheduler.StepLR(opt_g, 2, gamma=0.5),
        sched_D=torch.optim.lr_scheduler.MultiStepLR(opt_d, [1, 3], gamma=0.1),
    )  # fmt: skip


def gan_steps(state: ddpckpt.TrainingState, steps: int) -> list[float]:
    """Train the GAN ``state`` (G, D, opt_G, opt_D, sched_G, sched_D); its generator losses."""
    losses = []
    for _ in range(steps):
        real, noise = torch.randn(6, 4), torch.randn(6, 4)
        state["opt_D"].zero_grad()
        d_loss = state["D"](real).mean() - state["D"](state["G"](noise).detach()).mean()
        d_loss.backward()
        state["opt_D"].step()
        state["opt_G"].zero_grad()
        g_loss = state["D"](state["G"](noise)).mean()
        g_loss.backward()
        state["opt_G"].step()
        state["sched_G"].step()
        state["sched_D"].step()
        losses.append(g_loss.item())
    return losses


def scenario_gan(args, rank: int) -> dict[str, Any]:
    """A DDP GAN saved as a TrainingState, resumed into fresh objects: same losses."""
    trained = _ddp_gan(seed=rank)  # DDP broadcasts rank 0's weights
    gan_steps(trained, 3)
    path = ddpckpt.save(args.ckpt, trained, step=3)
    uninterrupted = gan_steps(trained, 2)
    resumed = _ddp_gan(seed=10 + rank)
    ddpckpt.load(path, resumed)
    return {"same": gan_steps(resumed, 2) == uninterrupted, "losses": uninterrupted}


def lightning_checkpoint() -> dict[str, Any]:
    """A dict shaped as Lightning's checkpoint, from a few real training steps (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
    return {
        "epoch": 2,
        "global_step": 40,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3, "completed": 2}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
                "best_model_score": torch.tensor(0.25),
                "best_model_path": "checkpoints/epoch=1.ckpt",
                "best_k_models": {"checkpoints/epoch=1.ckpt": torch.tensor(0.25)},
            }
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 1e-2, "betas": (0.8, 0.9), "layers": [8, 2]},
    }


def same_tree(a: Any, b: Any) -> bool:
    """Equal values of equal types; tensors bit for bit, with dtype."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def scenario_dict_rank0(args, rank: int) -> dict[str, Any]:
    """Rank 0 alone saves a Lightning-shaped dict (as a CheckpointIO is called); every rank
    reads it back after a barrier."""
    expected = lightning_checkpoint()
    if rank == 0:
        ddpckpt.save_dict(args.ckpt, expected, step=expected["global_step"])
    dist.barrier()
    loaded = ddpckpt.load_dict(args.ckpt, map_location="cpu")
    return {"same": same_tree(loaded, expected), "keys": list(loaded)}


def scenario_copies_after_failure(args, rank: int) -> dict[str, Any]:
    """Node-local storage (memory:// is per process): rank 1 fails inside the copies step of
    save 1 (``--mode first``) or save 2 (``--mode second``); then every later save, a load
    and the user's own ``dist.new_group`` must still work."""
    import ddpckpt._io.settling as settling

    model = build(seed=args.seed)[0]
    real_send = settling.send_to_leaders
    calls = []

    def failing_send(comm, partners, bundle):
        calls.append(1)
        if comm.rank == 1 and len(calls) == (1 if args.mode == "first" else 2):
            raise RuntimeError("rank 1 fails before its send (simulated)")
        return real_send(comm, partners, bundle)

    settling.send_to_leaders = failing_send
    outcomes = []
    for step in (1, 2, 3):
        try:
            ddpckpt.save(
                f"memory://copies/step-{step}", model=model, step=step, timeout=args.timeout
            )
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    try:
        fresh = build(seed=args.seed + 1)[0]
        ddpckpt.load("memory://copies/step-3", model=fresh, timeout=args.timeout)
        exact = all(
            torch.equal(a, b)
            for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
        )
    except Exception as exc:
        exact = type(exc).__name__
    try:
        group = dist.new_group(timeout=timedelta(seconds=args.timeout))
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        user_group = float(total)
    except Exception as exc:
        user_group = type(exc).__name__
    return {"outcomes": outcomes, "exact": exact, "user_group": user_group}


def scenario_store_host_leaves_first(args, rank: int) -> dict[str, Any]:
    """The script ends after a save, or after a time-based Checkpointer.s last ``should_save``: rank
    0, whose process holds the store, ends as soon as its call returns, while the other ranks
    are a second behind (in leaving the save's call; in calling ``should_save``)."""
    from ddpckpt._coord.comm import Comm

    _, ddp, opt, *_ = build(seed=args.seed)
    if args.mode == "save":
        if rank != 0:
            leave = Comm.close

            def late(self, error=None):
                time.sleep(1.0)
                leave(self, error)

            Comm.close = late
        result = ddpckpt.save(args.ckpt, model=ddp, optimizer=opt, step=1)
    else:
        with ddpckpt.Checkpointer(args.ckpt, model=ddp, optimizer=opt, every_seconds=3600) as ckpt:
            for step in range(1, 4):
                if rank != 0 and step == 3:
                    time.sleep(1.0)
                result = ckpt.should_save(step)
    if rank == 0:
        with open(os.path.join(args.out, "rank-0.json"), "w") as f:
            json.dump({"result": result}, f)
        exit_now()
    return {"result": result}


SCENARIOS = {
    name.removeprefix("scenario_"): fn
    for name, fn in globals().items()
    if name.startswith("scenario_")
}


def run(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    result = SCENARIOS[args.scenario](args, rank)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def spawned(local_rank: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=local_rank, world_size=args.spawn,
    )  # fmt: skip
    run(args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default="ckpt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--storage", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--pg-timeout", type=float, default=60)
    parser.add_argument("--sleep", type=float, default=0)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--spawn", type=int, default=0)
    parser.add_argument("--mode", default="True")
    parser.add_argument("--shared", default=".")  # a directory concurrent launches both use
    parser.add_argument(
        "--local-rank", "--local_rank", type=int, default=None
    )  # torch.distributed.launch
    args = parser.parse_args()
    if args.spawn:
        torch.multiprocessing.spawn(spawned, args=(args,), nprocs=args.spawn, join=True)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    run(args)


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
