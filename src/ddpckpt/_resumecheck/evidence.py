"""What a check's runs did and said besides their state: seeding calls, ddpckpt's warnings.

:mod:`.record` writes them as ``seed`` and ``warning`` events. :mod:`.explain` uses them to
put first the cause the runs show (a generator seeded after the resume, a warning that the
loop restarted at another epoch, a seed that changes between runs), and the report quotes
the warnings of the resumed run at the step they concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The SIGKILL of the check leaves the killed run's lock behind: its takeover is the check's
# doing, not the script's, and is not quoted.
_NOT_QUOTED = ("ddpckpt._run.runlock",)


@dataclass
class Evidence:
    """The events bearing on one divergence (see the module docstring)."""

    seeds_reference: list[dict[str, Any]] = field(default_factory=list)  # on the rank
    seeds_killed: list[dict[str, Any]] = field(default_factory=list)  # before the kill
    initial_differs: list[str] = field(default_factory=list)  # at ddpckpt's import
    seeds_after_resume: list[dict[str, Any]] = field(default_factory=list)  # any rank
    warnings: list[dict[str, Any]] = field(default_factory=list)  # the resumed run's

    def seeded_after_resume(self, generator: str) -> list[dict[str, Any]]:
        return [s for s in self.seeds_after_resume if s["generator"] == generator]

    def loader_warnings(self) -> list[dict[str, Any]]:
        return [w for w in self.warnings if w["logger"].startswith("ddpckpt._training")]


def _events(processes: list[list[dict[str, Any]]], index: int, kind: str) -> list[dict[str, Any]]:
    if len(processes) <= index:
        return []
    return [e for e in processes[index] if e["event"] == kind]


def _initial(processes: list[list[dict[str, Any]]]) -> dict[str, Any]:
    starts = _events(processes, 0, "start")
    return (starts[0].get("initial") or {}) if starts else {}


def where(event: Mapping[str, Any]) -> str:
    """When a seed or warning event happened, in words."""
    after, resumed = event.get("after_step"), event.get("resumed_from")
    if resumed is not None and after == resumed:
        return f"right after the resume from step {resumed}"
    if after is None:
        return "before the first step"
    return f"after step {after}"


def seed_call(event: Mapping[str, Any]) -> str:
    """``torch.manual_seed(0) at train.py:12``."""
    call = {"rng.torch": "torch.manual_seed", "rng.cuda": "torch.cuda.manual_seed",
            "rng.numpy": "np.random.seed", "rng.python": "random.seed"}[event["generator"]]  # fmt: skip
    return f"{call}({event['value']}) at {event['where']}"


def warnings_after_restart(
    killed: Mapping[int, list[list[dict[str, Any]]]],
) -> list[dict[str, Any]]:
    """The restarted processes' ddpckpt warnings, each once with the ranks that logged it."""
    found: dict[str, dict[str, Any]] = {}
    for rank, processes in sorted(killed.items()):
        for events in processes[1:]:
            for event in events:
                if event["event"] != "warning" or event["logger"].startswith(_NOT_QUOTED):
                    continue
                entry = found.setdefault(
                    event["text"],
                    {"text": event["text"], "logger": event["logger"], "level": event["level"],
                     "where": where(event), "ranks": []},
                )  # fmt: skip
                if rank not in entry["ranks"]:
                    entry["ranks"].append(rank)
    return list(found.values())


def gather(
    reference: Mapping[int, list[list[dict[str, Any]]]],
    killed: Mapping[int, list[list[dict[str, Any]]]],
    rank: int,
    component: str,
) -> Evidence:
    """The evidence for a divergence found on ``rank`` in ``component``."""
    before, after = _initial(reference.get(rank, [])), _initial(killed.get(rank, []))
    return Evidence(
        seeds_reference=_events(reference.get(rank, []), 0, "seed"),
        seeds_killed=_events(killed.get(rank, []), 0, "seed"),
        initial_differs=sorted(k for k in set(before) & set(after) if before[k] != after[k]),
        seeds_after_resume=[
            event
            for processes in killed.values()
            for events in processes[1:]
            for event in events
            if event["event"] == "seed" and event.get("resumed_from") is not None
        ],
        warnings=warnings_after_restart(killed),
    )
