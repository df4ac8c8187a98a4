"""One rank's comparison of a killed-and-resumed run with the runs it must repeat (the
three comparisons of :mod:`.compare`: before the kill, the replay, after the replay)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._resumecheck.digests import CONSUMED

_MISSING = "(not recorded)"
_NOT_AT_RESUME = ("optimizer:unsaved.*", "lr")  # known only once the optimizers step


def differences(
    expected: Mapping[str, Any] | None, got: Mapping[str, Any] | None, skip: Sequence[str] = ()
) -> dict[str, tuple[Any, Any]]:
    if expected is None and got is None:
        return {}
    expected, got = expected or {}, got or {}  # recorded in one run only: every part differs
    found = {}
    for key in list(expected) + [k for k in got if k not in expected]:
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in skip):
            continue
        e, g = expected.get(key, _MISSING), got.get(key, _MISSING)
        if e != g:
            found[key] = (e, g)
    return found


def unused_generators(
    reference: list[dict[str, Any]], killed: Sequence[list[dict[str, Any]]] = ()
) -> list[str]:
    """The random generators whose state never changes, in the reference run nor in any
    process of the killed one: not drawn from, so an unseeded one (Python's ``random`` in
    most scripts) differs between runs harmlessly. One drawn from in either is compared."""

    def values(events: list[dict[str, Any]]) -> dict[str, set[Any]]:
        found: dict[str, set[Any]] = {}
        for event in events:
            for part in ("state", "start", "end"):
                for key, value in (event.get(part) or {}).items():
                    if key.startswith("rng."):
                        found.setdefault(key, set()).add(value)
        return found

    drawn = {k for events in killed for k, v in values(events).items() if len(v) > 1}
    return sorted(k for k, seen in values(reference).items() if len(seen) == 1 and k not in drawn)


class Steps:
    """One process's steps by (step, occurrence), their order, and its saves."""

    def __init__(self, events: Sequence[dict[str, Any]]) -> None:
        self.events = list(events)
        self.steps: dict[tuple[int, int], dict[str, Any]] = {}
        self.order: list[int] = []
        self.saves: dict[int, dict[str, Any]] = {}
        for event in events:
            if event["event"] == "step":
                self.steps[(event["step"], self.order.count(event["step"]))] = event
                self.order.append(event["step"])
            elif event["event"] == "save":
                self.saves[event["step"]] = event  # the last save of a step is what it holds

    def saved_state(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint of ``step`` holds: its save or, where this process saved other
        steps (a policy reading the clock), the state at the end of that step, less what
        the step consumed."""
        if step in self.saves:
            return self.saves[step]["state"]
        ended = [e for (s, _), e in self.steps.items() if s == step]
        if not ended:
            return None
        consumed = ended[-1]["end"]
        return {
            k: v
            for k, v in consumed.items()
            if not any(fnmatch.fnmatchcase(k, c) for c in CONSUMED)
        }


@dataclass
class Found:
    key: tuple[int, int, int]  # (process, step, part): program order
    step: int | None
    phase: str
    rank: int
    diffs: dict[str, tuple[Any, Any]]
    recorded: frozenset[str] = frozenset()  # the components recorded at that point
    initial: bool = False  # before the kill: at the start of the first step


def note_first(found: Found | None, candidate: Found) -> Found | None:
    return candidate if candidate.diffs and (found is None or candidate.key < found.key) else found


def before_kill(
    ref: Steps, first: list[dict[str, Any]], rank: int, unused: list[str]
) -> Found | None:
    """The first difference between the reference and the killed run before the kill."""
    found = None
    seen: list[int] = []
    for event in first:
        if event["event"] != "step":
            continue
        step = event["step"]
        expected = ref.steps.get((step, seen.count(step)))
        initial = not seen
        seen.append(step)
        if expected is None:
            continue  # a step the reference never took: the killed run's sequence says so
        start = differences(expected["start"], event["start"], unused)
        end = differences(expected["end"], event["end"], unused)
        found = note_first(
            found, Found((0, step, 1), step, "before-kill", rank, start, initial=initial)
        )
        found = note_first(found, Found((0, step, 2), step, "before-kill", rank, end))
    return found


@dataclass
class RankResult:
    first: Found | None = None
    grid: dict[str, dict[int, bool | None]] = field(default_factory=dict)
    compared: set[int] = field(default_factory=set)  # steps (one may hold several records)
    replayed: set[int] = field(default_factory=set)
    not_judged: set[int] = field(default_factory=set)
    beyond: list[int] = field(default_factory=list)
    resumed_from: int | None = None
    ended_at: int | None = None
    components: set[str] = field(default_factory=set)


def after_restart(
    ref: Steps,
    processes: list[list[dict[str, Any]]],
    rank: int,
    unused: list[str],
    by_reference: bool,
) -> RankResult:
    """The first difference on one rank after the restart (see the module docstring)."""
    out = RankResult()
    sources = [Steps(processes[0])]

    def note(
        key: tuple[int, int, int],
        step: int | None,
        phase: str,
        diffs: dict[str, tuple[Any, Any]],
        recorded: Iterable[str] = (),
    ) -> None:
        out.first = note_first(out.first, Found(key, step, phase, rank, diffs, frozenset(recorded)))

    def expected_step(step: int, occurrence: int) -> tuple[dict[str, Any] | None, bool]:
        for source in reversed(sources):
            if (step, occurrence) in source.steps:
                return source.steps[(step, occurrence)], True
        return (ref.steps.get((step, occurrence)) if by_reference else None), False

    seen: list[int]  # the steps taken so far in a segment
    for segment, events in enumerate(processes[1:], 1):
        steps = Steps(events)
        out.ended_at = steps.order[-1] if steps.order else out.ended_at
        resumed, pending, expected_order, position, seen = False, None, ref.order, 0, []
        for event in events:
            kind = event["event"]
            if kind == "resume":
                resumed, out.resumed_from = True, event["step"]
                if event["step"] is None:
                    note((segment, -1, 0), None, "resume", {"checkpoint": ("a checkpoint", None)})
                    return out
                # what this run saved (or, if the runs agree, the uninterrupted run)
                candidates = [*reversed(sources), *([ref] if by_reference else [])]
                saved = _checkpoint_state(candidates, event["step"])
                if saved is None and by_reference:
                    diffs = {"checkpoint": (sorted(ref.saves), event["step"])}
                    note((segment, event["step"], 0), event["step"], "resume", diffs)
                    return out
                pending = (
                    (event["step"], differences(saved, event["state"], [*_NOT_AT_RESUME, *unused]))
                    if saved
                    else None
                )
                expected_order, position = following(ref.order, event["step"]), 0
            elif kind == "step":
                step = event["step"]
                if not resumed:  # restarted, and trained without resuming
                    note((segment, -1, 0), None, "resume", {"checkpoint": ("a checkpoint", None)})
                    return out
                if position >= len(expected_order):
                    out.beyond.append(step)
                    continue
                if expected_order[position] != step:
                    note(
                        (segment, step, 3),
                        step,
                        "steps",
                        {"steps": (expected_order[position], step)},
                    )
                    return out
                position += 1
                expected, replay = expected_step(step, seen.count(step))
                seen.append(step)
                if pending is not None:  # the resume, judged with the first step's start
                    resumed_step, diffs = pending
                    for component in [c for c in diffs if fnmatch.fnmatchcase(c, "model*.buffers")]:
                        # DDP's broadcast_buffers overwrites this rank's buffers with rank 0's
                        # at every forward: what the resume left, if never read, is no matter
                        if expected is not None and _at_start(expected, component) == _at_start(
                            event, component
                        ):
                            del diffs[component]
                    note((segment, resumed_step, 0), resumed_step, "resume", diffs)
                    pending = None
                if expected is None:
                    out.not_judged.add(step)
                    for component in event["end"]:
                        out.grid.setdefault(component, {})[step] = None
                    continue
                out.compared.add(step)
                if replay:
                    out.replayed.add(step)
                start = differences(expected["start"], event["start"], unused)
                end = differences(expected["end"], event["end"], unused)
                note((segment, step, 1), step, "start", start, expected["end"])
                note((segment, step, 2), step, "end", end, expected["end"])
                for part in (expected["start"] or {}, expected["end"]):
                    out.components.update(k for k in part if k not in unused)
                for component in (set(expected["end"]) - set(unused)) | set(start) | set(end):
                    same = component not in start and component not in end
                    before = out.grid.setdefault(component, {}).get(step, True)
                    out.grid[component][step] = bool(before) and same
        if pending is not None:
            note((segment, pending[0], 0), pending[0], "resume", pending[1])
        if not resumed:
            continue
        if position < len(expected_order) and not out.beyond:
            missing = expected_order[position]
            note((segment, missing, 3), missing, "steps", {"steps": (missing, None)})
        elif out.beyond and len(steps.order) != len(ref.order):
            first = out.beyond[0]  # not the steps one launch takes: the loop's end moved
            note((segment, first, 3), first, "steps", {"steps": (None, first)})
        sources.append(steps)
    return out


def _checkpoint_state(candidates: list[Steps], step: int) -> dict[str, Any] | None:
    """What the checkpoint of ``step`` held: the newest save of that step itself, else the
    state at the end of that step (a save policy that chose other steps in this run)."""
    for source in candidates:
        if step in source.saves:
            return source.saves[step]["state"]
    return next((state for s in candidates if (state := s.saved_state(step))), None)


def _at_start(event: dict[str, Any], component: str) -> Any:
    return (event.get("start") or {}).get(component)


def following(order: list[int], step: int) -> list[int]:
    """The steps the reference took after its last ``step`` (after ``step``, had it none)."""
    if step in order:
        return order[len(order) - order[::-1].index(step) :]
    return [s for s in order if s > step]
