"""What ``ddpckpt check-resume`` shows: a terminal summary, ``report.json``, a PNG."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ddpckpt._resumecheck.check import CheckReport
from ddpckpt._resumecheck.compare import causal_rank

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


def format_report(report: CheckReport, *, title: str | None = None) -> str:
    """The summary the command prints; ``title`` replaces its first line (the command)."""
    reference = (
        f"reused from {report.reference_reused}"
        if report.reference_reused
        else f"{report.reference_seconds:.1f} s"
    )
    lines = [
        title or f"ddpckpt check-resume: {shlex.join(report.command)}",
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
    if report.losses:
        lines.append(f"loss plot: {report.loss_plot}")
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
    """``report.json``, ``resume-check.png`` and, when the script logs its loss,
    ``loss.png`` (a note instead of each plot without matplotlib)."""
    os.makedirs(report.out, exist_ok=True)
    report.plot = _plot(report)
    if report.losses:
        report.loss_plot = _loss_plot(report)
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
        "killed_runs": report.killed_runs,
        "notes": report.notes,
        "plot": report.plot,
        "losses": report.losses,
        "loss_plot": report.loss_plot,
        "limits": LIMITS,
    }
    with open(os.path.join(report.out, "report.json"), "w") as f:
        json.dump(data, f, indent=1, default=repr)


def _pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or ``None`` when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_NO_MATPLOTLIB = "not drawn: matplotlib is not installed (pip install 'ddpckpt[demo]')"


def _plot(report: CheckReport) -> str:
    plt = _pyplot()
    if plt is None:
        return _NO_MATPLOTLIB
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


def _xy(curve: list[list[Any]]) -> tuple[list[Any], list[Any]]:
    return [step for step, _ in curve], [loss for _, loss in curve]


def _loss_plot(report: CheckReport) -> str:
    """``loss.png``: the killed rank's loss, uninterrupted and killed-and-resumed, per point."""
    plt = _pyplot()
    if plt is None:
        return _NO_MATPLOTLIB
    path = os.path.join(report.out, "loss.png")
    rank, reference = report.losses["rank"], report.losses["reference"]
    runs = list(zip(report.points, report.losses["killed"], strict=True))
    figure, axes = plt.subplots(len(runs), 1, figsize=(8, 4.5 * len(runs)), dpi=110, squeeze=False)
    for axis, (point, processes) in zip(axes[:, 0], runs, strict=True):
        axis.plot(*_xy(reference), color="0.6", lw=4, label="uninterrupted run")
        for index, curve in enumerate(p for p in processes if p):
            style = (
                {"color": "tab:blue", "lw": 1.3, "label": "killed run"}
                if index == 0
                else {"color": "tab:orange", "lw": 1.3, "ls": "--", "label": "after the resume"}
            )
            axis.plot(*_xy(curve), **style)
        at_top = axis.get_xaxis_transform()  # x in data, y in axes coordinates
        if processes and processes[0]:
            killed_at = processes[0][-1][0]
            axis.axvline(killed_at, color="tab:red", lw=1)
            axis.text(killed_at, 0.03, f" SIGKILL rank {point.rank} (step {killed_at})",
                      color="tab:red", transform=at_top, fontsize=8)  # fmt: skip
        if point.resumed_from is not None:
            axis.axvline(point.resumed_from, color="tab:green", lw=1)
            axis.text(point.resumed_from, 0.09, f"resumed from step {point.resumed_from} ",
                      color="tab:green", transform=at_top, ha="right", fontsize=8)  # fmt: skip
        if all(loss > 0 for _, loss in reference):
            axis.set_yscale("log")
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(f"loss (log_step, rank {rank})")
        verdict = "bit-identical" if point.identical else "DIFFERENT"
        axis.set_title(f"rank {point.rank} killed {point.kill}: {verdict}", fontsize=9)
        axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
