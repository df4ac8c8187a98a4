"""What ``ddpckpt check-resume`` shows: a terminal summary, ``report.json``, a PNG."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ddpckpt.resumecheck.check import CheckReport
from ddpckpt.resumecheck.compare import causal_rank

__all__ = ["LIMITS", "format_report", "write_outputs"]

LIMITS = (
    "limits: a check proves this script exact at these kill points, on this world size and "
    "machine; it needs a deterministic script (two uninterrupted runs identical: on GPUs set "
    "torch.use_deterministic_algorithms(True)), and cannot see state outside the process "
    "(the wall clock, unseeded external services, files changed between runs)"
)


def _saves(report: CheckReport) -> str:
    parts = []
    for save in report.saves:
        text = str(save["step"]) + (" (epoch end)" if save["epoch_end"] else "")
        if not parts or parts[-1] != text:
            parts.append(text)
    return ", ".join(parts) or "none"


def format_report(report: CheckReport) -> str:
    """The summary the command prints."""
    reference = (
        f"reused from {report.reference_reused}"
        if report.reference_reused
        else f"{report.reference_seconds:.1f} s"
    )
    lines = [
        f"ddpckpt check-resume: {shlex.join(report.command)}",
        f"uninterrupted run: {len(report.steps)} steps on {report.world} rank"
        f"{'s' if report.world > 1 else ''} ({reference}); checkpoints at steps {_saves(report)}",
    ]
    for index, point in enumerate(report.points, 1):
        resumed = (
            f"resumed from step {point.resumed_from}"
            if point.resumed_from is not None
            else "did not resume"
        )
        how = "the launcher restarted it" if len(point.launches) == 1 else "started again"
        lines.append(
            f"kill {index}: rank {point.rank} SIGKILLed {point.kill}; {how} "
            f"({point.seconds:.1f} s in all), {resumed}"
        )
        if point.identical:
            per_rank = point.steps_compared // max(1, point.ranks)
            lines.append(
                f"  bit-identical at every step on every rank: {per_rank} step"
                f"{'s' if per_rank != 1 else ''} after the restart x {point.ranks} rank"
                f"{'s' if point.ranks != 1 else ''}, {len(point.components)} components each "
                f"({_kinds(point.components)})"
            )
            if point.unused:
                unused = ", ".join(point.unused)
                lines.append(f"  not compared (never drawn from in this script): {unused}")
            continue
        divergence = point.divergence
        if divergence is None:
            lines.append("  NOT checked: no step after the restart was recorded")
            continue
        where = {
            "before-kill": "before the kill",
            "resume": "right after resume()",
            "start": "at the start of the step",
            "end": "at the end of the step",
            "steps": "in the step sequence",
        }[divergence.phase]
        step = f"step {divergence.step}" if divergence.step is not None else "the restart"
        ranks = ", ".join(map(str, divergence.ranks))
        lines.append(
            f"  DIFFERENT: first at {step} ({where}), rank{'s' if len(divergence.ranks) > 1 else ''} "
            f"{ranks}: {divergence.component}"
        )
        others = sorted({d.component for d in divergence.differences} - {divergence.component})
        lines.append(f"    what:  {divergence.what}")
        lines.append(f"    cause: {divergence.cause}")
        lines.append(f"    fix:   {divergence.fix}")
        if others:
            lines.append(f"    also different at that point: {', '.join(others[:8])}")
    lines += [f"note: {note}" for note in report.notes]
    verdict = (
        "the resume is exact at every kill point"
        if report.identical
        else "the resume is NOT exact (see above)"
    )
    lines.append(f"verdict: {verdict}")
    lines.append(f"report: {os.path.join(report.out, 'report.json')}")
    lines.append(f"plot: {report.plot}")
    lines.append(LIMITS)
    return "\n".join(lines)


def _kinds(components: list[str]) -> str:
    kinds = []
    for component in components:
        kind = component.split(".")[0].split(":")[0]
        if kind not in kinds:
            kinds.append(kind)
    return ", ".join(kinds)


def write_outputs(report: CheckReport) -> None:
    """``report.json`` and ``resume-check.png`` (a note instead without matplotlib)."""
    os.makedirs(report.out, exist_ok=True)
    report.plot = _plot(report)
    data: dict[str, Any] = {
        "command": report.command,
        "identical": report.identical,
        "world": report.world,
        "steps": report.steps,
        "saves": report.saves,
        "victim": report.victim,
        "reference_seconds": report.reference_seconds,
        "reference_reused": report.reference_reused,
        "points": [p.as_json() for p in report.points],
        "notes": report.notes,
        "plot": report.plot,
        "limits": LIMITS,
    }
    with open(os.path.join(report.out, "report.json"), "w") as f:
        json.dump(data, f, indent=1, default=repr)


def _plot(report: CheckReport) -> str:
    try:
        import matplotlib
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install 'ddpckpt[demo]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    points = [p for p in report.points if p.grid]
    if not points:
        return "not drawn: no step after a restart was recorded"
    path = os.path.join(report.out, "resume-check.png")
    rows = max(len(p.grid) for p in points)
    figure, axes = plt.subplots(
        len(points), 1, figsize=(9, 1.2 + 0.28 * rows * len(points)), dpi=110, squeeze=False
    )
    colours = ListedColormap(["tab:red", "tab:green"])
    for axis, point in zip(axes[:, 0], points, strict=True):
        components = sorted(point.grid, key=lambda c: (causal_rank(c, "end"), c))
        steps = sorted({s for c in point.grid.values() for s in c})
        cells = [[1.0 if point.grid[c].get(s, True) else 0.0 for s in steps] for c in components]
        axis.imshow(cells, aspect="auto", cmap=colours, vmin=0, vmax=1, interpolation="nearest")
        first = point.divergence
        if first is not None and first.component in components and first.step in steps:
            cell = (steps.index(first.step), components.index(first.component))
            axis.plot(*cell, "kx", ms=10)
            axis.annotate(" first difference", cell, fontsize=7)
        axis.set_yticks(range(len(components)), components, fontsize=7)
        ticks = range(0, len(steps), max(1, len(steps) // 20))
        axis.set_xticks(list(ticks), [str(steps[i]) for i in ticks], fontsize=7)
        verdict = "identical" if point.identical else "DIFFERENT"
        axis.set_title(
            f"rank {point.rank} killed {point.kill}; resumed from step {point.resumed_from}: "
            f"{verdict} (green: same on every rank, red: differs)",
            fontsize=8,
        )
        axis.set_xlabel("optimizer step after the restart", fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
