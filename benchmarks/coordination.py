"""Coordination cost at scale: N simulated ranks against one real TCPStore.

Each rank is a thread with its own TCPStore client (plus the second connection a call's
heartbeat uses), all talking to one TCPStore server on 127.0.0.1, running ddpckpt's
collectives through :class:`ddpckpt._coord.comm.StoreGroup` (no ``torch.distributed`` set up).
Every store operation is counted per rank, with the bytes it moves through the server.

For each N it reports, per collective: store operations per rank (mean, and the busiest
rank: rank 0), bytes through the server per rank, and wall time (for a save on node-local
storage, with ``RANKS_PER_NODE`` ranks a node, the gloo connections each rank opens too);
then the time until a silent rank is named, against the configured timeout. ``--before`` runs the same on the
``comm.py`` of a git revision (default ``main``), loaded next to the current one.

    PYTHONPATH=src python benchmarks/coordination.py --ranks 16 64 256 1024 --before main
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist

_STORE_TIMEOUT = timedelta(seconds=300)


@dataclass
class StoreStats:
    """Store operations one rank made and the bytes they moved (both directions)."""

    ops: int = 0
    bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    heartbeat: StoreStats | None = None  # what heartbeat threads did (per period, not per call)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str, nbytes: int) -> None:
        if self.heartbeat is not None and threading.current_thread().name == "ddpckpt-heartbeat":
            self.heartbeat.count(name, nbytes)
            return
        with self.lock:
            self.ops += 1
            self.bytes += nbytes
            self.by_op[name] = self.by_op.get(name, 0) + 1
            self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + nbytes

    def snapshot(self) -> tuple[int, int]:
        """Operations and bytes so far, the heartbeat threads' included."""
        beat = self.heartbeat.snapshot() if self.heartbeat is not None else (0, 0)
        with self.lock:
            return self.ops + beat[0], self.bytes + beat[1]


def _size(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8


class CountingStore:
    """A store client that counts each operation (and its bytes) into ``stats``.

    ``clone()`` hands out one of ``spares`` (connected in advance: connections made at once
    by many threads of one process stall for seconds here; a real rank makes two or three, once).
    """

    def __init__(self, store: Any, stats: StoreStats, spares: Sequence[Any] = ()) -> None:
        self._store = store
        self.stats = stats
        self._spares = list(spares)

    def _call(self, name: str, sent: int, *args: Any) -> Any:
        result = getattr(self._store, name)(*args)
        self.stats.count(name, sent + _size(result))
        return result

    def set(self, key: str, value: bytes) -> None:
        self._call("set", _size(key) + _size(value), key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", _size(key), key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", _size(key) + 8, key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", _size(keys), keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        args = (keys,) if timeout is None else (keys, timeout)
        self._call("wait", _size(keys), *args)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", _size(keys), keys)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call("multi_set", _size(keys) + _size(values), keys, values)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(
            "compare_set", _size(key) + len(expected) + len(desired), key, expected, desired
        )

    def append(self, key: str, value: bytes) -> None:
        self._call("append", _size(key) + _size(value), key, value)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", _size(key), key)

    def clone(self) -> CountingStore:
        client = self._spares.pop() if self._spares else self._store.clone()
        return CountingStore(client, self.stats)


class Server:
    """A TCPStore server on 127.0.0.1 and its clients, one per simulated rank."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port  # another process's server
        if port is None:
            self.store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
            )
            self.port = self.store.port

    def client(self) -> Any:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=_STORE_TIMEOUT)


def run_ranks(
    n: int,
    body: Callable[[int, Any], Any],
    server: Server | None = None,
    share: Sequence[int] | None = None,
    ready: Callable[[], None] = lambda: None,
) -> tuple[list[Any], list[StoreStats]]:
    """Run ``body(rank, store)`` on ``n`` threads, each with its own counting store client.

    Returns each rank's result (or the exception it raised) and its store statistics.
    With ``share``, runs only those ranks (this process's share of a multi-process
    simulation), calling ``ready()`` once they are connected, before any starts.
    """
    server = server or Server()
    share = list(range(n)) if share is None else list(share)
    stats = [StoreStats(heartbeat=StoreStats()) for _ in range(n)]
    with ThreadPoolExecutor(64) as pool:  # a connect can wait seconds: overlap them
        clients = list(pool.map(lambda _: server.client(), range(4 * len(share))))
    stores = {
        r: CountingStore(clients[4 * i], stats[r], clients[4 * i + 1 : 4 * i + 4])
        for i, r in enumerate(share)
    }
    results: list[Any] = [None] * n
    ready()
    start = threading.Barrier(len(share))

    def run(rank: int) -> None:
        start.wait()
        try:
            results[rank] = body(rank, stores[rank])
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in share]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, stats


# --------------------------------------------------------------------- the two versions


class _ThreadRanks:
    """Gives a ``comm.py`` without a store seam (the old one) each thread's rank and store.

    Only for measuring the old code: its module reads ``torch.distributed`` for the rank,
    the world size and the default store, and counts calls in a module-wide counter.
    """

    def __init__(self, module: ModuleType) -> None:
        self.local = threading.local()
        real = module.dist
        shim = self

        class _Dist:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def is_available(self) -> bool:
                return True

            def is_initialized(self) -> bool:
                return True

            def get_rank(self) -> int:
                return shim.local.rank

            def get_world_size(self) -> int:
                return shim.local.world

        class _Counter:
            def __next__(self) -> int:
                shim.local.op += 1
                return shim.local.op

        module.dist = _Dist()
        module._op_counter = _Counter()
        from torch.distributed import distributed_c10d

        original = distributed_c10d._get_default_store

        def default_store() -> Any:
            store = getattr(shim.local, "store", None)
            return store if store is not None else original()

        distributed_c10d._get_default_store = default_store

    def enter(self, rank: int, world: int, store: Any) -> None:
        self.local.rank, self.local.world, self.local.store, self.local.op = rank, world, store, -1


class Version:
    """One ``comm.py`` (and its sibling modules): opens a call for a simulated rank."""

    def __init__(
        self, name: str, module: ModuleType, siblings: dict[str, ModuleType] | None = None
    ) -> None:
        self.name = name
        self.module = module
        self.siblings = siblings or {}
        self.seam = hasattr(module, "StoreGroup")
        self.ranks = None if self.seam else _ThreadRanks(module)

    def sibling(self, name: str) -> ModuleType | None:
        """The version's module ``name`` of ``ddpckpt._coord`` (``copies``, ``liveness``)."""
        if name in self.siblings:
            return self.siblings[name]
        return sys.modules.get(self.module.__name__.rsplit(".", 1)[0] + "." + name)

    def copies(self, comm: Any, domains: list[list[int]], bundle: bytes) -> Any:
        """The copies step of a save on node-local storage, as this version runs it."""
        copies = self.sibling("copies")
        send = lambda: copies.send_to_leaders(comm, domains, bundle)  # noqa: E731
        if hasattr(comm, "run_transfer"):
            return comm.run_transfer("copies", send)
        return comm.run("copies", send)

    def bind(self, rank: int, world: int, store: Any) -> Any:
        """Per thread: what :meth:`open` needs (the old code reads it from thread state)."""
        if self.seam:
            return self.module.StoreGroup(store, rank, world)
        self.ranks.enter(rank, world, store)
        return None

    def open(self, bound: Any, call: str, timeout: float) -> Any:
        if self.seam:
            return self.module.Comm.open(call, timeout=timeout, group=bound)
        return self.module.Comm.open(call, timeout=timeout)

    def decide(self, bound: Any, timeout: float) -> bytes:
        """The ``every_seconds`` decision: one key (new) or a whole call (old)."""
        if self.seam:
            return self.module.Comm.from_leader("bench.decide", lambda: b"0", group=bound)
        with self.open(bound, "bench.decide", timeout) as comm:
            return comm.broadcast("decision", b"0" if comm.rank == 0 else None)


def load_version(revision: str | None) -> Version:
    """The current ``ddpckpt._coord.comm``, or ``comm.py`` as of git ``revision`` (as a sibling module)."""
    import ddpckpt._coord.comm

    if revision is None:
        return Version("current", ddpckpt._coord.comm)
    tag = revision.replace("/", "_").replace("~", "_")
    if _show(revision, "src/ddpckpt/_coord/comm.py") is None:  # before the split into _coord
        text = _show(revision, "src/ddpckpt/comm.py")
        if text is None:
            raise SystemExit(f"{revision}: has no ddpckpt comm module")
        return Version(revision, _exec_module(f"ddpckpt._comm_{tag}", text, f"{revision}:comm.py"))
    # ddpckpt/_coord/: the revision's own modules, each importing the revision's siblings
    # (put in sys.modules only while they are loaded)
    siblings: dict[str, ModuleType] = {}
    current = {name: sys.modules.get(f"ddpckpt._coord.{name}") for name in _COORD}
    try:
        for name in _COORD:
            text = _show(revision, f"src/ddpckpt/_coord/{name}.py")
            if text is None:
                continue
            module = _exec_module(f"ddpckpt._coord._{name}_{tag}", text, f"{revision}:{name}.py")
            siblings[name] = sys.modules[f"ddpckpt._coord.{name}"] = module
    finally:
        for name, module in current.items():
            if module is not None:
                sys.modules[f"ddpckpt._coord.{name}"] = module
    return Version(revision, siblings.pop("comm"), siblings)


_COORD = ("store", "failures", "liveness", "exchange", "copies", "comm")  # in import order


def _show(revision: str, path: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=root, capture_output=True, text=True
    )
    return shown.stdout if shown.returncode == 0 else None


def _exec_module(name: str, text: str, origin: str) -> ModuleType:
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    module.__package__ = name.rsplit(".", 1)[0]
    sys.modules[name] = module
    exec(compile(text, origin, "exec"), module.__dict__)
    return module


# --------------------------------------------------------------------- scenarios

LATE = "run, 1 rank 1 s late"
NODE_LOCAL = "save, node-local"
COLLECTIVES = (
    "open+close", "run", "run_reduce", "broadcast", "barrier", LATE, "save", NODE_LOCAL, "load",
    "should_save",
)  # fmt: skip
_TENSORS = 24  # shared tensors each rank writes in the simulated save (balanced over ranks)
RANKS_PER_NODE = 8  # for the node-local save: each node's ranks share its disk


def node_domains(n: int) -> list[list[int]]:
    """The storage domains of ``n`` ranks on node-local disks, ``RANKS_PER_NODE`` a node."""
    return [
        list(range(first, min(first + RANKS_PER_NODE, n))) for first in range(0, n, RANKS_PER_NODE)
    ]


class Connections:
    """Counts the gloo connections each simulated rank opens (``size - 1`` per group)."""

    def __init__(self) -> None:
        self.by_rank: dict[int, int] = {}
        self.local = threading.local()
        self._lock = threading.Lock()
        self._real = dist.ProcessGroupGloo

    def __enter__(self) -> Connections:
        counter = self

        def counting(store: Any, rank: int, size: int, *args: Any) -> Any:
            me = getattr(counter.local, "rank", None)
            if me is not None:
                with counter._lock:
                    counter.by_rank[me] = counter.by_rank.get(me, 0) + size - 1
            return counter._real(store, rank, size, *args)

        dist.ProcessGroupGloo = counting  # type: ignore[misc]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.ProcessGroupGloo = self._real  # type: ignore[misc]


def _write_result(rank: int) -> dict[str, Any]:
    """A rank's result of the write step as ``ddpckpt._io.writing`` makes it (sizes alike)."""
    entry = {"file": f"model-{rank:05d}.safetensors", "key": "", "dtype": "F32",
             "shape": [1024, 1024], "offsets": [0, 4194304], "xxh3_64": "0123456789abcdef"}  # fmt: skip
    files = [{"name": f"model-{rank:05d}.safetensors", "size": 4194304 * _TENSORS,
              "xxh3_64": "0123456789abcdef", "writer": rank}]  # fmt: skip
    return {
        "files": files,
        "tensors": {f"model/layer{rank}.{i}.weight": {**entry, "key": f"w{i}"} for i in range(_TENSORS)},
        "rank_keys": ["rng"],
        "rank_file": {"name": f"rank-{rank:05d}.safetensors", "size": 9000,
                      "xxh3_64": "0123456789abcdef", "writer": rank},
    }  # fmt: skip


def _save(
    version: Version, bound: Any, rank: int, timeout: float, domains: list[list[int]] | None = None
) -> None:
    """The store exchanges of one ``ddpckpt.save`` on shared storage (no files written):
    capture, the layout and digest checks, the storage probe, prepare, write, commit.
    With ``domains`` (node-local storage), the copies step too: every rank's rank file
    (9 kB) to every other domain's first rank, over gloo."""
    digests = lambda: ["0123456789abcdef"] * 8  # noqa: E731  the canaries' digests
    with version.open(bound, "bench.save", timeout) as comm:
        comm.run("capture", lambda: None)
        _reduce(
            comm,
            "layout",
            lambda: "fingerprint",
            lambda v: [r for r, f in enumerate(v) if f != v[0]],
        )
        _reduce(
            comm, "digests", digests, lambda v: [i for i in range(8) if len({g[i] for g in v}) > 1]
        )
        comm.run("probe", lambda: None)
        _reduce(comm, "look", lambda: [0] if rank == 0 else None, lambda v: {0: [0]})
        if domains is not None:
            version.copies(comm, domains, b"r" * 9000)
        _reduce(comm, "prepare", lambda: False, lambda v: v[0])
        if hasattr(comm, "run_scatter"):
            comm.run_scatter(
                "write", lambda: _write_result(rank), lambda v: {0: v}, receive=rank == 0
            )
        else:
            comm.run_all("write", lambda: _write_result(rank))
        comm.run("commit", lambda: None)  # fmt: skip


def _load(version: Version, bound: Any, rank: int, timeout: float) -> None:
    """The store exchanges of one ``ddpckpt.load``: locate, this rank's part, check, restore."""
    with version.open(bound, "bench.load", timeout) as comm:
        comm.run("previous save", lambda: None)
        _reduce(comm, "locate", lambda: {"id": "0123456789ab"}, lambda v: {"lacking": []})
        comm.run("rank part", lambda: None)
        comm.run("check", lambda: None)
        comm.run("restore", lambda: None)


def _reduce(
    comm: Any, tag: str, step: Callable[[], Any], reduce: Callable[[list[Any]], Any]
) -> Any:
    if hasattr(comm, "run_reduce"):
        return comm.run_reduce(tag, step, reduce)
    return reduce(comm.run_all(tag, step))


def _reduced(comm: Any, rank: int) -> Any:
    """The same result as ``run_all`` feeds, reduced to one answer (the newest step, say);
    a comm.py without ``run_reduce`` reduces every rank's results itself, as callers did."""
    step, newest = lambda: {"rank": rank, "ok": True}, lambda v: max(r["rank"] for r in v)
    if hasattr(comm, "run_reduce"):
        return comm.run_reduce("run_reduce", step, newest)
    return newest(comm.run_all("run_reduce", step))


def measure_collectives(
    version: Version, n: int, timeout: float, max_node_local: int = 1 << 30
) -> dict[str, dict[str, float]]:
    """Per collective: store ops and bytes per rank (mean, rank 0's), wall time; for the
    node-local save (up to ``max_node_local`` ranks), gloo connections per rank too.

    Heartbeat threads' operations count too (liveness checks run there in the new code).
    """
    connections = Connections()
    marks: list[dict[str, tuple[int, int, float]]] = [{} for _ in range(n)]
    mains: list[dict[str, int]] = [{} for _ in range(n)]  # without the heartbeat threads' ops
    walls: dict[str, list[float]] = {c: [0.0, 0.0] for c in COLLECTIVES}
    lock = threading.Lock()

    def body(rank: int, store: Any) -> None:
        bound = version.bind(rank, n, store)
        record = marks[rank]
        connections.local.rank = rank

        def timed(name: str, action: Callable[[], Any]) -> Any:
            ops, nbytes = store.stats.snapshot()
            main = store.stats.ops
            started = time.monotonic()
            out = action()
            ended = time.monotonic()
            after = store.stats.snapshot()
            record[name] = (after[0] - ops, after[1] - nbytes, ended - started)
            mains[rank][name] = store.stats.ops - main
            with lock:
                span = walls[name]
                span[0] = started if span[0] == 0 else min(span[0], started)
                span[1] = max(span[1], ended)
            return out

        comm = timed("open+close", lambda: version.open(bound, "bench.call", timeout))
        timed("run", lambda: comm.run("run", lambda: rank))
        timed("run_reduce", lambda: _reduced(comm, rank))
        timed("broadcast", lambda: comm.broadcast("bcast", b"x" * 64 if rank == 0 else None))
        timed("barrier", lambda: comm.barrier("barrier"))
        timed(LATE, lambda: comm.run("late", lambda: time.sleep(1.0 if rank == n - 1 else 0)))
        ops, nbytes = store.stats.snapshot()
        main = store.stats.ops
        comm.close()
        after = store.stats.snapshot()
        mains[rank]["open+close"] += store.stats.ops - main
        opened = record["open+close"]
        record["open+close"] = (
            opened[0] + after[0] - ops,
            opened[1] + after[1] - nbytes,
            opened[2],
        )
        timed("save", lambda: _save(version, bound, rank, timeout))
        if n <= max_node_local:
            domains = node_domains(n)
            timed(NODE_LOCAL, lambda: _save(version, bound, rank, timeout, domains))
        timed("load", lambda: _load(version, bound, rank, timeout))
        timed("should_save", lambda: version.decide(bound, timeout))

    with connections:
        results, _ = run_ranks(n, body)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    report = {}
    for name in COLLECTIVES:
        if name not in marks[0]:
            continue
        per_rank = [m[name] for m in marks]
        report[name] = {
            "ops_mean": sum(p[0] for p in per_rank) / n,
            "ops_rank0": per_rank[0][0],
            "ops_max_other": max(p[0] for p in per_rank[1:]),
            "calls_rank0": mains[0][name],  # the call's own operations (no heartbeats)
            "calls_max_other": max(m[name] for m in mains[1:]),
            "bytes_mean": sum(p[1] for p in per_rank) / n,
            "bytes_rank0": per_rank[0][1],
            "bytes_total": sum(p[1] for p in per_rank),
            "wall_s": walls[name][1] - walls[name][0],
        }
    if NODE_LOCAL in report:
        report[NODE_LOCAL]["connections_max"] = max(connections.by_rank.values(), default=0)
        report[NODE_LOCAL]["connections_total"] = sum(connections.by_rank.values())
    return report


def measure_detection(
    version: Version, n: int, timeout: float, processes: int = 1
) -> dict[str, float]:
    """A rank that never calls: seconds until rank 0 and the last other rank raise.

    Times count from the first rank's call; ``rank0_own_s`` from rank 0's own call (the
    threads of the simulation start their calls up to ``start_spread_s`` apart). With
    ``processes`` > 1 the ranks are spread over that many processes (forked, each with
    its threads), so that fewer threads share one interpreter lock.
    """
    if processes == 1:
        found = _detect(version, n, timeout, Server(), None, lambda: None)
    else:
        found = _detect_in_processes(version, n, timeout, processes)
    return _detection_report(version, n, timeout, found)


def _detect_in_processes(version: Version, n: int, timeout: float, processes: int) -> dict:
    import multiprocessing

    server = Server()
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(processes), context.Queue()

    def child(share: list[int]) -> None:
        queue.put(_detect(version, n, timeout, Server(server.port), share, barrier.wait))

    workers = [
        context.Process(target=child, args=(list(range(p, n, processes)),), daemon=True)
        for p in range(processes)
    ]
    for worker in workers:
        worker.start()
    parts = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    found: dict[str, Any] = {"results": [None] * n, "ops": [0] * n}
    for key in ("starts", "raised"):
        found[key] = {r: t for part in parts for r, t in part[key].items()}
    found["judged"] = [j for part in parts for j in part["judged"]]
    for part in parts:
        for r, result in part["results"].items():
            found["results"][r] = result
            found["ops"][r] = part["ops"][r]
    return found


def _detect(
    version: Version,
    n: int,
    timeout: float,
    server: Server,
    share: list[int] | None,
    ready: Callable[[], Any],
) -> dict[str, Any]:
    silent = n - 1
    raised: dict[int, float] = {}
    starts: dict[int, float] = {}
    judged: list[tuple[float, int]] = []  # rank 0's liveness checks: seconds, store operations
    liveness = version.sibling("liveness")
    original = getattr(getattr(liveness, "Liveness", None), "_judge", None)

    def timed_judge(self: Any, client: Any, watch: Any) -> None:
        if self.group.rank != 0:
            return original(self, client, watch)
        ops = client.stats.snapshot()[0] if hasattr(client, "stats") else 0
        started = time.perf_counter()
        try:
            return original(self, client, watch)
        finally:
            after = client.stats.snapshot()[0] if hasattr(client, "stats") else 0
            judged.append((time.perf_counter() - started, after - ops))

    def body(rank: int, store: Any) -> str:
        bound = version.bind(rank, n, store)
        if rank == silent:
            return "silent"
        starts[rank] = time.monotonic()
        try:
            with version.open(bound, "bench.detect", timeout) as comm:
                comm.run("work", lambda: None)
        except TimeoutError as exc:
            raised[rank] = time.monotonic()
            return type(exc).__name__
        return "no error"

    if original is not None:
        liveness.Liveness._judge = timed_judge
    try:
        results, stats = run_ranks(n, body, server, share, ready)
    finally:
        if original is not None:
            liveness.Liveness._judge = original
    mine = range(n) if share is None else share
    return {
        "starts": starts,
        "raised": raised,
        "judged": judged,
        "results": {
            r: results[r] if isinstance(results[r], str) else repr(results[r]) for r in mine
        },
        "ops": {r: stats[r].snapshot()[0] for r in mine},
    }


def _detection_report(version: Version, n: int, timeout: float, found: dict) -> dict[str, float]:
    silent = n - 1
    starts, raised, judged = found["starts"], found["raised"], found["judged"]
    ops = [found["ops"][r] for r in range(n)]
    results = [found["results"][r] for r in range(n)]
    unexpected = [
        r for r in results[:silent] if r != "TimeoutError" and r != "CollectiveTimeoutError"
    ]
    if unexpected:
        raise RuntimeError(f"{version.name}: a silent rank was not reported: {unexpected[:3]}")
    begin = min(starts.values())
    others = [raised[r] for r in range(1, silent)] or [raised[0]]
    return {
        "timeout_s": timeout,
        "start_spread_s": max(starts.values()) - begin,
        "rank0_own_s": raised[0] - starts[0],
        "rank0_s": raised[0] - begin,
        "last_s": max(others) - begin,
        "ratio": (max(max(others), raised[0]) - begin) / timeout,
        "ops_rank0": ops[0],
        "ops_mean": sum(ops[:silent]) / silent,
        "judge_count": len(judged),
        "judge_ms_mean": 1000 * sum(t for t, _ in judged) / max(1, len(judged)),
        "judge_ms_max": 1000 * max((t for t, _ in judged), default=0.0),
        "judge_ops_max": max((o for _, o in judged), default=0),
    }


# --------------------------------------------------------------------- report


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        "| comm.py | N | collective | ops/rank (mean) | ops rank 0 | ops other (max) | "
        "bytes/rank (mean) | bytes rank 0 | server bytes | gloo connections/rank (max) | wall s |"
    )
    lines = [header, "|" + "---|" * 11]
    for row in rows:
        links = row.get("connections_max")
        lines.append(
            f"| {row['version']} | {row['n']} | {row['collective']} | {row['ops_mean']:.1f} | "
            f"{row['ops_rank0']} | {row['ops_max_other']} | {row['bytes_mean']:,.0f} | "
            f"{row['bytes_rank0']:,} | {row['bytes_total']:,} | "
            f"{'' if links is None else links} | {row['wall_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--before", default=None, help="git revision of the old comm.py")
    parser.add_argument("--before-max", type=int, default=256, help="largest N for the old one")
    parser.add_argument(
        "--node-local-max", type=int, default=256,
        help="largest N of the node-local save (its gloo sockets are file descriptors here)",
    )  # fmt: skip
    parser.add_argument(
        "--before-node-local-max", type=int, default=64,
        help="largest N of the old one's node-local save (a full mesh: N^2 sockets in one process)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0, help="for the collectives")
    parser.add_argument("--detect-timeout", type=float, default=3.0)
    parser.add_argument("--no-detect", action="store_true")
    parser.add_argument("--processes", type=int, default=1, help="for detection: ranks spread over")
    parser.add_argument("--only-detect", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    versions = [load_version(None)]
    if args.before:
        versions.insert(0, load_version(args.before))
    rows, detections = [], []
    for n in args.ranks:
        for version in versions:
            if version is not versions[-1] and n > args.before_max:
                continue
            if not args.only_detect:
                old = version is not versions[-1]
                most = args.before_node_local_max if old else args.node_local_max
                report = measure_collectives(version, n, args.timeout, most)
                for name, values in report.items():
                    rows.append({"version": version.name, "n": n, "collective": name, **values})
                _say(_table([r for r in rows if r["n"] == n and r["version"] == version.name]))
            if not args.no_detect:
                found = measure_detection(version, n, args.detect_timeout, args.processes)
                name = version.name + (
                    f", {args.processes} processes" if args.processes > 1 else ""
                )
                detections.append({"version": name, "n": n, **found})
                _say(json.dumps(detections[-1]))
    _say("")
    _say(_table(rows))
    _say("")
    _say(
        "| comm.py | N | timeout s | calls start spread s | rank 0 raised s (own call) | "
        "last rank raised s | rank 0 own / timeout | worst / timeout | ops rank 0 | ops/rank | "
        "rank 0 checks | check ms mean / max | check ops max |"
    )
    _say("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in detections:
        _say(
            f"| {d['version']} | {d['n']} | {d['timeout_s']:g} | {d['start_spread_s']:.2f} | "
            f"{d['rank0_s']:.2f} ({d['rank0_own_s']:.2f}) | {d['last_s']:.2f} | "
            f"{d['rank0_own_s'] / d['timeout_s']:.2f}x | {d['ratio']:.2f}x | {d['ops_rank0']} | "
            f"{d['ops_mean']:.0f} | {d['judge_count']} | {d['judge_ms_mean']:.2f} / "
            f"{d['judge_ms_max']:.2f} | {d['judge_ops_max']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"collectives": rows, "detection": detections}, indent=1))


if __name__ == "__main__":
    main()
