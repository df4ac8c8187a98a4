"""Runs crash-consistency trials; see test_crash.py.

    python crash_worker.py calibrate BASE OUT.json       # the events of clean runs, by scenario
    python crash_worker.py trials BASE SPEC.json OUT.json
    (under torchrun) python crash_worker.py train RUN ORACLE [SPEC-JSON] / resume RUN OUT

Single-process trials fork one child per attempt from this server, which imports torch
once and never computes itself (so forking is safe): child 1 trains and saves with a
fault armed, child 2 resumes and reports what it found.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import stat
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

import ddpckpt
from exiting import exit_now
from faults import Faults

STEPS = 5
KEEP = 2


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    hasher = xxhash.xxh3_64()
    for value in model.state_dict().values():
        hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in opt.state.values():
        for value in state.values():
            hasher.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def train(
    run: str,
    faults: Faults,
    steps: int = STEPS,
    read_only_at: int | None = None,
    overwrite: bool = False,
) -> None:
    """Train and save each step; with ``overwrite``, keep one checkpoint and save the first
    step twice (an every-N save, then an epoch-end save of the same step, after another
    batch): the second replaces the first; ``faults.window`` is the span of its events."""
    model, opt = build(0)
    ckpt = ddpckpt.Checkpointer(
        run, model=model, optimizer=opt, keep_last=1 if overwrite else KEEP, retries=0, timeout=20
    )
    info = ckpt.resume()
    faults.armed = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = (info.step + 1) if info else 1
    for step in range(first, steps + 1):
        for again in range(2 if overwrite and step == first else 1):
            torch.manual_seed(step * 10 + again * 5 + rank)
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            faults.note(f"digest {step} {digest(model, opt)}")
            if step == read_only_at:  # the storage turns read-only under a running job
                make_read_only(run, True)
            start = faults.count
            ckpt.save(step)
            if again:
                faults.window = (start, faults.count)
    faults.armed = False
    ckpt.close()


def resume(run: str) -> dict[str, Any]:
    model, opt = build(1)
    ckpt = ddpckpt.Checkpointer(run, model=model, optimizer=opt, keep_last=KEEP, timeout=20)
    try:
        info = ckpt.resume()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    ckpt.close()
    steps = sorted(int(n[5:]) for n in os.listdir(run) if n.startswith("step-") and "." not in n)
    verified = {}
    for step in steps:
        try:
            ddpckpt.verify(os.path.join(run, f"step-{step:08d}"))
            verified[step] = True
        except ddpckpt.CheckpointError:
            verified[step] = False
    leftovers = [n for n in os.listdir(run) if ".tmp-" in n]
    return {
        "step": info.step if info else None,
        "digest": digest(model, opt),
        "verified": verified,
        "leftovers": leftovers,
    }


def read_oracle(path: str) -> dict[str, Any]:
    """The steps committed, in order, and the digest of the state each one holds now (a
    step saved twice holds the state of its last commit)."""
    committed, digests, saved = [], {}, {}
    if os.path.exists(path):
        with open(path) as f:
            lines = f.read().splitlines()
        for line in lines:
            kind, value, *rest = line.split()
            if kind == "committed":
                step = str(int(value[5:]))
                committed.append(int(step))
                digests[step] = saved[step]
            else:
                saved[value] = rest[0]
    return {"committed": committed, "digests": digests}


def in_child(fn, *args) -> tuple[int, Any]:
    """Run ``fn(*args)`` in a forked child; returns its wait status and JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            result = fn(*args)
            os.write(write_end, json.dumps(result).encode())
        except BaseException as exc:  # report, then exit: a child must never return
            os.write(write_end, json.dumps({"crash": f"{type(exc).__name__}: {exc}"}).encode())
            code = 1
        os._exit(code)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 1 << 16):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return status, json.loads(b"".join(chunks) or b"null")


def calibrate(base: str, scenario: str) -> dict[str, Any]:
    """The events of a run without faults, and the window of its first overwrite."""
    faults = Faults(os.path.join(base, "oracle"))
    run = os.path.join(base, "run")

    def go() -> dict[str, Any]:
        faults.install()
        in_scenario(scenario)
        train(run, faults, **SCENARIOS[scenario])
        return {"events": faults.events, "window": faults.window}

    _, found = in_child(go)
    shutil.rmtree(base)
    return found


# "overwrite": step 1 saved twice, on a file system without RENAME_EXCHANGE (NFS, Lustre),
# where replacing step-N takes two renames
SCENARIOS: dict[str, dict[str, Any]] = {"save": {}, "overwrite": {"steps": 2, "overwrite": True}}


def in_scenario(scenario: str) -> None:
    """Set this (forked) process up for ``scenario``."""
    if scenario == "overwrite":
        os.environ["DDPCKPT_RENAME_EXCHANGE"] = "0"


def corrupt(run: str, kind: str, rng: random.Random) -> str:
    newest = sorted(n for n in os.listdir(run) if n.startswith("step-"))[-1]
    files = sorted(os.listdir(os.path.join(run, newest)))
    path = os.path.join(run, newest, rng.choice(files))
    size = os.path.getsize(path)
    if kind == "truncate":
        os.truncate(path, rng.randrange(size))
    else:
        offset, bit = rng.randrange(size), rng.randrange(8)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
    return os.path.relpath(path, run)


def make_read_only(path: str, on: bool) -> None:
    """chmod for ordinary users; root ignores modes, so also the immutable attribute."""
    chattr = os.geteuid() == 0 and shutil.which("chattr")
    if on:
        os.chmod(path, stat.S_IRUSR | stat.S_IXUSR)
    if chattr:
        subprocess.run(["chattr", "+i" if on else "-i", path], check=False, capture_output=True)
    if not on:
        os.chmod(path, stat.S_IRWXU)


def read_only_enforced(path: str) -> bool:
    probe = os.path.join(path, ".probe")
    try:
        open(probe, "w").close()
    except OSError:
        return True
    os.unlink(probe)
    return False


def trial(base: str, spec: dict[str, Any]) -> dict[str, Any]:
    run, oracle = os.path.join(base, "run"), os.path.join(base, "oracle")
    os.makedirs(base)
    action = spec["action"]
    note: str = ""
    if action in ("kill", "enospc", "erofs", "eio"):
        faults = Faults(oracle, at=spec["at"], action=action)

        def go() -> None:
            faults.install()
            in_scenario(spec.get("scenario", "save"))
            train(run, faults, **SCENARIOS[spec.get("scenario", "save")])

        status, _ = in_child(go)
        note = "killed" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
    elif action == "readonly":
        scratch = os.path.join(base, "scratch")
        os.makedirs(scratch)
        make_read_only(scratch, True)
        enforced = read_only_enforced(scratch)
        make_read_only(scratch, False)
        if not enforced:
            return {**spec, "skipped": "cannot make a directory read-only here"}
        faults = Faults(oracle)
        status, _ = in_child(lambda: (faults.install(), train(run, faults, read_only_at=STEPS))[1])
        make_read_only(run, False)
        note = f"exit {os.waitstatus_to_exitcode(status)}"
    else:
        faults = Faults(oracle)
        in_child(lambda: (faults.install(), train(run, faults))[1])
        note = corrupt(run, action, random.Random(spec["seed"]))
    found = in_child(resume, run)[1]
    return {**spec, "note": note, "oracle": read_oracle(oracle), "found": found}


def main() -> None:
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # optimizers import it lazily: once here, not per fork
    mode = sys.argv[1]
    if mode == "calibrate":
        found = {name: calibrate(os.path.join(sys.argv[2], name), name) for name in SCENARIOS}
        with open(sys.argv[3], "w") as f:
            json.dump(found, f)
    elif mode == "trials":
        with open(sys.argv[3]) as f:
            specs = json.load(f)
        results = [
            trial(os.path.join(sys.argv[2], f"trial-{i}"), spec) for i, spec in enumerate(specs)
        ]
        with open(sys.argv[4], "w") as f:
            json.dump(results, f)
    elif mode == "train":  # under torchrun
        dist.init_process_group("gloo")
        spec = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
        mine = spec.get("rank") == dist.get_rank()
        faults = Faults(
            sys.argv[3] + f".rank{dist.get_rank()}",
            at=spec["at"] if mine else None,
            action=spec.get("action", "kill"),
            match=spec.get("match"),
        )
        faults.install()
        scenario = spec.get("scenario", "save")
        in_scenario(scenario)
        train(sys.argv[2], faults, **SCENARIOS[scenario])
        with open(f"{sys.argv[3]}.events.rank{dist.get_rank()}", "w") as f:
            json.dump(faults.events, f)
        dist.destroy_process_group()
    elif mode == "resume":  # under torchrun
        dist.init_process_group("gloo")
        result = resume(sys.argv[2])
        with open(f"{sys.argv[3]}.rank{dist.get_rank()}", "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
