"""Where a killed-and-resumed run first differs from the uninterrupted one, and why.

Each rank's records are compared with the same rank's in the reference run: every step the
killed process took before the kill (a difference there means the script is not
deterministic), the state right after ``resume()`` against what the reference saved at that
step, then every step after the restart, first the state it started from and then the state
it ended in. The first point that differs, over all ranks, is the divergence; within it, the
component that comes first in causal order (what the step read before what it wrote) is
blamed, and :mod:`.explain` says what usually causes that and how to fix it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpckpt._resumecheck.explain import explain

_MISSING = "(not recorded)"
_PHASES = {"resume": 0, "start": 1, "end": 2, "steps": 3}
# Causal order inside one point: what a step reads before what it writes.
_ORDER = {
    "resume": ["model.*", "optimizer*", "scheduler", "scaler", "loader.*", "extra.*", "rng.*"],
    "start": ["scheduler", "lr", "rng.*", "model.parameters", "model.buffers", "optimizer*",
              "loader.*", "extra.*"],
    "end": ["loader.*.samples", "loader.*", "inputs", "loss", "optimizer:unsaved.*", "optimizer*",
            "scaler", "model.parameters", "model.buffers", "extra.*", "scheduler", "lr", "rng.*"],
}  # fmt: skip
_NOT_AT_RESUME = ("optimizer:unsaved.*", "lr")  # known only once the optimizers step


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


@dataclass
class PointResult:
    """The verdict for one kill point."""

    kill: str
    rank: int
    resumed_from: int | None = None
    identical: bool = False
    steps_compared: int = 0  # steps after the restart, summed over ranks
    ranks: int = 0
    components: list[str] = field(default_factory=list)
    divergence: Divergence | None = None
    grid: dict[str, dict[int, bool]] = field(default_factory=dict)  # component -> step -> same
    unused: list[str] = field(default_factory=list)  # generators never drawn from: not compared
    seconds: float = 0.0
    launches: list[dict[str, Any]] = field(default_factory=list)  # 1: the launcher restarted it

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["grid"] = {c: {str(s): v for s, v in steps.items()} for c, steps in self.grid.items()}
        return data


def _differences(
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


def _generator_values(events: list[dict[str, Any]]) -> dict[str, set[Any]]:
    values: dict[str, set[Any]] = {}
    for event in events:
        for part in ("state", "start", "end"):
            for key, value in (event.get(part) or {}).items():
                if key.startswith("rng."):
                    values.setdefault(key, set()).add(value)
    return values


def _unused_generators(
    reference: list[dict[str, Any]], killed: Sequence[list[dict[str, Any]]] = ()
) -> list[str]:
    """The random generators whose state never changes, in the reference run nor in any
    process of the killed one: not drawn from, so an unseeded one (Python's ``random`` in
    most scripts) differs between runs harmlessly. One drawn from in either is compared."""
    drawn = {k for events in killed for k, v in _generator_values(events).items() if len(v) > 1}
    values = _generator_values(reference)
    return sorted(key for key, seen in values.items() if len(seen) == 1 and key not in drawn)


def _saved_state(
    step: int, saves: Mapping[int, dict[str, Any]], steps: Mapping[tuple[int, int], dict[str, Any]]
) -> dict[str, Any] | None:
    """What a checkpoint of ``step`` holds in the reference run: its save, or, where the
    reference saved other steps (a save policy reading the clock), the state at the end of
    that step, less what the step consumed."""
    if step in saves:
        return saves[step]["state"]
    ended = [e for (s, _), e in steps.items() if s == step]
    if not ended:
        return None
    consumed = ("inputs", "loss", "loader.*.samples")
    return {
        k: v
        for k, v in ended[-1]["end"].items()
        if not any(fnmatch.fnmatchcase(k, c) for c in consumed)
    }


def _first_step_reads_right_buffers(
    events: Sequence[dict[str, Any]], ref_steps: Mapping[tuple[int, int], dict[str, Any]]
) -> bool:
    """Whether the first step after a resume starts its forward with the reference's buffers."""
    first = next((e for e in events if e["event"] == "step"), None)
    reference = ref_steps.get((first["step"], 0)) if first is not None else None
    if first is None or reference is None:
        return False
    expected = (reference.get("start") or {}).get("model.buffers")
    return expected is not None and expected == (first.get("start") or {}).get("model.buffers")


def causal_rank(component: str, phase: str) -> int:
    for index, pattern in enumerate(_ORDER.get(phase, [])):
        if fnmatch.fnmatchcase(component, pattern):
            return index
    return len(_ORDER.get(phase, []))


@dataclass
class _Found:
    key: tuple[int, int, int]  # (segment, step, phase): program order
    step: int | None
    phase: str
    rank: int
    diffs: dict[str, tuple[Any, Any]]
    recorded: frozenset[str] = frozenset()  # the components recorded at that point


def _rank_events(
    reference: list[list[dict[str, Any]]], killed: list[list[dict[str, Any]]], rank: int
) -> tuple[_Found | None, dict[str, dict[int, bool]], int, int | None, set[str], list[str]]:
    """The first difference on one rank, the per-step grid, steps compared, resumed step."""
    if len(reference) != 1:
        raise RuntimeError(
            f"rank {rank} started {len(reference)} times in the uninterrupted run (it was "
            "restarted), so it is no reference; run the check again"
        )
    ref_events = reference[0]
    unused = _unused_generators(ref_events, killed)
    ref_steps: dict[tuple[int, int], dict[str, Any]] = {}
    order: list[int] = []
    saves: dict[int, dict[str, Any]] = {}
    for event in ref_events:
        if event["event"] == "step":
            occurrence = order.count(event["step"])
            ref_steps[(event["step"], occurrence)] = event
            order.append(event["step"])
        elif event["event"] == "save":
            saves[event["step"]] = event  # the last save of a step is what it holds
    grid: dict[str, dict[int, bool]] = {}
    components: set[str] = set()
    found: _Found | None = None
    compared = 0
    resumed_from: int | None = None

    def note(
        key: tuple[int, int, int], step: int | None, phase: str, diffs: dict, recorded=()
    ) -> None:
        nonlocal found
        if diffs and (found is None or key < found.key):
            found = _Found(key, step, phase, rank, diffs, frozenset(recorded))

    for segment, events in enumerate(killed):
        seen: list[int] = []
        expected_order = order
        position = 0
        resumed = segment == 0
        for index, event in enumerate(events):
            kind = event["event"]
            if kind == "step" and not resumed:  # restarted, and trained without resume()
                note((segment, -1, 0), None, "resume", {"checkpoint": ("a checkpoint", None)})
                return found, grid, compared, resumed_from, components, unused
            if kind == "resume":
                resumed = True
                resumed_from = event["step"]
                if segment == 0:
                    continue
                if event["step"] is None:
                    note((segment, -1, 0), None, "resume", {"checkpoint": ("a checkpoint", None)})
                    return found, grid, compared, resumed_from, components, unused
                saved = _saved_state(event["step"], saves, ref_steps)
                if saved is None:
                    diffs = {"checkpoint": (sorted(saves), event["step"])}
                    note((segment, event["step"], 0), event["step"], "resume", diffs)
                    return found, grid, compared, resumed_from, components, unused
                diffs = _differences(saved, event["state"], [*_NOT_AT_RESUME, *unused])
                if "model.buffers" in diffs and _first_step_reads_right_buffers(
                    events[index + 1 :], ref_steps
                ):
                    # DDP's broadcast_buffers (the default) overwrites this rank's buffers
                    # with rank 0's at every forward: what it held after resume() is never read
                    del diffs["model.buffers"]
                note((segment, event["step"], 0), event["step"], "resume", diffs)
                after = len(order) - 1 - order[::-1].index(event["step"])
                expected_order, position = order[after + 1 :], 0
            elif kind == "step":
                step = event["step"]
                if segment > 0:
                    if position >= len(expected_order) or expected_order[position] != step:
                        nxt = expected_order[position] if position < len(expected_order) else None
                        note((segment, step, 3), step, "steps", {"steps": (nxt, step)})
                        return found, grid, compared, resumed_from, components, unused
                    position += 1
                    compared += 1
                reference_step = ref_steps.get((step, seen.count(step)))
                seen.append(step)
                if reference_step is None:
                    note((segment, step, 3), step, "steps", {"steps": (None, step)})
                    continue
                start = _differences(reference_step["start"], event["start"], unused)
                end = _differences(reference_step["end"], event["end"], unused)
                phase_key = 0 if segment == 0 else segment
                if segment == 0:
                    note((0, step, 1), step, "before-kill", {**start, **end})
                else:
                    note((phase_key, step, 1), step, "start", start, reference_step["end"])
                    note((phase_key, step, 2), step, "end", end, reference_step["end"])
                    for part in (reference_step["start"] or {}, reference_step["end"]):
                        components.update(k for k in part if k not in unused)
                    for component in (
                        (set(reference_step["end"]) - set(unused)) | set(start) | set(end)
                    ):
                        grid.setdefault(component, {})[step] = (
                            grid.get(component, {}).get(step, True)
                            and component not in start
                            and component not in end
                        )
        if segment > 0 and position < len(expected_order) and found is None:
            missing = expected_order[position]
            note((segment, missing, 3), missing, "steps", {"steps": (missing, None)})
    return found, grid, compared, resumed_from, components, unused


def compare_point(
    reference: Mapping[int, list[list[dict[str, Any]]]],
    killed: Mapping[int, list[list[dict[str, Any]]]],
    *,
    kill: str,
    victim: int,
) -> PointResult:
    """Compare every rank of a killed-and-resumed run with the reference run."""
    result = PointResult(kill=kill, rank=victim, ranks=len(reference))
    firsts: list[_Found] = []
    components: set[str] = set()
    for rank in sorted(reference):
        if rank not in killed:
            raise RuntimeError(f"rank {rank} recorded nothing in the killed run ({kill})")
        found, grid, compared, resumed, seen, unused = _rank_events(
            reference[rank], killed[rank], rank
        )
        result.unused = sorted(set(result.unused) | set(unused))
        result.steps_compared += compared
        components |= seen
        if resumed is not None:
            result.resumed_from = resumed
        for component, steps in grid.items():
            merged = result.grid.setdefault(component, {})
            for step, same in steps.items():
                merged[step] = merged.get(step, True) and same
        if found is not None:
            firsts.append(found)
    result.components = sorted(components)
    if not firsts:
        result.identical = result.steps_compared > 0
        return result
    first = min(firsts, key=lambda f: f.key)
    at_first = [f for f in firsts if f.key == first.key]
    differences = [
        Difference(component, f.rank, e, g)
        for f in at_first
        for component, (e, g) in f.diffs.items()
    ]
    phase = first.phase
    component = min((d.component for d in differences), key=lambda c: (causal_rank(c, phase), c))
    what, cause, fix = explain(
        phase=phase,
        component=component,
        step=first.step,
        resumed_from=result.resumed_from,
        differences=differences,
        world=len(reference),
        first_step_after_resume=_first_after_resume(killed, first.step),
        samples_matched=any(c.endswith(".samples") for c in first.recorded)
        and not any(d.component.endswith(".samples") for d in differences),
        loader_saved=any(c.startswith("loader.") for c in first.recorded),
    )
    result.divergence = Divergence(
        step=first.step,
        phase=phase,
        ranks=sorted({f.rank for f in at_first}),
        component=component,
        what=what,
        cause=cause,
        fix=fix,
        differences=differences,
    )
    return result


def _first_after_resume(killed: Mapping[int, list[list[dict[str, Any]]]], step: int | None) -> bool:
    for processes in killed.values():
        for events in processes[1:]:
            steps = [e["step"] for e in events if e["event"] == "step"]
            if steps and steps[0] == step:
                return True
    return False
