"""Each framework's own checkpointing against ddpckpt's integration, on the same script.

Run it from a source checkout with the frameworks installed (``pip install -e '.[test]'``)::

    python benchmarks/integrations.py [--width N] [--only lightning,accelerate,transformers]

For each framework it runs the test suite's killed-run worker (``tests/support/
<framework>_worker.py``, see ``killed_run.py``) twice on 2 CPU processes with gloo: with
the framework's own checkpointing and with ddpckpt's integration. Each run trains 2 epochs
of 8 steps per process uninterrupted, then again with a checkpoint every 3 steps until
process 1 is SIGKILLed after step 11, then resumes from the newest checkpoint (step 9,
inside the second epoch). It reports, per process, how many of the 7 steps after the
resume trained on the same batches with the same loss as the uninterrupted run and
whether the final weights are identical; the median time of a save on process 0 (the
framework's save call: Lightning's ``trainer.save_checkpoint``, ``save_state``, the
Trainer's ``_save_checkpoint``); and the files of one checkpoint, their size, and which
of them are pickles. The models are wider than the tests' (hidden size 16): 2048 for the
Lightning and Accelerate MLPs, 512 for the Trainer's one-layer GPT-2, about 50 and 40 MB
of checkpoint, so that save times mean something; ``--width`` sets one size for all. Writes the table to
stdout and everything to ``--out/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

_SUPPORT = Path(__file__).resolve().parent.parent / "tests" / "support"
FRAMEWORKS = {  # worker, the modes compared, where one checkpoint (step 15) is, the width
    "lightning": ("lightning_worker.py", ["own", "ddpckpt"], "epoch=1-step=15.ckpt", 2048),
    "accelerate": ("accelerate_worker.py", ["own", "ddpckpt"], "step-15", 2048),
    "transformers": ("transformers_worker.py", ["own", "ddpckpt"], "checkpoint-15", 512),
}


def is_pickle(path: Path) -> bool:
    """A plain pickle (protocol 2 to 5), or a torch.save zip archive (which holds ``data.pkl``)."""
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 1 << 30:
        return False  # a safetensors file: an 8-byte header length, then a JSON header
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return True
    if head[:2] == b"PK" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith(".pkl") for name in archive.namelist())
    return False


def files_of(checkpoint: Path) -> list[dict[str, Any]]:
    paths = sorted(checkpoint.rglob("*")) if checkpoint.is_dir() else [checkpoint]
    return [
        {"name": str(p.relative_to(checkpoint)) if checkpoint.is_dir() else p.name,
         "bytes": p.stat().st_size, "pickle": is_pickle(p)}
        for p in paths if p.is_file()
    ]  # fmt: skip


def run(framework: str, mode: str, out: Path) -> dict[str, Any]:
    sys.path.insert(0, os.fspath(_SUPPORT))
    from launch import free_port, processes

    script, _, checkpoint, _ = FRAMEWORKS[framework]
    ports = ",".join(str(free_port()) for _ in range(3))
    launch = processes(mode, out, args=["--ports", ports], worker=_SUPPORT / script, timeout=900)
    if launch.returncode != 0:
        raise SystemExit(f"{framework} {mode} failed:\n{launch.output[-4000:]}")
    ranks = {}
    for rank in (0, 1):
        result = launch.result(rank)
        reference = result["reference"]
        after = [s for s in reference["losses"] if int(s) > result["resumed_from"]]
        ranks[rank] = {
            "resumed_from": result["resumed_from"],
            "same_loss": sum(result["losses"].get(s) == reference["losses"][s] for s in after),
            "same_batch": sum(result["batches"].get(s) == reference["batches"][s] for s in after),
            "steps_after": len(after),
            "same_weights": result["weights"] == reference["weights"],
        }
    saves = launch.result(0)["reference"]["saves"]
    files = files_of(out / f"uninterrupted-{mode}" / checkpoint)
    return {"ranks": ranks, "save_seconds": statistics.median(saves), "saves": saves,
            "files": files}  # fmt: skip


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| framework | checkpointing | steps after the resume identical (process 0, 1) | "
        "final weights identical | save, median (s) | files of one checkpoint | size | pickled files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for framework, modes in results.items():
        for mode, result in modes.items():
            if mode == "width":
                continue
            ranks = result["ranks"]
            steps = ", ".join(
                f"{r['same_loss']}/{r['steps_after']} (batches {r['same_batch']})"
                for r in ranks.values()
            )
            weights = "yes" if all(r["same_weights"] for r in ranks.values()) else "no"
            files = result["files"]
            pickled = [f["name"] for f in files if f["pickle"]]
            size = sum(f["bytes"] for f in files) / 2**20
            lines.append(
                f"| {framework} | {'ddpckpt' if mode == 'ddpckpt' else 'its own'} | {steps} | "
                f"{weights} | {result['save_seconds']:.3f} | {len(files)} | {size:.1f} MiB | "
                f"{', '.join(pickled) or 'none'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--width", type=int, help="the models' hidden size (default: per framework)"
    )
    parser.add_argument("--only", default=",".join(FRAMEWORKS), help="frameworks, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench-output/integrations"))
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for framework in args.only.split(","):
        os.environ["KILLED_RUN_WIDTH"] = str(args.width or FRAMEWORKS[framework][3])
        results[framework] = {"width": int(os.environ["KILLED_RUN_WIDTH"])}
        for mode in FRAMEWORKS[framework][1]:
            with tempfile.TemporaryDirectory() as tmp:
                print(f"{framework}, {mode} ...", flush=True)
                results[framework][mode] = run(framework, mode, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
