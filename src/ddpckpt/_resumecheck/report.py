"""What ``ddpckpt check-resume`` shows: a terminal summary, ``report.json``, a PNG."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ddpckpt._resumecheck.check import CheckReport
from ddpckpt._resumecheck.compare import Divergence, PointResult, causal_rank

LIMITS = (
    "limits: a check proves this script exact at these kill points, on this world size and "
    "machine; steps the killed run had not reached are compared only when two uninterrupted "
    "runs are identical (seeded; on GPUs torch.use_deterministic_algorithms(True)); it "
    "cannot see state outside the process (the wall clock, external services, files changed "
    "between runs)"
)


def _saves(report: CheckReport) -> str:
    parts: list[str] = []
    for save in report.saves:
        text = str(save["step"]) + (" (epoch end)" if save["epoch_end"] else "")
        if not parts or parts[-1] != text:
            parts.append(text)
    return ", ".join(parts) or "none"


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def _where(divergence: Divergence) -> str:
    return {
        "before-kill": "before the kill",
        "resume": "right after the resume",
        "start": "at the start of the step",
        "end": "at the end of the step",
        "steps": "in the step sequence",
    }[divergence.phase]


def _first(divergence: Divergence) -> str:
    step = f"step {divergence.step}" if divergence.step is not None else "the restart"
    ranks = ", ".join(map(str, divergence.ranks))
    plural = "s" if len(divergence.ranks) > 1 else ""
    return f"first at {step} ({_where(divergence)}), rank{plural} {ranks}: {divergence.component}"


def _explained(divergence: Divergence) -> list[str]:
    lines = [
        f"    what:  {divergence.what}",
        f"    cause: {divergence.cause}",
        f"    fix:   {divergence.fix}",
    ]
    lines += [f"    the run said: {quote}" for quote in divergence.quoted]
    others = sorted({d.component for d in divergence.differences} - {divergence.component})
    if others:
        lines.append(f"    also different at that point: {', '.join(others[:8])}")
    return lines


def _point_lines(index: int, point: PointResult) -> list[str]:
    resumed = (
        f"resumed from step {point.resumed_from}"
        if point.resumed_from is not None
        else "did not resume"
    )
    how = "the launcher restarted it" if len(point.launches) == 1 else "started again"
    lines = [
        f"kill {index}: rank {point.rank} SIGKILLed {point.kill}; {how} "
        f"({point.seconds:.1f} s in all), {resumed}"
    ]
    replayed = (
        f" ({point.replayed} replayed: steps the killed run had taken after its checkpoint)"
        if point.replayed and point.not_judged
        else ""
    )
    if point.verdict == "exact":
        lines.append(
            f"  bit-identical at every step compared on every rank: "
            f"{_plural(point.steps_compared, 'step')} after the restart{replayed} x "
            f"{_plural(point.ranks, 'rank')}, {_plural(len(point.components), 'component')} "
            f"each: {_kinds(point.components)}"
        )
    elif point.verdict == "different" and point.divergence is not None:
        lines.append(f"  DIFFERENT: {_first(point.divergence)}")
        lines += _explained(point.divergence)
    elif point.nondeterminism is not None:
        lines.append(
            "  CANNOT JUDGE: two uninterrupted runs of the script differ, "
            f"{_first(point.nondeterminism)}"
        )
        lines += _explained(point.nondeterminism)
        if point.divergence is not None:
            lines.append(
                f"    after the restart the runs differ too, {_first(point.divergence)} "
                "(possibly the same variation)"
            )
    else:
        lines.append("  CANNOT JUDGE: no step after the restart was recorded")
    if point.not_judged and point.verdict != "cannot-judge" and point.nondeterminism:
        n = point.nondeterminism
        lines.append(
            f"  {_span(point.not_judged)} not compared: two uninterrupted runs differ from step "
            f"{n.step} on ({n.component}): {n.cause}. To have them compared: {n.fix}"
        )
    if point.beyond:
        lines.append(
            f"  the resumed run went on to step {point.beyond[-1]}, after the uninterrupted "
            f"run's last step ({point.reference_ended_at}), taking as many steps as one launch "
            "of the script takes: those steps are not compared"
        )
    elif point.ended_at is not None and point.ended_at != point.reference_ended_at:
        lines.append(
            f"  the resumed run ended at step {point.ended_at}; the uninterrupted run at step "
            f"{point.reference_ended_at}"
        )
    if point.unused:
        lines.append(f"  not compared (never drawn from in this script): {', '.join(point.unused)}")
    quoted = {q for d in (point.divergence, point.nondeterminism) if d for q in d.quoted}
    for warning in point.warnings:
        text = (
            f"rank {', '.join(map(str, warning['ranks']))}, {warning['where']}: {warning['text']}"
        )
        if text not in quoted:
            lines.append(f"  ddpckpt {warning['level']} in the resumed run: {text}")
    return lines


def _isolation(report: CheckReport) -> list[str]:
    written = [r for r in report.routes if r["how"] != "input"]
    inputs = [r for r in report.routes if r["how"] == "input"]
    lines = []
    if written:
        paths = "; ".join(f"{r['path']} ({', '.join(r['calls'])})" for r in written)
        lines.append(
            f"isolation: the script's paths were mapped into {os.path.join(report.out, 'runs')}"
            f"/<run>/checkpoints, in both runs: {paths}; the originals were neither read nor "
            "written"
        )
    if inputs:
        paths = "; ".join(f"{r['path']} ({', '.join(r['calls'])})" for r in inputs)
        lines.append(f"read as inputs, never written: {paths}")
    for route in report.routes:
        if route.get("unread"):
            lines.append(
                f"note: {', '.join(route['calls'])}({route['path']!r}) looked only in the check's "
                f"copy, which the script never writes; your {route['path']} was not read. If it "
                "holds inputs (pretrained weights), load them by their path"
            )
    return lines


def format_report(report: CheckReport, *, title: str | None = None) -> str:
    """The summary the command prints; ``title`` replaces its first line (the command)."""
    reference = (
        f"reused from {report.reference_reused}"
        if report.reference_reused
        else f"{report.reference_seconds:.1f} s"
    )
    lines = [
        title or f"ddpckpt check-resume: {shlex.join(report.command)}",
        f"uninterrupted run: {_plural(len(report.steps), 'step')} on "
        f"{_plural(report.world, 'rank')} ({reference}); checkpoints at steps {_saves(report)}",
    ]
    for index, point in enumerate(report.points, 1):
        lines += _point_lines(index, point)
    lines += _isolation(report)
    lines += [f"note: {note}" for note in report.notes]
    verdict = {
        "exact": "the resume is exact at every kill point",
        "different": "the resume is NOT exact (see above)",
        "cannot-judge": "cannot judge: the check could not compare the resumed run (see above)",
    }[report.verdict]
    lines.append(f"verdict: {verdict}")
    lines.append(f"report: {os.path.join(report.out, 'report.json')}")
    lines.append(f"plot: {report.plot}")
    if report.losses:
        lines.append(f"loss plot: {report.loss_plot}")
    lines.append(LIMITS)
    return "\n".join(lines)


def _kinds(components: list[str]) -> str:
    """``model (2), optimizer, rng (2)``: the components by kind, counts adding up."""
    kinds: dict[str, int] = {}
    for component in components:
        kind = component.split(".")[0].split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k} ({n})" if n > 1 else k for k, n in kinds.items())


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
        "verdict": report.verdict,
        "world": report.world,
        "mode": report.mode,
        "steps": report.steps,
        "saves": report.saves,
        "victim": report.victim,
        "reference_seconds": report.reference_seconds,
        "reference_reused": report.reference_reused,
        "points": [p.as_json() for p in report.points],
        "killed_runs": report.killed_runs,
        "routes": report.routes,
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
    colours = ListedColormap(["tab:red", "0.8", "tab:green"])  # differs, not judged, same
    value = {False: 0.0, None: 0.5, True: 1.0}
    for axis, point in zip(axes[:, 0], points, strict=True):
        components = sorted(point.grid, key=lambda c: (causal_rank(c, "end"), c))
        steps = sorted({s for c in point.grid.values() for s in c})
        cells = [[value[point.grid[c].get(s, True)] for s in steps] for c in components]
        axis.imshow(cells, aspect="auto", cmap=colours, vmin=0, vmax=1, interpolation="nearest")
        first = point.divergence
        if first is not None and first.component in components and first.step in steps:
            cell = (steps.index(first.step), components.index(first.component))
            axis.plot(*cell, "kx", ms=10)
            axis.annotate(" first difference", cell, fontsize=7)
        axis.set_yticks(range(len(components)), components, fontsize=7)
        ticks = range(0, len(steps), max(1, len(steps) // 20))
        axis.set_xticks(list(ticks), [str(steps[i]) for i in ticks], fontsize=7)
        verdict = {"exact": "identical", "different": "DIFFERENT"}.get(
            point.verdict, "CANNOT JUDGE"
        )
        axis.set_title(
            f"rank {point.rank} killed {point.kill}; resumed from step {point.resumed_from}: "
            f"{verdict} (green: same on every rank, red: differs, grey: not compared)",
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
