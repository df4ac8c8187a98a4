"""A complete training loop for the exact-resume acceptance tests (run under torchrun).

    exact_worker.py train RUN OUT --steps T --every K [--kill-at S] [--kill-after-epoch E]
        [--loader plain|persistent] [--schedule warmup|multistep] [--restart next|same]
    exact_worker.py coverage RUN OUT --batches B
    exact_worker.py two RUN OUT

Preemption (test_preemption.py): ``--preempt`` passes ``preemption=True``; ``--pause-at S``
stops after step S until OUT/go exists (the test sends its signals meanwhile; an
application handler installed before the Checkpointer appends each signal's name to
OUT/signalled-rank<r>);
``--hold-from S`` holds each save of step S or later before writing while OUT/hold exists.
``two``: two preemption-enabled Checkpointers, one closed early, then SIGUSR1 on rank 1 only;
writes OUT/two-rank<r>.json.

Dropout, BatchNorm, AdamW, a warm-up schedule, GradScaler, an EMA, gradient accumulation 2,
a shuffling ResumableDistributedSampler over 24 samples per rank (3 optimizer steps an epoch
at any world size) and a 2-worker loader with random augmentation
(a plain DataLoader over a SeededDataset, or one with persistent workers and its own generator), saved as the loader;
a checkpoint every K steps and one after each epoch's loop.
Each rank appends one JSON line per optimizer step to OUT/losses-rank<r>.jsonl and, at the
end, writes OUT/final-rank<r>.json with digests of everything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from exiting import exit_now


class Noisy(torch.utils.data.Dataset):
    """Fixed data, randomly augmented on every access."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i], torch.tensor(int(i))


def digest(*tensors: torch.Tensor) -> str:
    hasher = xxhash.xxh3_64()
    for t in tensors:
        hasher.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def make_loader(kind: str, data: Noisy) -> tuple[Any, Any]:
    """The two recipes, each saved as the loader: a plain DataLoader over a SeededDataset, or
    one that also keeps its workers between epochs and draws its order from its own generator."""
    sampler = ddpckpt.data.ResumableDistributedSampler(data, shuffle=True, seed=1)
    seeded = ddpckpt.data.SeededDataset(data, seed=1)
    if kind == "persistent":
        own = torch.Generator().manual_seed(1)
        return sampler, torch.utils.data.DataLoader(seeded, sampler=sampler, batch_size=4,
                                                    num_workers=2, persistent_workers=True,
                                                    generator=own)  # fmt: skip
    loader = torch.utils.data.DataLoader(seeded, sampler=sampler, batch_size=4, num_workers=2)
    return sampler, loader


def application_handler(out: str, rank: int) -> None:
    """What an application may have installed already: the Checkpointer chains to it."""

    def note(signum: int, frame: object) -> None:
        with Path(out, f"signalled-rank{rank}").open("a") as f:  # one line a signal
            f.write(f"{signal.Signals(signum).name}\n")

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, note)


def pause(out: str, rank: int) -> None:
    ready = Path(out, f"paused-rank{rank}.json")
    partial = ready.with_suffix(".partial")  # the test polls for the file: never half-written
    partial.write_text(json.dumps({"pid": os.getpid()}))
    partial.replace(ready)
    deadline = time.monotonic() + 120
    while not Path(out, "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never wrote 'go'")
        time.sleep(0.01)


def hold_saves(out: str, first: int) -> None:
    """Saves of step ``first`` and later wait before writing while OUT/hold exists."""
    import ddpckpt._run.saving as module

    write = module.write_and_commit

    def held(plan: Any, attempt: int) -> None:
        while plan.header["step"] >= first and Path(out, "hold").exists():
            time.sleep(0.01)
        write(plan, attempt)

    module.write_and_commit = held


def train(args: argparse.Namespace, rank: int) -> None:
    if args.preempt:
        application_handler(args.out, rank)
    if args.hold_from >= 0:
        hold_saves(args.out, args.hold_from)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    if args.schedule == "multistep":
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4, 8], gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    accumulation = ddpckpt.GradientAccumulation(ddp, steps=2)
    sampler, loader = make_loader(args.loader, Noisy(24 * dist.get_world_size()))
    torch.manual_seed(1234 + rank)  # dropout differs per rank
    extra = {"ema": ema, "loader": loader, "accumulation": accumulation}
    ckpt = ddpckpt.Checkpointer(args.run, model=ddp, optimizer=opt, scheduler=sched, scaler=scaler,
                                extra=extra, every_steps=args.every, keep_last=2, timeout=60,
                                preemption=args.preempt, async_save=args.async_save)  # fmt: skip
    info = ckpt.resume()
    step, start_epoch = (info.step, info.epoch) if info else (0, 0)
    saved = step  # the same step is not saved twice (a resumed finished epoch trains nothing)
    log = open(os.path.join(args.out, f"losses-rank{rank}.jsonl"), "a")  # noqa: SIM115
    window = 0.0
    for epoch in range(start_epoch, 100):
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            with accumulation.context():
                loss = (ddp(x) - y).pow(2).mean() / accumulation.steps
                scaler.scale(loss).backward()
            window += loss.item()
            if not accumulation.step():
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
            ema.update_parameters(model)
            step += 1
            log.write(
                json.dumps({"step": step, "loss": window, "lr": sched.get_last_lr()[0]}) + "\n"
            )
            log.flush()
            window = 0.0
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.pause_at:
                pause(args.out, rank)
            if ckpt.should_save(step):
                ckpt.save(step, epoch=epoch)
                saved = step
            if ckpt.preempted:
                break
            if step == args.steps:
                break
        if step == args.steps or ckpt.preempted:
            break
        if step == saved:
            continue
        # The imagenet pattern: a checkpoint once the epoch's loop is done. "next" stores the
        # epoch to start from (epoch + 1), "same" the finished one (its loop yields nothing).
        ckpt.save(step, epoch=epoch + 1 if args.restart == "next" else epoch)
        saved = step
        if epoch == args.kill_after_epoch:
            os.kill(os.getpid(), signal.SIGKILL)
    if ckpt.preempted:  # written before close(): a rank that exits first makes torchrun stop us
        record = {"step": step, "exit_code": ckpt.exit_code, "committed": ckpt.steps()}
        Path(args.out, f"preempted-rank{rank}.json").write_text(json.dumps(record))
        ckpt.close()
        dist.destroy_process_group()
        sys.exit(ckpt.exit_code)
    ckpt.close()
    state = opt.state_dict()["state"]
    final = {
        "step": step,
        "model": digest(*model.state_dict().values()),
        "optimizer": digest(*(v for s in state.values() for v in s.values())),
        "ema": digest(*ema.state_dict().values()),
        "scaler": scaler.state_dict(),
        "lr": sched.get_last_lr(),
    }
    with open(os.path.join(args.out, f"final-rank{rank}.json"), "w") as f:
        json.dump(final, f)


def coverage(args: argparse.Namespace, rank: int) -> None:
    """Consume ``--batches`` batches of epoch 0, saving after them; log every index seen."""
    model = nn.Linear(8, 1)
    data = Noisy(48)
    sampler = ddpckpt.data.ResumableDistributedSampler(data, shuffle=True, seed=7)
    seeded = ddpckpt.data.SeededDataset(data, seed=7)
    loader = torch.utils.data.DataLoader(seeded, sampler=sampler, batch_size=2, num_workers=2)
    ckpt = ddpckpt.Checkpointer(
        args.run, model=model, extra={"sampler": sampler, "loader": loader}, timeout=60
    )
    info = ckpt.resume()
    seen = []
    sampler.set_epoch(0)
    for batch, (_, _, index) in enumerate(loader, start=1):
        seen += index.tolist()
        if info is None and batch == args.batches:
            ckpt.save(1, epoch=0)
            break
    ckpt.close()
    with open(os.path.join(args.out, f"seen-{dist.get_world_size()}-rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def two(args: argparse.Namespace, rank: int) -> None:
    """Closing one Checkpointer leaves another alone; one signal preempts every live one."""

    def checkpointer(name: str) -> ddpckpt.Checkpointer:
        return ddpckpt.Checkpointer(
            os.path.join(args.run, name), model=nn.Linear(4, 4), every_steps=1000,
            preemption=True, timeout=60,
        )  # fmt: skip

    second = checkpointer("second")
    step = 0
    for phase in range(4):  # each closed one could wake the other's listener (a race: 4 tries)
        first = checkpointer(f"first{phase}")
        for _ in range(2):
            step += 1
            first.should_save(step)
            second.should_save(step)
        first.close()  # e.g. a first phase's Checkpointer; no signal anywhere
        for _ in range(3):  # time for a listener to act on anything close() wrote
            step += 1
            if second.should_save(step):
                second.save(step)
            time.sleep(0.2)
    alone = {"preempted": second.preempted, "steps": second.steps()}
    third = checkpointer("third")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # rank 0 hears nothing
    end = step + 400
    while not (second.preempted and third.preempted) and step < end:
        step += 1
        for ckpt in (second, third):
            if ckpt.should_save(step):
                ckpt.save(step)
        time.sleep(0.05)
    record = {"alone": alone, "step": step}
    for name, ckpt in (("second", second), ("third", third)):
        record[name] = {"preempted": ckpt.preempted, "steps": ckpt.steps()}
    Path(args.out, f"two-rank{rank}.json").write_text(json.dumps(record))
    third.close()
    second.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "coverage", "two"])
    parser.add_argument("run")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--loader", choices=["plain", "persistent"], default="plain")
    parser.add_argument("--schedule", choices=["warmup", "multistep"], default="warmup")
    parser.add_argument("--restart", choices=["next", "same"], default="next")
    parser.add_argument("--kill-after-epoch", type=int, default=-1)
    parser.add_argument("--preempt", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--hold-from", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    {"train": train, "coverage": coverage, "two": two}[args.mode](args, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's teardown: see exiting.py
