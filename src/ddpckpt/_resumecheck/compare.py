"""Where a killed-and-resumed run first differs from the run it must repeat, and why.

On each rank, three comparisons:

* **before the kill**: the killed run's first process against the uninterrupted
  (reference) run. Both started from scratch: a difference means that two uninterrupted runs
  of the script differ, so the reference cannot say what a resumed run should do.
* **the replay**: a restarted process resumes from a checkpoint its own run saved and takes
  again the steps the killed process took after that save. They must match the killed
  process's own records, at the resume and at every replayed step. This needs no
  determinism between runs: an unseeded script is judged too.
* **after the replay**: the steps the killed process never reached are compared with the
  reference run, when the two uninterrupted runs were identical before the kill; otherwise
  they are not judged.

The first difference after the restart, over all ranks, is the divergence; within it, the
component that comes first in causal order (what a step reads before what it writes) is
blamed, and :mod:`.explain` says what causes that and how to fix it. The verdict of a kill
point is ``exact``, ``different``, or ``cannot-judge``: nothing could be compared, or the
two uninterrupted runs differ in their computation (not only in where they started), so a
difference after the restart may be the script's own variation.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpckpt._resumecheck import evidence
from ddpckpt._resumecheck.compare_rank import (
    Found,
    Steps,
    after_restart,
    before_kill,
    unused_generators,
)
from ddpckpt._resumecheck.explain import explain
from ddpckpt._resumecheck.situation import Situation

# Causal order inside one point: what a step reads before what it writes.
_ORDER = {
    "resume": ["model*", "optimizer*", "scheduler*", "scaler*", "loader*", "extra.*", "rng.*"],
    "start": ["scheduler*", "lr", "rng.*", "model*.parameters", "model*.buffers", "optimizer*",
              "loader*", "extra.*"],
    "end": ["loader*.samples", "loader*", "inputs", "loss", "optimizer:unsaved.*", "optimizer*",
            "scaler*", "model*.parameters", "model*.buffers", "extra.*", "scheduler*", "lr",
            "rng.*"],
}  # fmt: skip
_ORDER["before-kill"] = _ORDER["start"] + _ORDER["end"]


@dataclass
class Difference:
    component: str
    rank: int
    expected: Any
    got: Any


@dataclass
class Divergence:
    """The first point where the runs differ."""

    step: int | None
    phase: str  # before-kill, resume, start, end, steps
    ranks: list[int]
    component: str
    what: str
    cause: str
    fix: str
    differences: list[Difference] = field(default_factory=list)
    quoted: list[str] = field(default_factory=list)  # the run's own words that bear on it


@dataclass
class PointResult:
    """The verdict for one kill point; step counts are per rank."""

    kill: str
    rank: int
    resumed_from: int | None = None
    verdict: str = "cannot-judge"
    steps_compared: int = 0  # steps after the restart compared on each rank
    replayed: int = 0  # of those, compared with the killed process's own steps
    not_judged: list[int] = field(default_factory=list)  # after the replay, runs differing
    beyond: list[int] = field(default_factory=list)  # after the reference's last step
    ended_at: int | None = None
    reference_ended_at: int | None = None
    ranks: int = 0
    components: list[str] = field(default_factory=list)
    divergence: Divergence | None = None  # the first difference after the restart
    nondeterminism: Divergence | None = None  # the first one between uninterrupted runs
    grid: dict[str, dict[int, bool | None]] = field(default_factory=dict)  # None: not judged
    unused: list[str] = field(default_factory=list)  # generators never drawn from
    warnings: list[dict[str, Any]] = field(default_factory=list)  # the resumed run's own
    seconds: float = 0.0
    launches: list[dict[str, Any]] = field(default_factory=list)  # 1: the launcher restarted it

    @property
    def identical(self) -> bool:
        return self.verdict == "exact"

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["grid"] = {c: {str(s): v for s, v in steps.items()} for c, steps in self.grid.items()}
        data["identical"] = self.identical
        return data


def causal_rank(component: str, phase: str) -> int:
    order = _ORDER.get(phase, [])
    for index, pattern in enumerate(order):
        if fnmatch.fnmatchcase(component, pattern):
            return index
    return len(order)


def compare_point(
    reference: Mapping[int, list[list[dict[str, Any]]]],
    killed: Mapping[int, list[list[dict[str, Any]]]],
    *,
    kill: str,
    victim: int,
) -> PointResult:
    """Compare every rank of a killed-and-resumed run with the run it must repeat."""
    result = PointResult(kill=kill, rank=victim, ranks=len(reference))
    unused: dict[int, list[str]] = {}
    befores: list[Found] = []
    for rank in sorted(reference):
        if len(reference[rank]) != 1:
            raise RuntimeError(
                f"rank {rank} started {len(reference[rank])} times in the uninterrupted run (it "
                "was restarted), so it is no reference; run the check again"
            )
        if rank not in killed:
            raise RuntimeError(f"rank {rank} recorded nothing in the killed run ({kill})")
        unused[rank] = unused_generators(reference[rank][0], killed[rank])
        result.unused = sorted(set(result.unused) | set(unused[rank]))
        found = before_kill(Steps(reference[rank][0]), killed[rank][0], rank, unused[rank])
        if found is not None:
            befores.append(found)
    if befores:
        result.nondeterminism = _divergence(befores, reference, killed, result)
    varies = bool(befores) and not min(befores, key=lambda f: f.key).initial
    firsts: list[Found] = []
    components: set[str] = set()
    for rank in sorted(reference):
        ref = Steps(reference[rank][0])
        result.reference_ended_at = ref.order[-1] if ref.order else None
        done = after_restart(ref, killed[rank], rank, unused[rank], by_reference=not befores)
        result.steps_compared = max(result.steps_compared, len(done.compared))
        result.replayed = max(result.replayed, len(done.replayed))
        result.not_judged = sorted(set(result.not_judged) | done.not_judged)
        result.beyond = sorted(set(result.beyond) | set(done.beyond))
        if done.ended_at is not None:
            result.ended_at = max(done.ended_at, result.ended_at or done.ended_at)
        components |= done.components
        if done.resumed_from is not None:
            result.resumed_from = done.resumed_from
        for component, steps in done.grid.items():
            merged = result.grid.setdefault(component, {})
            for step, same in steps.items():
                merged[step] = (
                    same if step not in merged or merged[step] is None else (merged[step] and same)
                )
        if done.first is not None:
            firsts.append(done.first)
    result.components = sorted(components)
    result.warnings = evidence.warnings_after_restart(killed)
    if firsts:
        result.divergence = _divergence(firsts, reference, killed, result)
    if varies or (not firsts and result.steps_compared == 0):
        result.verdict = "cannot-judge"  # a computation that varies proves nothing either way
    else:
        result.verdict = "different" if firsts else "exact"
    return result


def _divergence(
    firsts: list[Found],
    reference: Mapping[int, list[list[dict[str, Any]]]],
    killed: Mapping[int, list[list[dict[str, Any]]]],
    result: PointResult,
) -> Divergence:
    first = min(firsts, key=lambda f: f.key)
    at_first = [f for f in firsts if f.key == first.key]
    differences = [
        Difference(component, f.rank, e, g)
        for f in at_first
        for component, (e, g) in f.diffs.items()
    ]
    phase = first.phase
    component = min((d.component for d in differences), key=lambda c: (causal_rank(c, phase), c))
    situation = Situation(
        phase=phase,
        component=component,
        step=first.step,
        resumed_from=result.resumed_from,
        differences=differences,
        world=len(reference),
        first_step_after_resume=_first_after_resume(killed, first.step),
        recorded=first.recorded,
        initial=first.initial,
        evidence=evidence.gather(reference, killed, first.rank, component),
    )
    explained = explain(situation)
    return Divergence(
        step=first.step,
        phase=phase,
        ranks=sorted({f.rank for f in at_first}),
        component=component,
        what=explained.what,
        cause=explained.cause,
        fix=explained.fix,
        differences=differences,
        quoted=explained.quoted,
    )


def _first_after_resume(killed: Mapping[int, list[list[dict[str, Any]]]], step: int | None) -> bool:
    for processes in killed.values():
        for events in processes[1:]:
            steps = [e["step"] for e in events if e["event"] == "step"]
            if steps and steps[0] == step:
                return True
    return False
