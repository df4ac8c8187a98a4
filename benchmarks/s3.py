"""The S3 target: checkpointing to an S3-compatible server, against the alternatives.

Run it from a source checkout (``pip install -e '.[test,s3]'``, or ``PYTHONPATH=src`` with
boto3 and moto installed)::

    python benchmarks/s3.py [--mb 256] [--repeat 3] [--endpoint URL --bucket NAME]

Without ``--endpoint`` it starts moto's standalone server on 127.0.0.1 (the one the tests
use) and measures against it. One process, one rank, a model of ``--mb`` MiB of fp32
weights. For each method, the time to save (until durable) and to load, as MB/s and as a
ratio to ddpckpt measured in the same run:

* ddpckpt ``save``/``load`` on ``s3://``;
* DCP ``save``/``load`` through fsspec (``FsspecWriter``/``FsspecReader`` on s3fs); skipped,
  with one line saying so, when s3fs is not installed (it is no dependency of ddpckpt);
* ``torch.save`` into a buffer then one ``upload_fileobj`` (multipart), and back;

and the stall of ``save(async_save=True)`` (the time training waits) on S3 and on a local
directory. A local server's throughput is bounded by the server (moto keeps objects in
Python memory), so the ratios say more than the MB/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ddpckpt

_MiB = 1 << 20
_TESTS = Path(__file__).resolve().parent.parent / "tests"


def _model(mib: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, mib // 4)  # 4 MiB of fp32 per 1024x1024 layer
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def _timed(action: Callable[[], Any], repeat: int) -> float:
    """The median seconds of ``repeat`` runs of ``action``, after one untimed run (clients,
    connection pools and thread pools made, as in a job's later checkpoints)."""
    action()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fresh(prefix: str) -> Callable[[], str]:
    """A new location under ``prefix`` for every call (no overwrite in the measurement)."""
    return lambda: f"{prefix}/{uuid.uuid4().hex[:8]}"


def _ddpckpt(model: torch.nn.Module, root: str, repeat: int) -> dict[str, float]:
    new = _fresh(f"{root}/ddpckpt")
    saved: list[str] = []
    save = _timed(lambda: saved.append(ddpckpt.save(new(), model=model, rng=False)), repeat)
    load = _timed(lambda: ddpckpt.load(saved[-1], model=model, rng=False), repeat)
    return {"save_s": save, "load_s": load}


def _dcp(model: torch.nn.Module, root: str, options: dict[str, Any], repeat: int):
    """DCP through fsspec, or why it cannot run here."""
    if importlib.util.find_spec("s3fs") is None:
        return "DCP via fsspec skipped: s3fs is not installed (pip install s3fs to measure it)"
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    new = _fresh(f"{root}/dcp")
    saved: list[str] = []
    state = {"model": model.state_dict()}

    def save() -> None:
        saved.append(new())
        dcp.save(state, storage_writer=FsspecWriter(saved[-1], **options))

    def load() -> None:
        dcp.load(state, storage_reader=FsspecReader(saved[-1], **options))

    return {"save_s": _timed(save, repeat), "load_s": _timed(load, repeat)}


def _torch_save(model: torch.nn.Module, client: Any, bucket: str, repeat: int):
    keys: list[str] = []

    def save() -> None:
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        keys.append(f"torch-save/{uuid.uuid4().hex[:8]}.pt")
        client.upload_fileobj(buffer, bucket, keys[-1])

    def load() -> None:
        buffer = io.BytesIO()
        client.download_fileobj(bucket, keys[-1], buffer)
        buffer.seek(0)
        model.load_state_dict(torch.load(buffer, weights_only=True))

    return {"save_s": _timed(save, repeat), "load_s": _timed(load, repeat)}


def _stall(model: torch.nn.Module, roots: dict[str, str], repeat: int) -> dict[str, Any]:
    """Seconds ``save(async_save=True)`` blocks (wall and the calling thread's CPU time: the
    latter is the work done on the training thread, whatever else runs), and until that save
    is durable, per target;
    the targets take turns, so both see the same machine, and each save starts after the
    previous one is durable (the server idle)."""
    fresh = {target: _fresh(root) for target, root in roots.items()}
    times: dict[str, dict[str, list[float]]] = {
        target: {"stall": [], "stall_cpu": [], "durable": []} for target in roots
    }
    for new in fresh.values():  # buffers allocated, clients made
        ddpckpt.save(new(), model=model, rng=False, async_save=True).wait()
    for _ in range(repeat):
        for target, new in fresh.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            pending = ddpckpt.save(new(), model=model, rng=False, async_save=True)
            times[target]["stall"].append(time.perf_counter() - start)
            times[target]["stall_cpu"].append(time.thread_time() - start_cpu)
            pending.wait()
            times[target]["durable"].append(time.perf_counter() - start)
    ddpckpt.release_async_buffers()
    return {
        target: {f"{name}_s": statistics.median(values) for name, values in measured.items()}
        for target, measured in times.items()
    }


def _deprioritise(pid: int, nice: int) -> bool:
    """CPU priority ``nice`` for every thread of process ``pid`` (Linux), so that a local
    server competes as little as it can with the client being measured."""
    if nice == 0:
        return False
    try:
        for thread in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread), nice)
    except OSError:
        return False
    return True


def run(
    mib: int,
    repeat: int,
    endpoint: str | None,
    bucket: str | None,
    stall_only: bool = False,
    server_nice: int = 19,
) -> dict[str, Any]:
    import boto3

    server, niced = None, False
    if endpoint is None:
        sys.path.insert(0, os.fspath(_TESTS))
        import s3server

        server, endpoint = s3server.start()
        niced = _deprioritise(server.pid, server_nice)
        os.environ.update(s3server.environment(endpoint))
        bucket = bucket or s3server.BUCKET
        s3server.make_bucket(endpoint, bucket)
    bucket = bucket or "ddpckpt-bench"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        model = _model(mib)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        root = f"s3://{bucket}/bench-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=endpoint)
        options = {"endpoint_url": endpoint}  # s3fs; keys from the environment
        results: dict[str, Any] = {}
        if not stall_only:
            results["ddpckpt"] = _ddpckpt(model, root, repeat)
            results["dcp_fsspec"] = _dcp(model, root, options, repeat)
            results["torch_save_put"] = _torch_save(model, client, bucket, repeat)
        with tempfile.TemporaryDirectory() as local:
            results["async_stall"] = _stall(model, {"s3": f"{root}/async", "local": local}, repeat)
        return {
            "state_mib": nbytes / _MiB,
            "repeat": repeat,
            "endpoint": "moto on 127.0.0.1" if server else endpoint,
            "server_nice": server_nice if niced else 0,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "results": results,
        }
    finally:
        if server is not None:
            s3server.stop(server)


def format_markdown(report: dict[str, Any]) -> str:
    mib = report["state_mib"]
    base = report["results"].get("ddpckpt")
    lines = [
        f"{mib:.0f} MiB of fp32 weights, one rank, {report['endpoint']}, "
        f"median of {report['repeat']}, {report['cpus']} CPUs",
        "",
        "| method | save MB/s | load MB/s | save time / ddpckpt's | load time / ddpckpt's |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    skipped = []
    for name in ("ddpckpt", "dcp_fsspec", "torch_save_put"):
        row = report["results"].get(name, f"{name}: not measured (--stall-only)")
        if isinstance(row, str) or base is None:
            skipped.append(row if isinstance(row, str) else f"{name}: not measured")
            continue
        lines.append(
            f"| {name} | {mib / row['save_s']:.0f} | {mib / row['load_s']:.0f} | "
            f"{row['save_s'] / base['save_s']:.2f} | {row['load_s'] / base['load_s']:.2f} |"
        )
    stall = report["results"]["async_stall"]
    lines += [
        "",
        f"async_save stall: S3 {stall['s3']['stall_s'] * 1000:.0f} ms, local disk "
        f"{stall['local']['stall_s'] * 1000:.0f} ms (ratio "
        f"{stall['s3']['stall_s'] / stall['local']['stall_s']:.2f}); durable after "
        f"{stall['s3']['durable_s']:.2f} s on S3, {stall['local']['durable_s']:.2f} s on disk; "
        f"CPU time of the training thread during the stall: S3 "
        f"{stall['s3']['stall_cpu_s'] * 1000:.0f} ms, local disk "
        f"{stall['local']['stall_cpu_s'] * 1000:.0f} ms"
        + (f"; server at nice {report['server_nice']}" if report.get("server_nice") else ""),
        *skipped,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/s3.py", description=__doc__)
    parser.add_argument("--mb", type=int, default=256, help="MiB of model weights")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint", help="an S3 server to use instead of a local moto")
    parser.add_argument("--bucket", help="an existing bucket there (with --endpoint)")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--stall-only", action="store_true", help="only the async_save stall")
    parser.add_argument(
        "--server-nice",
        type=int,
        default=19,
        help="CPU priority of the local moto server (0: as the client's)",
    )
    args = parser.parse_args(argv)
    report = run(
        args.mb, args.repeat, args.endpoint, args.bucket, args.stall_only, args.server_nice
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
