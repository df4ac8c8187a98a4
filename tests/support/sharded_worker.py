"""Scenarios with sharded state, run in every rank (see launch.py; same interface as
dist_worker.py): ZeRO-1 under DDP, FSDP2 per-layer ``fully_shard``, the DTensor
``replicate()`` and a 2 x 2 HSDP mesh.

    python sharded_worker.py SCENARIO --out DIR --ckpt ROOT

Checkpoints go under ROOT (``zero/``, ``fsdp/`` ...), with ``reference.pt`` (rank 0's
copy of the whole state at the last save, gathered with torch's own collectives) beside
them. Each scenario returns a JSON-able dict, written to ``DIR/rank-<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Partial
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from ddpckpt._format import filetable
from ddpckpt._resumecheck.digests import digest
from dist_worker import Warnings
from exiting import exit_now
from stored import shard_piece

SAVED_AT, KILLED_AT, END = 5, 7, 8  # the resumed run trains from SAVED_AT to END


def zero_run(seed: int = 0) -> tuple[nn.Module, DDP, Any, Any]:
    """DDP with ZeRO-1 AdamW: 2.1M parameters, 16.8 MB of optimizer state in all."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(2)))
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    return model, ddp, zero, torch.optim.lr_scheduler.StepLR(zero, step_size=2, gamma=0.5)


def fsdp_run(seed: int = 0, mesh: Any = None) -> tuple[nn.Module, nn.Module, Any, Any]:
    """FSDP2 (HSDP given a 2-D ``mesh``), one fully_shard per layer, uneven shard sizes."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(),
                          nn.Linear(7, 4))  # fmt: skip
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def replicate_run(seed: int = 0) -> tuple[nn.Module, nn.Module, Any, Any]:
    """The DTensor ``replicate()``: every parameter Replicate() on a 1-D mesh."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
    replicate(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(wrapped: nn.Module, opt: Any, sched: Any, steps: int, width: int) -> None:
    for _ in range(steps):
        loss = wrapped(torch.randn(8, width)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def fingerprint(model: nn.Module, opt: Any) -> str:
    """This rank's model shard, its optimizer state, learning rates and torch RNG, hashed."""
    hasher = xxhash.xxh3_64()
    for name, value in sorted(model.state_dict().items()):
        hasher.update(name.encode() + _local(value).detach().contiguous().numpy().tobytes())
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    names = {p: n for n, p in model.named_parameters()}
    for param, state in sorted(inner.state.items(), key=lambda kv: names[kv[0]]):
        for key, value in sorted(state.items()):
            hasher.update(f"{names[param]}.{key}".encode())
            hasher.update(_local(value).detach().contiguous().numpy().tobytes())
    hasher.update(repr([g["lr"] for g in opt.param_groups]).encode())
    hasher.update(torch.get_rng_state().numpy().tobytes())
    return hasher.hexdigest()


def full_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    """The whole state (collective), copied: model tensors and optimizer state by parameter
    name."""
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for name, value in model.state_dict().items():
        state["model"][name] = _whole(value).clone()
    names = [n for n, _ in model.named_parameters()]
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            for index, values in opt.state_dict()["state"].items():
                state["optim"][names[index]] = {k: v.clone() for k, v in values.items()}
        return state
    for name, param in model.named_parameters():
        values = opt.state[param]
        state["optim"][name] = {k: _whole(v).clone() for k, v in values.items()}
    return state


def same_as(reference: dict[str, Any], model: nn.Module, opt: Any) -> list[str]:
    """Where this rank's live state differs from its part of the whole ``reference``."""
    wrong = []
    for name, value in model.state_dict().items():
        if not torch.equal(_whole(value), reference["model"][name]):
            wrong.append(name)
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    for name, param in model.named_parameters():
        for key, value in inner.state.get(param, {}).items():
            if not torch.equal(_whole(value), reference["optim"][name][key]):
                wrong.append(f"{name}.{key}")
    return wrong


def _whole(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _save_measured(ckpt: ddpckpt.Checkpointer, step: int) -> int:
    """Save ``step``; the peak RSS it added over the RSS before (``VmHWM`` reset first)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _rss("VmRSS")
    ckpt.save(step)
    return _rss("VmHWM") - before


def scenario_save_then_die(args, rank: int) -> dict[str, Any]:
    """ZeRO-1 and FSDP2 runs each save at steps 3 and SAVED_AT (ZeRO's synchronously, with
    the peak memory the first adds; FSDP2's in overlap mode); the whole state at SAVED_AT goes to
    reference.pt; an unsupported DTensor is refused; then rank 1 is SIGKILLed mid-run."""
    result: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    for kind, build, width, mode in (("zero", zero_run, 1024, False),
                                     ("fsdp", fsdp_run, 16, "overlap")):  # fmt: skip
        model, wrapped, opt, sched = build()
        ckpt = ddpckpt.Checkpointer(os.path.join(args.ckpt, kind), model=wrapped, optimizer=opt,
                                    scheduler=sched, keep_last=2, async_save=mode)  # fmt: skip
        train(wrapped, opt, sched, 3, width)
        result[f"{kind}_save_extra_rss"] = _save_measured(ckpt, 3)
        train(wrapped, opt, sched, SAVED_AT - 3, width)
        ckpt.save(SAVED_AT)
        ckpt.wait()
        reference[kind] = full_state(model, opt)
        train(wrapped, opt, sched, 1, width)  # the step after the save: overlap's copies land
        ckpt.close()
        if kind == "zero":
            inner = opt.optim.state.values()
            result["zero_shard_bytes"] = sum(
                t.numel() * t.element_size() for s in inner for t in s.values()
            )
            result["zero_state_bytes"] = sum(p.numel() * 8 + 4 for p in model.parameters())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    pending = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    partial = ddpckpt.Checkpointer(os.path.join(args.ckpt, "partial"), model=nn.Linear(2, 2),
                                   extra={"pending": pending}, on_error="raise")  # fmt: skip
    try:
        partial.save(1)
    except ddpckpt.errors.UnsupportedValueError as exc:
        result["refused"] = str(exc)
    result["partial_listing"] = sorted(os.listdir(os.path.join(args.ckpt, "partial")))
    partial.close()
    if rank == 0:
        torch.save(reference, os.path.join(args.ckpt, "reference.pt"))
    _write(args, rank, result)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run, after the checkpoints
    dist.barrier()  # rank 0 waits here until the launcher ends it
    return result


def scenario_resume(args, rank: int) -> dict[str, Any]:
    """For each run: uninterrupted from scratch to END, then resumed by a Checkpointer from
    SAVED_AT to END; the two must match bit for bit."""
    result: dict[str, Any] = {}
    for kind, build, width in (("zero", zero_run, 1024), ("fsdp", fsdp_run, 16)):
        model, wrapped, opt, sched = build()
        train(wrapped, opt, sched, END, width)
        straight = fingerprint(model, opt)
        model, wrapped, opt, sched = build(seed=1)  # other weights: the load must replace them
        train(wrapped, opt, sched, 1, width)  # optimizer state of its own, overwritten in place
        with ddpckpt.Checkpointer(os.path.join(args.ckpt, kind), model=wrapped, optimizer=opt,
                                  scheduler=sched) as ckpt:  # fmt: skip
            info = ckpt.resume()
            result[f"{kind}_resumed_from"] = info.step
            result[f"{kind}_steps_kept"] = ckpt.steps()
        train(wrapped, opt, sched, END - info.step, width)
        result[f"{kind}_identical"] = fingerprint(model, opt) == straight
    return result


def _load_and_compare(path: str, build: Any, reference: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into a fresh run of ``build`` (other weights) on this
    world size; where its state differs from the whole ``reference``."""
    model, wrapped, opt, sched = build(seed=1)
    info = ddpckpt.load(path, model=wrapped, optimizer=opt, scheduler=sched)
    found = {"step": info.step, "wrong": same_as(reference, model, opt)}
    found["lr"] = opt.param_groups[0]["lr"]
    if isinstance(opt, ZeroRedundancyOptimizer):
        found["owns"] = len(opt.optim.state)
    return found


def _two_rank_loads(args) -> dict[str, Any]:
    """The ZeRO-1 and FSDP2 checkpoints saved on 2 ranks, loaded on this world size."""
    reference = torch.load(os.path.join(args.ckpt, "reference.pt"))
    return {
        kind: _load_and_compare(
            os.path.join(args.ckpt, kind, f"step-{SAVED_AT:08d}"), build, reference[kind]
        )
        for kind, build in (("zero", zero_run), ("fsdp", fsdp_run))
    }


def scenario_reshard(args, rank: int) -> dict[str, Any]:
    """On 3 ranks: the 2-rank checkpoints, the 4-rank HSDP one into FSDP2 on a 1-D mesh and
    the 4-rank ZeRO-1 one, each compared with the whole reference."""
    result = _two_rank_loads(args)
    for kind, build in (("hsdp", fsdp_run), ("zero4", zero_run)):
        reference = torch.load(os.path.join(args.ckpt, f"{kind}-reference.pt"))
        result[kind] = _load_and_compare(os.path.join(args.ckpt, kind), build, reference)
    return result


def scenario_four_ranks(args, rank: int) -> dict[str, Any]:
    """On 4 ranks: replicate(), HSDP on a 2 x 2 mesh and ZeRO-1 saved, loaded into fresh
    runs and compared (each reference kept for the 3-rank loads); then the 2-rank
    checkpoints loaded here."""
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # the files listed in tables of 2 ranks each, as a job of more than TABLE_RANKS ranks
    # lists them (format 7), so the loads on 4, 3 and 1 ranks read them
    filetable.TABLE_RANKS = 2
    result: dict[str, Any] = {}
    runs = (("replicate", replicate_run, 16), ("hsdp", lambda seed=0: fsdp_run(seed, hsdp), 16),
            ("zero4", zero_run, 1024))  # fmt: skip
    for kind, build, width in runs:
        model, wrapped, opt, sched = build()
        train(wrapped, opt, sched, 3, width)
        saved = fingerprint(model, opt)
        path = os.path.join(args.ckpt, kind)
        ddpckpt.save(path, model=wrapped, optimizer=opt, scheduler=sched, step=3)
        whole = full_state(model, opt)  # ZeRO's optimizer state only on rank 0
        if rank == 0:
            torch.save(whole, os.path.join(args.ckpt, f"{kind}-reference.pt"))
        dist.barrier()
        reference = torch.load(os.path.join(args.ckpt, f"{kind}-reference.pt"))
        model, wrapped, opt, sched = build(seed=1)
        ddpckpt.load(path, model=wrapped, optimizer=opt, scheduler=sched)
        result[f"{kind}_identical"] = fingerprint(model, opt) == saved
        result[f"{kind}_wrong"] = same_as(reference, model, opt)
        if kind == "hsdp":  # check-resume's digest of DTensors: this rank's shards
            state = {"model": model.state_dict(), "optim": opt.state_dict()["state"]}
            local = {"model": {k: _local(v) for k, v in state["model"].items()},
                     "optim": {i: {k: _local(v) for k, v in s.items()}
                               for i, s in state["optim"].items()}}  # fmt: skip
            result["hsdp_digest_local"] = digest(state) == digest(local)
    result["from_two"] = _two_rank_loads(args)
    return result


def _taken(warnings: Warnings) -> list[str]:
    """The warnings ``warnings`` collected so far, forgotten there."""
    taken = list(warnings.messages)
    warnings.messages.clear()
    return taken


def _batchnorm_statistics(args, rank: int, warnings: Warnings) -> dict[str, Any]:
    """A BatchNorm model under FSDP2 and under replicate(), one step on each rank's own
    batch (so each rank's statistics differ), saved and loaded back: the warning each save
    gives and whether each rank got its own statistics back."""
    found: dict[str, Any] = {}
    for kind, wrap in (("fsdp", fully_shard), ("replicate", replicate)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
        wrap(model)
        torch.manual_seed(100 + rank)
        model(torch.randn(8, 16)).sum().backward()
        own = model[1].running_mean.clone()
        path = os.path.join(args.ckpt, f"bn-{kind}")
        ddpckpt.save(path, model=model, step=1)
        found[f"{kind}_warnings"] = _taken(warnings)
        model[1].running_mean.zero_()
        ddpckpt.load(path, model=model)
        found[f"{kind}_own_statistics"] = torch.equal(model[1].running_mean, own)
    return found


def _damage_a_shard(step_dir: str, name: str) -> str:
    """Flip a byte of the piece of ``name`` that only rank 1 reads back; the file."""
    file, begin = shard_piece(step_dir, name, 1)
    with open(os.path.join(step_dir, file), "r+b") as f:
        f.seek(begin + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return file


def _resumed_to_end(root: str, straight: str, stepped: int = 0, **options: Any) -> dict[str, Any]:
    """A fresh FSDP2 run (other weights; trained ``stepped`` steps, so its optimizer has state
    to overwrite) resumed by a Checkpointer on ``root`` and trained to END: the step it resumed
    from, and whether it ends as the uninterrupted run did."""
    model, wrapped, opt, sched = fsdp_run(seed=1)
    train(wrapped, opt, sched, stepped, 16)
    with ddpckpt.Checkpointer(root, model=wrapped, optimizer=opt, scheduler=sched,
                              **options) as ckpt:  # fmt: skip
        info = ckpt.resume()
        steps = ckpt.steps()
    train(wrapped, opt, sched, END - info.step, 16)
    return {
        "resumed_from": info.step,
        "steps": steps,
        "identical": fingerprint(model, opt) == straight,
    }


def scenario_guarantees(args, rank: int) -> dict[str, Any]:
    """On 2 ranks, FSDP2 with the Checkpointer's guarantees: BatchNorm statistics under FSDP2
    and replicate() (the warning's advice); the newest checkpoint damaged (one rank's piece),
    so that resume falls back; a SIGUSR1 to rank 1 alone, whose preemption checkpoint is
    resumed; saves to S3 (the prefix in ``$SHARDED_S3_ROOT``) resumed. Each resume is compared with the
    uninterrupted run."""
    warnings = Warnings()
    result = _batchnorm_statistics(args, rank, warnings)
    model, wrapped, opt, sched = fsdp_run()
    train(wrapped, opt, sched, END, 16)
    straight = fingerprint(model, opt)
    for kind, root in (
        ("fallback", os.path.join(args.ckpt, "fallback")),
        ("s3", os.environ["SHARDED_S3_ROOT"]),
    ):
        model, wrapped, opt, sched = fsdp_run()
        with ddpckpt.Checkpointer(root, model=wrapped, optimizer=opt, scheduler=sched) as ckpt:
            for step in range(1, SAVED_AT + 1):
                train(wrapped, opt, sched, 1, 16)
                if step in (3, SAVED_AT):
                    ckpt.save(step)
        if kind == "fallback":
            dist.barrier()
            if rank == 0:
                # rank 1's moments of the last layer: read after the others, in place
                result["damaged"] = _damage_a_shard(
                    os.path.join(root, f"step-{SAVED_AT:08d}"), "optimizer/state/4.weight/exp_avg"
                )
            dist.barrier()
        _taken(warnings)
        result[kind] = _resumed_to_end(root, straight, stepped=2 if kind == "fallback" else 0)
        result[kind]["warnings"] = _taken(warnings)
    root = os.path.join(args.ckpt, "preempted")
    model, wrapped, opt, sched = fsdp_run()
    with ddpckpt.Checkpointer(root, model=wrapped, optimizer=opt, scheduler=sched,
                              every_steps=100, preemption=True) as ckpt:  # fmt: skip
        for step in range(1, END + 1):
            train(wrapped, opt, sched, 1, 16)
            if step == 4 and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler tells one node
            if ckpt.should_save(step):
                ckpt.save(step)
            if ckpt.preempted:
                break
        result["preempted"] = {"step": step, "exit_code": ckpt.exit_code}
    result["preemption"] = _resumed_to_end(root, straight)
    return result


def _write(args, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)


SCENARIOS = {
    name.removeprefix("scenario_"): fn
    for name, fn in globals().items()
    if name.startswith("scenario_")
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    _write(args, rank, SCENARIOS[args.scenario](args, rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
