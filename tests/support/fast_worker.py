"""A DDP job with a fast tier, run on two simulated nodes under torchrun with restarts
(tests/test_fast_tier.py).

    fast_worker.py train --out OUT --durable RUN --fast DIR --steps T
    fast_worker.py trust --out OUT --durable RUN --fast DIR --steps T

Each node's torchrun starts in its own directory (``node0``, ``node1``), holding its fast tier
at the relative ``--fast DIR``; the durable run directory ``RUN`` is shared. Dropout,
BatchNorm, AdamW, a StepLR schedule and a plain DataLoader over a shuffling
ResumableDistributedSampler (8 optimizer steps an epoch on 4 ranks or more), saved as the loader; the durable
tier every 4 steps and after each epoch's loop, the fast tier every step.

Events, each at the start of a step (inside an epoch) and once (a marker file in OUT):

* ``--crash S``: the last rank waits for the fast tier's save of step S-1, then SIGKILLs itself;
* ``--replace S``: node 1's first rank waits the same, deletes its node's fast tier (a node
  replaced), then SIGKILLs itself;
* ``--lose-both S``: every rank waits, each node's first rank deletes its fast tier, then the
  last rank SIGKILLs itself;
* ``--lose-nodes S`` (with ``--lost N1,N2``): as ``--lose-both``, for the nodes listed;
* ``--partners K``: ``FastTier(partners=K)``; each node's first rank records, at the end,
  the rank files its node's newest fast-tier step holds (OUT/kept-node<n>.json);
* ``--full S1,S2``: node 1's fast tier refuses the files of those steps' saves (ENOSPC);
* ``--kill-in-save JSON``: a list of ``{"step", "rank", "match", "at"}``: in the save of
  that (fast-tier only) step, that rank SIGKILLs itself before the ``at``-th file-system
  operation matching ``match`` (:class:`faults.Faults`, counting from the ``mkdir`` of the
  step's temporary directory), maybe on the background thread writing it.

``trust``: a plain job (resume, then a save at every step the Checkpointer asks for) whose
nodes' fast tiers the test prepared (a damaged marker, say); each rank writes what it resumed
from, what each save returned and the library's warnings and errors to
OUT/trust-rank<r>.json.

Every rank logs each checkpoint committed (a rename of a temporary onto ``step-N``, either
tier) to OUT/oracle-rank<r>, independently of the library.

Each rank appends its loss per step to OUT/losses-rank<r>.jsonl, writes what each resume
restored to OUT/resumed-<step>-rank<r>.json (with the warnings logged up to then and the
newest step the oracles saw committed before it; every resume in order in
OUT/resumes-rank<r>.jsonl), the file-system operations of its last start to
OUT/events-rank<r>.json and, once
at the end, OUT/final-rank<r>.json: the digest of its state and the losses and digest of an
uninterrupted run of the same job in the same processes.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from ddpckpt._format import filetable
from ddpckpt.storage._posix import PosixStorage
from exiting import exit_now
from faults import Faults

STEPS_PER_EPOCH, BATCH = 8, 4


class Messages(logging.Handler):
    """The library's warnings and errors on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("ddpckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def build(world: int, rank: int) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    # one dataset for any world up to 4 ranks (a resume at another world size sees the same
    # data); larger worlds get as many samples per rank, so an epoch is 8 steps at any size
    x = torch.randn(max(4, world) * STEPS_PER_EPOCH * BATCH, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = ddpckpt.data.ResumableDistributedSampler(data, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=BATCH)
    torch.manual_seed(1234 + rank)  # dropout differs per rank
    return model, ddp, opt, sched, sampler, loader


def train_step(ddp: nn.Module, opt: Any, sched: Any, batch: Any) -> float:
    inputs, targets = batch
    loss = nn.functional.mse_loss(ddp(inputs), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item()


def digest(model: nn.Module, opt: Any) -> str:
    hasher = xxhash.xxh3_64()
    for value in [*model.state_dict().values(), torch.get_rng_state()]:
        hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in opt.state.values():
        for value in state.values():
            hasher.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def refuse_files(fast: str, steps: list[int]) -> None:
    """This node's fast tier is full for the saves of ``steps``: creating their files fails."""
    create = PosixStorage.create
    marks = tuple(f".step-{s:08d}.tmp" for s in steps)
    root = os.path.abspath(fast)

    def full(self: PosixStorage, location: str) -> Any:
        if os.path.abspath(location).startswith(root) and any(m in location for m in marks):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), location)
        return create(self, location)

    PosixStorage.create = full  # type: ignore[method-assign]


def event(args: argparse.Namespace, step: int, ckpt: Any, node: int, local: int) -> None:
    """The crash, replacement or loss planned at the start of ``step``, once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    events = ("crash", "replace", "lose_both", "lose_nodes")
    name = next((n for n in events if getattr(args, n) == step), None)
    marker = Path(args.out, f"event-{name}")
    if name is None or marker.exists():
        return
    if name == "crash" and rank != world - 1:
        return
    if name == "replace" and (node, local) != (1, 0):
        return
    ckpt.wait()  # the fast tier holds step - 1 on every node
    if name in ("lose_both", "lose_nodes"):
        lost = name == "lose_both" or str(node) in args.lost.split(",")
        dist.barrier()
        if local == 0 and lost:
            shutil.rmtree(args.fast)
        dist.barrier()
        if rank != world - 1:
            return
    elif name == "replace":
        shutil.rmtree(args.fast)
    marker.write_text(str(step))
    os.kill(os.getpid(), signal.SIGKILL)


def newest_committed(out: str) -> int | None:
    """The newest step any rank's oracle saw committed (in either tier)."""
    steps = [
        int(line.split()[1].removeprefix("step-"))
        for oracle in Path(out).glob("oracle-rank*")
        for line in oracle.read_text().splitlines()
        if line.startswith("committed ")
    ]
    return max(steps, default=None)


def arm(faults: Faults, args: argparse.Namespace, step: int, rank: int) -> None:
    """Arm the kill planned in the save of ``step`` on this rank, once."""
    for plan in json.loads(args.kill_in_save):
        marker = Path(args.out, f"kill-{plan['step']}")
        if plan["step"] == step and plan["rank"] == rank and not marker.exists():
            marker.write_text(plan["match"])
            faults.at, faults.fired = plan["at"], False
            faults.match = re.compile(plan["match"])
            faults.after = re.compile(rf"mkdir \.step-{step:08d}\.tmp-\S+")


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local = int(Path.cwd().name.removeprefix("node")), int(os.environ["LOCAL_RANK"])
    messages = Messages()
    committed = newest_committed(args.out)
    faults = Faults(str(Path(args.out, f"oracle-rank{rank}")))
    faults.install()
    faults.armed = True
    if node == 1 and args.full:
        refuse_files(args.fast, [int(s) for s in args.full.split(",")])
    model, ddp, opt, sched, sampler, loader = build(world, rank)
    ckpt = ddpckpt.Checkpointer(
        args.durable, model=ddp, optimizer=opt, scheduler=sched, extra={"loader": loader},
        every_steps=4, keep_last=2, timeout=60,
        fast_tier=ddpckpt.FastTier(args.fast, partners=args.partners),
    )  # fmt: skip
    info = ckpt.resume()
    step, start_epoch = (info.step, info.epoch) if info else (0, 0)
    seen = {"path": info and info.path, "node": node, "messages": messages.lines}
    seen["committed"] = committed
    Path(args.out, f"resumed-{step}-rank{rank}.json").write_text(json.dumps(seen))
    with open(Path(args.out, f"resumes-rank{rank}.jsonl"), "a") as every:  # in order
        every.write(json.dumps({"step": step, **seen}) + "\n")
    losses = open(Path(args.out, f"losses-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for epoch in range(start_epoch, args.steps // STEPS_PER_EPOCH + 1):
        if step == args.steps:  # resumed from the last step
            break
        sampler.set_epoch(epoch)
        for batch in loader:
            event(args, step + 1, ckpt, node, local)
            step += 1
            losses.write(json.dumps({"step": step, "loss": train_step(ddp, opt, sched, batch)}))
            losses.write("\n")
            losses.flush()
            if ckpt.should_save(step):
                arm(faults, args, step, rank)
                ckpt.save(step, epoch=epoch)
            if step == args.steps:
                break
        if step == args.steps:
            break
        ckpt.save(step, epoch=epoch + 1)
    ckpt.close()
    faults.uninstall()
    if local == 0:
        newest = max(Path(args.fast).glob("step-*"))
        kept = sorted(p.name for p in newest.glob("rank-*"))
        Path(args.out, f"kept-node{node}.json").write_text(json.dumps(kept))
    Path(args.out, f"events-rank{rank}.json").write_text(json.dumps(faults.events))
    final = {"digest": digest(model, opt), "messages": messages.lines, "step": step}
    final["reference"] = uninterrupted(args.steps, world, rank)
    Path(args.out, f"final-rank{rank}.json").write_text(json.dumps(final))


def trust(args: argparse.Namespace) -> None:
    """The ``trust`` mode (see the module docstring): nothing here may raise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    messages = Messages()
    _model, ddp, opt, sched, _sampler, loader = build(world, rank)
    ckpt = ddpckpt.Checkpointer(
        args.durable, model=ddp, optimizer=opt, every_steps=4, timeout=60,
        fast_tier=ddpckpt.FastTier(args.fast),
    )  # fmt: skip
    info = ckpt.resume()
    step, saved = info.step if info else 0, []
    for batch in loader:
        step += 1
        train_step(ddp, opt, sched, batch)
        if ckpt.should_save(step):
            saved.append(ckpt.save(step))
        if step == args.steps:
            break
    ckpt.close()
    seen = {"resumed": info and info.path, "step": step, "saved": saved}
    Path(args.out, f"trust-rank{rank}.json").write_text(
        json.dumps({**seen, "messages": messages.lines})
    )


def uninterrupted(steps: int, world: int, rank: int) -> dict[str, Any]:
    """The same job without a checkpoint or a restart: its losses and final digest."""
    model, ddp, opt, sched, sampler, loader = build(world, rank)
    losses, step = {}, 0
    for epoch in range(steps // STEPS_PER_EPOCH + 1):
        sampler.set_epoch(epoch)
        for batch in loader:
            step += 1
            losses[str(step)] = train_step(ddp, opt, sched, batch)
            if step == steps:
                return {"losses": losses, "digest": digest(model, opt)}
    raise AssertionError("the epochs ended before the steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "trust"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--durable", required=True)
    parser.add_argument("--fast", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--crash", type=int, default=-1)
    parser.add_argument("--replace", type=int, default=-1)
    parser.add_argument("--lose-both", type=int, default=-1)
    parser.add_argument("--lose-nodes", type=int, default=-1)
    parser.add_argument("--lost", default="")
    parser.add_argument("--partners", type=int, default=1)
    parser.add_argument("--full", default="")
    parser.add_argument("--kill-in-save", default="[]")
    parser.add_argument("--table-ranks", type=int, default=0, help="file tables of so many ranks")
    args = parser.parse_args()
    if args.table_ranks:  # a job of thousands of ranks' layout (format 7), on a few
        filetable.TABLE_RANKS = args.table_ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    (trust if args.mode == "trust" else train)(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
