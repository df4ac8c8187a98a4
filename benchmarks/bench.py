"""The benchmark: checkpointing speed against the alternatives and the hardware, one run.

Run it from a source checkout, ``python benchmarks/bench.py [options]`` (ddpckpt importable:
installed with ``pip install -e '.[bench]'``, or ``PYTHONPATH=src``); ``ddpckpt bench`` runs
it too when the package is installed from the checkout in place.

For each world size (``--nproc``, default 1 and 2 on CPU, 1 per GPU up to 2 on GPUs) the
measuring job (``_bench_worker.py`` next to this file) runs under torchrun on the same
training state, on ``--device`` (``cuda`` by default when a GPU is present), and reports
references (write ceiling with fsync, read ceiling, the copy floor: memcpy on CPU, pinned
device-to-host on a GPU) and, for every method, stall, time until durable, cold load,
peak extra memory and the overhead of checkpointing every N steps (on a GPU also the
first save's stall and the pinned memory held). This module turns that into ratios against
the references measured in the same run, checks them against the project's targets, and
writes ``results.json``, ``results.md`` and ``results.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["format_markdown", "main", "ratios", "run_bench", "run_from_args"]

_MB = 1 << 20
_WORKER = str(Path(__file__).resolve().with_name("_bench_worker.py"))
_NEEDS = {"safetensors": "to compare against it", "matplotlib": "for results.png"}


def run_from_args(args: argparse.Namespace) -> int:
    """Check the options (``ValueError``) and the optional dependencies (``ImportError``),
    run the benchmark and print its report; returns the exit status."""
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        needs = " and ".join(f"{name} ({_NEEDS[name]})" for name in missing)
        raise ImportError(f"the benchmark needs {needs}: pip install 'ddpckpt[bench]'")
    nprocs = None
    if args.nproc:
        try:
            nprocs = tuple(int(n) for n in args.nproc.split(","))
        except ValueError:
            raise ValueError(f"--nproc {args.nproc}: give world sizes like 1,2") from None
    sizes = {"--nproc": min(nprocs or (1,)), "--params": args.params, "--every": args.every,
             "--steps": args.steps, "--repeat": args.repeat}  # fmt: skip
    too_small = [flag for flag, value in sizes.items() if value is not None and value < 1]
    if too_small:
        raise ValueError(f"{', '.join(too_small)} must be at least 1")
    if args.every is not None and args.steps is not None and args.every > args.steps:
        raise ValueError(f"--every {args.every} is more than --steps {args.steps}")
    print(f"benchmarking in {args.out}; this takes minutes ...", flush=True)
    report = run_bench(
        args.out, directory=args.dir, nprocs=nprocs, params=args.params, every=args.every,
        steps=args.steps, compute=args.compute, repeat=args.repeat, device=args.device,
    )  # fmt: skip
    print(format_markdown(report))
    print(f"results: {os.path.join(os.path.abspath(args.out), 'results.md')} (.json, .png)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/bench.py [options]``: the options of ``ddpckpt bench``."""
    from ddpckpt._cli.bench_cmd import add_arguments

    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="Measure checkpointing against torch.save, DCP and the hardware.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except (ValueError, ImportError, RuntimeError, OSError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(
    nproc: int, directory: str, out: str, options: list[str], timeout: float
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
        _WORKER, "--dir", directory, "--out", out, *options,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPCKPT_PROGRESS": "0"}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the benchmark job with {nproc} rank(s) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)


def _machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_nprocs(device: str) -> tuple[int, ...]:
    if device != "cuda":
        return (1, 2)
    import torch

    return (1, 2) if torch.cuda.device_count() >= 2 else (1,)  # NCCL: one GPU per rank


def run_bench(
    out: str = "bench-output", *, directory: str | None = None, nprocs: tuple[int, ...] | None = None,
    params: int | None = None, every: int | None = None, steps: int | None = None,
    compute: float | None = None, repeat: int = 3, timeout: float = 3600, device: str | None = None,
    only: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark; returns (and writes) the results with their ratios.

    Left out, the sizes are the device's defaults: on CPU 100M parameters, a save every 20
    of 60 steps of 0.2 s; on a GPU 20 x 4096 x 4096 parameters (4.03 GB with AdamW), a
    save every 50 of 150 steps of 0.12 s.
    """
    device = device or default_device()
    gpu = device == "cuda"
    nprocs = nprocs or default_nprocs(device)
    params = params or (20 * 4096 * 4096 if gpu else 100_000_000)
    every = every or (50 if gpu else 20)
    steps = steps or (150 if gpu else 60)
    compute = compute or (0.12 if gpu else 0.2)
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    directory = os.path.abspath(directory or os.path.join(out, "checkpoints"))
    report: dict[str, Any] = {"machine": _machine(), "directory": directory, "runs": []}
    started = time.time()
    for nproc in nprocs:
        target = os.path.join(directory, f"ranks-{nproc}")
        options = ["--params", str(params), "--every", str(every), "--steps", str(steps)]
        options += ["--compute", str(compute), "--repeat", str(repeat), "--device", device]
        options += ["--only", only] if only else []
        if nproc == 1 and not gpu:
            options.append("--gil")
        run = _run_worker(nproc, target, os.path.join(out, f"raw-{nproc}.json"), options, timeout)
        shutil.rmtree(target, ignore_errors=True)
        run["ratios"] = ratios(run)
        report["runs"].append(run)
    report["seconds"] = time.time() - started
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(format_markdown(report))
    _plot(report, os.path.join(out, "results.png"))
    return report


def ratios(run: dict[str, Any]) -> dict[str, Any]:
    """Every figure as a ratio to a reference measured in the same run, with the targets."""
    ref, methods, loop = run["references"], run["methods"], run["loop"]
    size = run["state_bytes"]
    floor = size / ref["memcpy"]  # copying the whole state once: the snapshot floor
    if run.get("device") == "cuda":
        return _gpu_ratios(run, floor)
    table = {}
    for name, m in methods.items():
        table[name] = {
            "stall_s": m["stall"],
            "durable_s": m["durable"],
            "write_fraction": size / m["durable"] / ref["write_ceiling"],
            "load_s": m["load"],
            "read_fraction": size / m["load"] / ref["read_ceiling"],
            "stall_vs_floor": m["stall"] / floor,
            "extra_rss_vs_state": m["peak_extra_rss"] / size,
            "loop_overhead": loop[name] / loop["baseline"] - 1,
        }
    sync, async_, overlap = table["ddpckpt"], table["ddpckpt async"], table["ddpckpt async overlap"]
    targets = {
        "sync save >= 0.9x write ceiling": (sync["write_fraction"], sync["write_fraction"] >= 0.9),
        "sync save faster than torch.save rank 0": (
            methods["torch.save rank 0 + barrier"]["durable"] / methods["ddpckpt"]["durable"],
            methods["ddpckpt"]["durable"] < methods["torch.save rank 0 + barrier"]["durable"],
        ),
        "sync save faster than DCP save": (
            methods["DCP save"]["durable"] / methods["ddpckpt"]["durable"],
            methods["ddpckpt"]["durable"] < methods["DCP save"]["durable"],
        ),
        "async stall <= 1.2x snapshot floor": (
            async_["stall_vs_floor"],
            async_["stall_vs_floor"] <= 1.2,
        ),
        "async stall <= 1/5 of DCP async_save's": (
            methods["ddpckpt async"]["stall"] / methods["DCP async_save"]["stall"],
            methods["ddpckpt async"]["stall"] <= methods["DCP async_save"]["stall"] / 5,
        ),
        "overlap stall <= 1/5 of DCP async_save's": (
            methods["ddpckpt async overlap"]["stall"] / methods["DCP async_save"]["stall"],
            methods["ddpckpt async overlap"]["stall"] <= methods["DCP async_save"]["stall"] / 5,
        ),
        f"overlap: step-time overhead < 2% saving every {loop['every']} steps": (
            overlap["loop_overhead"],
            overlap["loop_overhead"] < 0.02,
        ),
        "load >= 0.9x cold read ceiling": (sync["read_fraction"], sync["read_fraction"] >= 0.9),
        "async peak extra RSS <= 1.1x state": (
            async_["extra_rss_vs_state"],
            async_["extra_rss_vs_state"] <= 1.1,
        ),
        "sync peak extra RSS small (<= 0.1x state)": (
            sync["extra_rss_vs_state"],
            sync["extra_rss_vs_state"] <= 0.1,
        ),
    }
    return {"snapshot_floor_s": floor, "methods": table, "targets": targets}


def _gpu_ratios(run: dict[str, Any], floor: float) -> dict[str, Any]:
    """The GPU run's figures (the copy floor is the pinned device-to-host copy)."""
    ref, methods, loop = run["references"], run["methods"], run["loop"]
    size, first = run["state_bytes"], run.get("first_stall", {})
    table = {}
    for name, m in methods.items():
        table[name] = {
            "stall_s": m["stall"],
            "first_stall_s": first.get(name, m["stall"]),
            "durable_s": m["durable"],
            "write_fraction": size / m["durable"] / ref["write_ceiling"],
            "load_s": m["load"],
            "read_fraction": size / m["load"] / ref["read_ceiling"],
            "stall_vs_floor": m["stall"] / floor,
            "pinned_vs_state": m.get("peak_pinned", float("nan")) / size,
            "extra_rss_vs_state": m["peak_extra_rss"] / size,
            "loop_overhead": loop[name] / loop["baseline"] - 1,
        }
    if "ddpckpt" not in table or "ddpckpt async" not in table:  # the alternatives only
        return {"snapshot_floor_s": floor, "methods": table, "targets": {}}
    sync, async_ = table["ddpckpt"], table["ddpckpt async"]
    if "torch.save rank 0 + barrier" not in methods:  # a run of ddpckpt's methods only
        methods = {**methods, "torch.save rank 0 + barrier": {"durable": float("nan")}}
    targets = {
        "sync save durable <= 1.1x async time to durable": (
            sync["durable_s"] / async_["durable_s"],
            sync["durable_s"] <= 1.1 * async_["durable_s"],
        ),
        "first async save stall <= 1.2x copy floor": (
            async_["first_stall_s"] / floor,
            async_["first_stall_s"] <= 1.2 * floor,
        ),
        "async stall <= 1.2x copy floor": (
            async_["stall_vs_floor"],
            async_["stall_vs_floor"] <= 1.2,
        ),
        "cold load >= 0.9x read ceiling": (sync["read_fraction"], sync["read_fraction"] >= 0.9),
        "sync save faster than torch.save rank 0": (
            methods["torch.save rank 0 + barrier"]["durable"] / methods["ddpckpt"]["durable"],
            methods["ddpckpt"]["durable"] < methods["torch.save rank 0 + barrier"]["durable"],
        ),
        "async pinned memory <= 1.0x this rank's share": (
            async_["pinned_vs_state"] * run["world_size"],
            async_["pinned_vs_state"] * run["world_size"] <= 1.0 + 1e-3,
        ),
    }
    return {"snapshot_floor_s": floor, "methods": table, "targets": targets}


def format_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"Machine: {machine.get('cpu')} with {machine.get('cores')} cores, {machine.get('memory_gib')} GiB, "
        f"GPU: {machine.get('gpu') or 'none'}; Python {machine.get('python')}, torch {machine.get('torch')}.",
        f"Checkpoints written to `{report['directory']}`. Whole run: {report['seconds'] / 60:.1f} min.",
        "Stall and durable are medians of repeated saves, each to a new path (the asynchronous "
        "methods after one warm-up save); load is the best cold load of those checkpoints, as the "
        "ceilings are the best of repeated measurements. Peak extra RSS is measured while saving "
        "and includes host buffers a method keeps between saves. Loop overhead: wall time of a "
        "training loop saving every N steps against the same loop without saves (averaged "
        "before and after).",
        "",
    ]
    for run in report["runs"]:
        if run.get("device") == "cuda":
            lines += _gpu_markdown(run)
            continue
        ref, r = run["references"], run["ratios"]
        lines += [
            f"### {run['world_size']} rank(s): {run['state_bytes'] / 2**30:.2f} GiB of state "
            f"({run['params'] / 1e6:.0f}M fp32 parameters + AdamW moments)",
            "",
            f"References measured in this run (best of the start and the end of the run): write ceiling "
            f"(sequential, fsync; the faster of plain {ref['write_plain'] / _MB:.0f} MiB/s and with early writeback "
            f"{ref['write_writeback'] / _MB:.0f} MiB/s) {ref['write_ceiling'] / _MB:.0f} MiB/s, "
            f"cold read ceiling {ref['read_ceiling'] / _MB:.0f} MiB/s, memcpy {ref['memcpy'] / _MB:.0f} MiB/s "
            f"(snapshot floor for the whole state: {r['snapshot_floor_s']:.2f} s). "
            f"Training step: {run['step_seconds']:.2f} s.",
            "",
            "| method | stall s | durable s | write / ceiling | load s | load / read ceiling | peak extra RSS / state "
            f"| overhead, save every {run['loop']['every']} steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in r["methods"].items():
            lines.append(
                f"| {name} | {m['stall_s']:.3f} | {m['durable_s']:.2f} | {m['write_fraction']:.2f}x | {m['load_s']:.2f} "
                f"| {m['read_fraction']:.2f}x | {m['extra_rss_vs_state']:.2f}x | {100 * m['loop_overhead']:+.1f}% |"
            )
        lines += ["", "| target | ratio | met |", "|---|---:|:---:|"]
        for target, (value, met) in r["targets"].items():
            lines.append(f"| {target} | {value:.3g} | {'yes' if met else '**no**'} |")
        if "gil" in run:
            g = run["gil"]
            lines += [
                "",
                f"GIL check (1 rank): training step {g['alone'] * 1000:.0f} ms alone, "
                f"{g['thread'] * 1000:.0f} ms ({100 * (g['thread'] / g['alone'] - 1):+.1f}%) while a writer "
                f"thread hashes and writes a state-sized buffer, {g['process'] * 1000:.0f} ms "
                f"({100 * (g['process'] / g['alone'] - 1):+.1f}%) while a writer process does.",
            ]
        lines.append("")
    return "\n".join(lines)


def _gpu_markdown(run: dict[str, Any]) -> list[str]:
    ref, r, gpu = run["references"], run["ratios"], run.get("gpu", {})
    loop = run["loop"]
    lines = [
        f"### {run['world_size']} rank(s) on {gpu.get('name')} (driver {gpu.get('driver')}, "
        f"CUDA {gpu.get('torch_cuda')}): {run['state_bytes'] / 1e9:.2f} GB of state "
        f"({run['params'] / 1e6:.0f}M fp32 parameters + AdamW moments)",
        "",
        f"References measured in this run (best of the start and the end): pinned device-to-host "
        f"copy {ref['memcpy'] / 1e9:.1f} GB/s (copy floor for the whole state: "
        f"{r['snapshot_floor_s']:.3f} s), write ceiling (sequential, fsync) "
        f"{ref['write_ceiling'] / 1e9:.2f} GB/s, cold read ceiling {ref['read_ceiling'] / 1e9:.2f} GB/s. "
        f"Training step: {run['step_seconds']:.3f} s. First saves come {run.get('first_every')} "
        "steps into a fresh instance (ddpckpt: a Checkpointer after resume(), should_save "
        "every step), with no pinned memory cached.",
        "",
        "| method | first-save stall s | stall s (vs copy floor) | durable s | load s (vs read ceiling) "
        "| peak pinned / state | peak extra RSS / state "
        f"| loop overhead, save every {loop['every']} steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in r["methods"].items():
        lines.append(
            f"| {name} | {m['first_stall_s']:.3f} | {m['stall_s']:.3f} ({m['stall_vs_floor']:.2f}x) "
            f"| {m['durable_s']:.2f} | {m['load_s']:.2f} ({m['read_fraction']:.2f}x) "
            f"| {m['pinned_vs_state']:.2f}x | {m['extra_rss_vs_state']:.2f}x "
            f"| {100 * m['loop_overhead']:+.1f}% |"
        )
    lines += ["", "| target | ratio | met |", "|---|---:|:---:|"]
    for target, (value, met) in r["targets"].items():
        lines.append(f"| {target} | {value:.3g} | {'yes' if met else '**no**'} |")
    lines.append("")
    return lines


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    runs = report["runs"]
    figure, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.8), dpi=110, squeeze=False)
    for axis, run in zip(axes[0], runs, strict=True):
        names = list(run["methods"])
        stall = [run["methods"][n]["stall"] for n in names]
        durable = [run["methods"][n]["durable"] for n in names]
        positions = range(len(names))
        axis.barh(
            [p + 0.2 for p in positions],
            durable,
            height=0.4,
            color="tab:gray",
            label="until durable",
        )
        axis.barh(
            [p - 0.2 for p in positions],
            stall,
            height=0.4,
            color="tab:blue",
            label="training stall",
        )
        floor = run["ratios"]["snapshot_floor_s"]
        ceiling = run["state_bytes"] / run["references"]["write_ceiling"]
        axis.axvline(floor, color="tab:green", ls="--", lw=1, label="copy floor")
        axis.axvline(ceiling, color="tab:red", ls="--", lw=1, label="fsync write ceiling")
        axis.set_yticks(list(positions), names, fontsize=8)
        axis.invert_yaxis()
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("seconds (log)")
        axis.set_title(
            f"{run['world_size']} rank(s), {run['state_bytes'] / 2**30:.2f} GiB state", fontsize=10
        )
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
