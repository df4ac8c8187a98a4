"""The whole check: the reference run, the kill points, one killed run per point, the verdict."""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._resumecheck.compare import PointResult, compare_point
from ddpckpt._resumecheck.leftovers import leftover_notes
from ddpckpt._resumecheck.records import Records
from ddpckpt._resumecheck.reference import open_reference, seal
from ddpckpt._resumecheck.runner import KillPoint, run

SEVERITY = {"exact": 0, "cannot-judge": 1, "different": 2}


@dataclass
class CheckReport:
    command: list[str]
    out: str
    world: int = 0
    mode: str = ""  # how steps are told apart: "checkpointer" or "plain"
    steps: list[int] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)  # step, epoch_end
    reference_seconds: float = 0.0
    reference_reused: str | None = None
    victim: int = 0
    points: list[PointResult] = field(default_factory=list)
    killed_runs: list[str] = field(default_factory=list)  # the directory of each point's run
    routes: list[dict[str, Any]] = field(default_factory=list)  # where the script's paths went
    notes: list[str] = field(default_factory=list)
    plot: str = ""
    # the killed rank's loss per step (log_step): {"rank", "reference": [[step, loss]],
    # "killed": per kill point, per process started, [[step, loss]]}; empty without losses
    losses: dict[str, Any] = field(default_factory=dict)
    loss_plot: str = ""

    @property
    def verdict(self) -> str:
        """``exact`` only when every point is; else the worst point's verdict."""
        if not self.points:
            return "cannot-judge"
        return max((p.verdict for p in self.points), key=SEVERITY.__getitem__)

    @property
    def identical(self) -> bool:
        return self.verdict == "exact"


def _reference_events(records: Records) -> list[dict[str, Any]]:
    if 0 not in records or not records[0]:
        raise RuntimeError("the uninterrupted run recorded nothing on rank 0")
    return records[0][0]


def step_offset(events: list[dict[str, Any]]) -> int:
    """How a plain loop numbers its steps: its saves' ``step=`` minus the recorder's count
    (0 when they disagree, or for a Checkpointer loop, which numbers steps itself). A save
    before the first step (the initial weights) says nothing about it."""
    offsets = {
        e["label"] - e["step"]
        for e in events
        if e["event"] == "save" and isinstance(e.get("label"), int) and e["step"] > 0
    }
    return offsets.pop() if len(offsets) == 1 else 0


def renumber(records: Records, offset: int) -> Records:
    """``records`` with every step in the script's own numbering."""
    if offset:
        for processes in records.values():
            for events in processes:
                for event in events:
                    for key in ("step", "after_step", "resumed_from"):
                        if isinstance(event.get(key), int):
                            event[key] += offset
    return records


def _loss_curve(events: list[dict[str, Any]]) -> list[list[Any]]:
    """``[step, loss]`` of each step that logged one number as its last loss."""
    curve = []
    for event in events:
        losses = (event.get("end") or {}).get("loss") if event["event"] == "step" else None
        if losses and isinstance(losses[-1], (int, float)):
            curve.append([event["step"], losses[-1]])
    return curve


def _saves(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"step": e["step"], "n": e["n"], "epoch_end": e.get("epoch_end")}
        for e in events
        if e["event"] == "save"
    ]


def default_kill_points(events: list[dict[str, Any]]) -> tuple[list[KillPoint], list[str]]:
    """A mid-epoch step after a mid-epoch save, and right after the first epoch-end save
    that more steps follow; and notes on what could not be chosen."""
    steps = [e["step"] for e in events if e["event"] == "step"]
    if not steps:
        raise RuntimeError(
            "the uninterrupted run recorded no step: check-resume ends a step at each "
            "should_save(step) of a Checkpointer (call it every step, as in every Checkpointer "
            "loop) or, in a loop of ddpckpt.save and ddpckpt.load, at each optimizer.step()"
        )
    last = steps[-1]
    saves = _saves(events)
    save_steps = sorted({s["step"] for s in saves})
    before_last = [s for s in save_steps if s < last]
    if not before_last:
        raise RuntimeError(
            f"the uninterrupted run saved no checkpoint before its last step ({last}), so a "
            "killed run has nothing to resume from: save more often (every_steps=) or run longer"
        )
    ends = sorted({s["step"] for s in saves if s["epoch_end"]})
    notes: list[str] = []
    middle = [s for s in before_last if s not in ends]
    base = middle[len(middle) // 2] if middle else before_last[0]
    following = next((s for s in save_steps if s > base), last + 1)
    points = [KillPoint(min(last, base + max(1, (following - base) // 2)))]
    ends_before_last = [s for s in ends if s < last]
    if ends_before_last:
        end = ends_before_last[0]
        count = max(s["n"] for s in saves if s["step"] == end)
        points.append(KillPoint(end, after_save=True, saves=count))
    elif any(s["epoch_end"] is not None for s in saves):
        notes.append(
            "no epoch-end save with steps after it was found (an epoch-end save is one made "
            "while a DataLoader it holds has finished its epoch), so only a kill inside an "
            "epoch was checked"
        )
    else:
        notes.append(
            "the checkpoints hold no DataLoader, so no save is known to end an epoch: only a "
            "kill between two saves was checked (--kill-at K:after-save adds one after a save)"
        )
    return points, notes


def _user_point(point: KillPoint, events: list[dict[str, Any]]) -> KillPoint:
    steps = [e["step"] for e in events if e["event"] == "step"]
    if steps and not steps[0] <= point.step <= steps[-1]:
        raise ValueError(
            f"--kill-at {point.label()}: the uninterrupted run took steps {steps[0]} to "
            f"{steps[-1]}: choose a step among them"
        )
    if not point.after_save:
        return point
    counts = [s["n"] for s in _saves(events) if s["step"] == point.step]
    if not counts:
        saved = sorted({s["step"] for s in _saves(events)})
        raise ValueError(
            f"--kill-at {point.label()}: the uninterrupted run did not save step {point.step} "
            f"(it saved steps {saved})"
        )
    return KillPoint(point.step, after_save=True, saves=max(counts))


def _routes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the script's paths went, each path once: the calls that used it, how (``input``:
    read where it is; else mapped to ``to``), and whether a lookup found the user's own
    directory there (which it did not read) while the script never wrote to it."""
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["event"] != "route":
            continue
        entry = found.setdefault(event["path"], {"path": event["path"], "to": event["to"],
                                                 "calls": [], "hows": set()})  # fmt: skip
        if event["call"] not in entry["calls"]:
            entry["calls"].append(event["call"])
        entry["hows"].add(event["how"])
        if event["how"] != "input":
            entry["to"] = event["to"]
    for entry in found.values():
        hows = entry.pop("hows")
        entry["how"] = "input" if hows == {"input"} else "mapped"
        entry["unread"] = "looked up, the user's not" in hows and "written" not in hows
    return list(found.values())


def check_resume(
    command: Sequence[str],
    out: str,
    *,
    kill_at: Sequence[KillPoint] = (),
    rank: int | None = None,
    resume_args: Sequence[str] = (),
    reference: str | None = None,
    timeout: float = 1800.0,
    progress: Any = None,
) -> CheckReport:
    """Run the check (see :mod:`ddpckpt._resumecheck`); ``progress(line)`` hears each stage.
    The directories the runs created for the script are removed at the end, where empty, and
    the files the script itself wrote beside its checkpoints are noted
    (:mod:`.leftovers`)."""
    report = CheckReport(command=list(command), out=os.path.abspath(out))
    _prepare_out(out)
    started = time.time()
    try:
        _check(report, kill_at, rank, resume_args, reference, timeout, progress)
    finally:
        report.notes += leftover_notes(report.out, report.routes, started)
    return report


def _prepare_out(out: str) -> None:
    """Make ``out/runs``, or raise :class:`ValueError` saying why it cannot be (before any
    run starts)."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(
            f"--out {out}: is a file, not a directory: give a directory for the check's runs "
            "and report (made if missing), or move the file away"
        )
    try:
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--out {out}: cannot make the check's directory there ({exc.strerror}): give a "
            "directory this user can write to"
        ) from None


def _check(
    report: CheckReport,
    kill_at: Sequence[KillPoint],
    rank: int | None,
    resume_args: Sequence[str],
    reference: str | None,
    timeout: float,
    progress: Any,
) -> None:
    say = progress or (lambda line: None)
    command, out = report.command, report.out
    if reference is not None:
        reference_dir, ref_records, notes = open_reference(reference, command)
        report.notes += notes
        report.reference_reused = reference_dir
        say(f"uninterrupted run: reusing {reference_dir}")
    else:
        say(f"uninterrupted run: {shlex.join(command)} ...")
        started = time.perf_counter()
        reference_run = run("reference", command, out, timeout=timeout)
        ref_records = reference_run.records
        seal(reference_run.dir, command, reference_run.digests)
        report.notes += reference_run.notes
        report.reference_seconds = time.perf_counter() - started
    raw = _reference_events(ref_records)
    offset = step_offset(raw)
    events = renumber(ref_records, offset)[0][0]
    start = next(e for e in events if e["event"] == "start")
    report.world = start["world"]
    report.mode = "checkpointer" if any(e["event"] == "attach" for e in events) else "plain"
    report.steps = list(dict.fromkeys(e["step"] for e in events if e["event"] == "step"))
    report.saves = [{k: s[k] for k in ("step", "epoch_end")} for s in _saves(events)]
    report.routes = _routes(events)
    report.victim = report.world - 1 if rank is None else rank
    if not 0 <= report.victim < report.world:
        raise ValueError(
            f"--rank {rank}: the script runs {report.world} rank{'s' if report.world > 1 else ''} "
            f"(0 to {report.world - 1})"
        )
    if kill_at:
        points = [_user_point(p, events) for p in kill_at]
    else:
        points, notes = default_kill_points(events)
        report.notes += notes
    victim_reference = _loss_curve((ref_records.get(report.victim) or [[]])[0])
    if victim_reference:
        report.losses = {"rank": report.victim, "reference": victim_reference, "killed": []}
    for point in points:
        say(f"killing rank {report.victim} {point.describe()}, then restarting ...")
        killed = run(
            f"kill-{point.label().replace(':', '-')}", command, out,
            kill=dataclasses.replace(point, step=point.step - offset), rank=report.victim,
            resume_args=resume_args, timeout=timeout, world=report.world,
        )  # fmt: skip
        report.killed_runs.append(killed.dir)
        report.notes += killed.notes
        killed_records = renumber(killed.records, offset)
        result = compare_point(
            ref_records, killed_records, kill=point.describe(), victim=report.victim
        )
        result.seconds, result.launches = killed.seconds, killed.launches
        report.points.append(result)
        if report.losses:
            processes = killed_records.get(report.victim, [])
            report.losses["killed"].append([_loss_curve(events) for events in processes])
    if report.mode == "plain" and not offset:
        report.notes.append(
            "steps are counted as the first optimizer's steps (the script's saves give no "
            "step= that would name them)"
        )
    if report.mode == "checkpointer" and not any("loss" in p.components for p in report.points):
        report.notes.append(
            "losses not compared: the script does not call ckpt.log_step(loss) (one line in "
            "the loop; it does nothing outside a check)"
        )
