"""What one rank pays per save and per resume as the job grows: the library's own functions
run for one simulated rank of N, at N = 16 to 16,384, in one process.

Run it from a source checkout (``pip install -e .``, or ``PYTHONPATH=src``)::

    python benchmarks/scale.py [--ranks 16,256,1024,4096,16384] [--model 7b|70b] [--layers N]
        [--layouts ddp,zero1,fsdp2,hsdp] [--json out.json]

The state is 7B-like (32 transformer blocks of 4096-wide attention and 11008-wide MLP
weights, an embedding and an output layer: 291 parameters) or 70B-like (``--model 70b``: 80
blocks 8192 wide, 28672-wide MLP, grouped-query keys and values 1024 wide: 723 parameters),
with AdamW's two moments, in fp32, held by DDP (every tensor replicated, each written by one
rank), ZeRO-1 (the moments written by the rank whose partition holds the parameter), or as
DTensors by FSDP2 (``Shard(0)`` over all N ranks) or HSDP (``Replicate`` over N/8 nodes,
``Shard(0)`` over each node's 8 ranks), 8 ranks per node.
Per layout and N it reports, for the last rank:

* ``plan ms``: CPU time of deciding what it writes at a save (its shards and its share
  of the replicated tensors), on the training thread, best of 3 (the real
  ``plan_shards`` and ``plan_owners``);
* ``fingerprint B``: the bytes of the layout every rank hashes and compares at a save;
* ``manifest B``: the manifest's records of the sharded state (each tensor's shape, mesh
  and placements, and each mesh's ranks as runs: format 6), which one rank per storage
  domain writes and every rank reads at a load, as the manifest writer encodes them;
* ``files B``: the manifest's list of files (each with its size and digest: four per
  writing rank up to ``TABLE_RANKS`` ranks; from there on (format 7) the files holding
  whole tensors and one entry per file table), which every rank reads with it;
* ``table B`` and ``tables``: the file table listing this rank's own files (format 7),
  and how many tables it reads to load its own shards (its own, and those of the ranks
  that wrote them);
* ``index B`` and ``indexes``: the index file this rank writes (its shards' records),
  and how many index files it reads to load its own shards (the real ``ShardIndex``);
* ``held B``: what the fast tier's resume sends every rank about which node holds which
  step (one node lacking the newest step), through rank 0's store;
* ``ExactResume B`` and ``ExactResume read B``: what Lightning's ``ExactResume`` puts in
  each checkpoint (a reference to the state each rank saves beside it; before 2026-11-28
  every rank's state, gathered at rank 0), and what one rank reads of it at a resume (the
  manifest of that state, its file table and its own state);
* ``fast rounds`` and ``fast files``: a fast save's sequential rounds of transfers between
  nodes (each node's ranks' own files to its ``FastTier.partners`` nodes, default 1, then
  rank 0's shared state by doubling), and the ranks' own files each node then keeps (the
  real :class:`~ddpckpt._coord.plan.Partners` and :class:`~ddpckpt._coord.plan.FanOut`);
* ``repair rounds`` and ``repair parts``: a repair when every node but one was replaced
  (the real :class:`~ddpckpt._coord.plan.FanOut` of a file to N/8 - 1 nodes): the
  sequential rounds, and the most transfers one rank takes part in.

Each column is either flat in N (the per-rank costs fixed so far) or grows with N (those
still to fix): the report says which, from the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from ddpckpt._coord.plan import FanOut, Partners, assign, plan_owners
from ddpckpt._format import filetable
from ddpckpt._format.filetable import FileTable
from ddpckpt._format.manifest import Manifest, file_to_json
from ddpckpt._format.manifestfields import tensor_to_json
from ddpckpt._format.shardgrid import SHARD_WRITERS, cells_overlapping
from ddpckpt._format.shardindex import ShardIndex, index_document
from ddpckpt._format.tensorfile import CHUNK, FileEntry, TensorEntry
from ddpckpt._io.shardwrite import piece_json, plan_shards, shard_specs
from ddpckpt._run.fast_steps import by_step
from ddpckpt._state.sharded import MeshLayout, ShardedTensor
from ddpckpt._state.snapshot import Snapshot
from ddpckpt.integrations._ranks import capture_streams, pack
from ddpckpt.storage._location import locate

PER_NODE = 8


# width, MLP width, key/value width (grouped-query attention), blocks
MODELS = {"7b": (4096, 11008, 4096, 32), "70b": (8192, 28672, 1024, 80)}


def shapes(layers: int, model: str = "7b") -> dict[str, tuple[int, ...]]:
    """A 7B-like or 70B-like model's parameters (name: global shape), of ``layers`` blocks."""
    width, mlp, kv, _ = MODELS[model]
    found: dict[str, tuple[int, ...]] = {
        "embed.weight": (32000, width),
        "head.weight": (32000, width),
    }
    for i in range(layers):
        for proj, shape in (("q", (width, width)), ("k", (kv, width)), ("v", (kv, width)),
                            ("o", (width, width))):  # fmt: skip
            found[f"layers.{i}.attn.{proj}.weight"] = shape
        for proj, shape in (
            ("gate", (mlp, width)),
            ("up", (mlp, width)),
            ("down", (width, mlp)),
        ):
            found[f"layers.{i}.mlp.{proj}.weight"] = shape
        found[f"layers.{i}.norm1.weight"] = (width,)
        found[f"layers.{i}.norm2.weight"] = (width,)
    found["norm.weight"] = (width,)
    return found


def layout_of(kind: str, ranks: int) -> MeshLayout:
    order = tuple(range(ranks))
    if kind == "fsdp2":
        return MeshLayout((ranks,), order, ("S0",))
    return MeshLayout((ranks // PER_NODE, PER_NODE), order, ("R", "S0"))


def snapshot_for(kind: str, ranks: int, rank: int, layers: int, model: str = "7b") -> Snapshot:
    """``rank``'s sharded state: each parameter and its two AdamW moments, as empty local
    shards of the right sizes (no memory is touched)."""
    layout = layout_of(kind, ranks)
    sharded = {}
    for name, shape in shapes(layers, model).items():
        size = layout.region(shape, rank)[1]
        for part in ("", ".exp_avg", ".exp_avg_sq"):
            local = torch.empty(size, dtype=torch.float32, device="meta")
            sharded[f"{name}{part}"] = ShardedTensor(local, shape, layout)
    return Snapshot(sharded=sharded, tensors={"step": torch.zeros(())}, balanced={"step"})


def plan_ms(snapshot: Snapshot, ranks: int, rank: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        plan_shards(snapshot, [list(range(ranks))], rank, ranks)
        plan_owners({"step": 8}, range(ranks), {"step"})
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def sharded_records(snapshot: Snapshot, ranks: int, rank: int) -> dict[str, int]:
    """What the manifest and this rank's index hold of the sharded state, and how many
    indexes it reads to load its own shards."""
    plan = plan_shards(snapshot, [list(range(ranks))], rank, ranks)
    records = shard_specs(plan.specs, "ckpt")
    manifest = json.loads(Manifest(shards=records, meshes=dict(plan.meshes)).to_json("ckpt"))
    pieces = {}
    for name, offsets in plan.pieces.items():
        size = snapshot.sharded[name].local.shape
        nbytes = size.numel() * 4
        key = f"{name}@{','.join(map(str, offsets))}"
        entry = TensorEntry("model-00000.safetensors", key, "F32", tuple(size), 1 << 33,
                            (1 << 33) + nbytes, "0" * 16,
                            tuple("0" * 16 for _ in range(-(-nbytes // CHUNK))))  # fmt: skip
        pieces[name] = piece_json(offsets, entry)
    index = ShardIndex(
        locate("ckpt"), "id", records, dict(plan.meshes), FileTable(), None, SHARD_WRITERS
    )
    writers = set()
    for name, record in records.items():
        region = snapshot.sharded[name].layout.region(record.shape, rank)
        for cell in cells_overlapping(record.shape, record.mesh, record.placements, region):
            writers.add(index.writer(name, cell))
    files, table = file_lists(ranks, rank)
    own = {rank // filetable.TABLE_RANKS}
    return {
        "manifest_bytes": len(
            json.dumps({"shards": manifest["shards"], "meshes": manifest["meshes"]})
        ),
        "files_bytes": files,
        "table_bytes": table,
        "index_bytes": len(index_document("0" * 12, rank, pieces)),
        "indexes_read": len(writers),
        "tables_read": len(own | {w // filetable.TABLE_RANKS for w in writers}) if table else 0,
    }


def file_lists(ranks: int, rank: int) -> tuple[int, int]:
    """The manifest's list of files (format 7: with its file tables' entries) and the
    table that lists ``rank``'s own files (0 without tables), as the real writer encodes
    them: four files per rank, the shared state in rank 0's state file."""
    files = FileTable()
    for writer in range(ranks):
        for kind in ("model", "state", "rank"):
            name = f"{kind}-{writer:05d}.safetensors"
            files[name] = FileEntry(name, 1 << 33, "0" * 16, writer)
        name = f"shards-{writer:05d}.json"
        files[name] = FileEntry(name, 200_000, "0" * 16, writer)
    blobs = {}
    if ranks > filetable.TABLE_RANKS:
        blobs = files.tabulate({"state-00000.safetensors"}, "0" * 12, 0)
    listed = {name: file_to_json(f) for name, f in files.inline.items()}
    tables = files.tables_to_json() if files.tables else {}
    own = blobs.get(filetable.table_name(rank // filetable.TABLE_RANKS), b"")
    return len(json.dumps(listed)) + len(json.dumps(tables)), len(own)


def held_bytes(ranks: int) -> int:
    views = [
        {"99": "a" * 16, **({} if r // PER_NODE == 3 else {"100": "b" * 16})} for r in range(ranks)
    ]
    return len(json.dumps(by_step(views)))


def repair(ranks: int) -> tuple[int, int]:
    """The rounds of a repair of every node but the first, and the most parts of one rank."""
    fan = FanOut(0, tuple(range(1, max(ranks // PER_NODE, 1))))
    return fan.rounds, max(len(fan.part_at(place)) for place in range(len(fan.receivers) + 1))


def fast_save(ranks: int) -> tuple[int, int]:
    """A fast save's rounds between nodes and the own files the last node keeps."""
    nodes = [list(range(n, n + PER_NODE)) for n in range(0, ranks, PER_NODE)]
    partners = Partners(nodes, 1)
    shared = FanOut(0, tuple(d[0] for d in nodes[1:])).rounds
    return len(partners.shifts) + shared, len(partners.ranks_kept_by(len(nodes) - 1))


def exact_resume(ranks: int, per_rank: int) -> dict[str, int]:
    """What Lightning's ``ExactResume`` puts in each checkpoint (a reference to the ranks'
    own state, saved by each rank beside it), and what one rank reads of that state at a
    resume: the manifest of the state beside it, the file table of its rank (from 129 ranks
    on) and its own state (as the real writers encode them)."""
    manifest = Manifest(id="0" * 12, step=1, world_size=ranks)
    for writer in range(ranks):
        name = f"rank-{writer:05d}.safetensors"
        manifest.files[name] = FileEntry(name, per_rank, "0" * 16, writer)
    tables = {}
    if ranks > filetable.TABLE_RANKS:
        tables = manifest.files.tabulate(set(), manifest.id, 0)
    table = tables.get(filetable.table_name((ranks - 1) // filetable.TABLE_RANKS), b"")
    reference = {"saved": ".ddpckpt-ranks/last.ckpt@step-0000000000", "id": manifest.id}
    return {
        "exact_resume_bytes": len(json.dumps({"ddpckpt.ExactResume": reference})),
        "exact_resume_read": len(manifest.to_json("ckpt")) + len(table) + per_rank,
    }


def replicated(kind: str, ranks: int, layers: int, model: str) -> dict[str, Any]:
    """The per-rank costs of DDP (everything replicated: parameters and AdamW's moments,
    each written by one rank, balanced by the real ``plan_owners``) or ZeRO-1 (the moments
    written by the rank whose partition holds the parameter, balanced the same way), for
    the last rank of ``ranks``: planning, the manifest's records (each tensor stored whole,
    with a digest per 8 MiB), its list of files and file table (the real writers), and the
    layout every rank hashes (as ``check_replicated`` builds it)."""
    rank = ranks - 1
    params = shapes(layers, model)
    sizes, shape_of = {}, {}
    for name, shape in params.items():
        for key in (
            f"model/{name}",
            *(f"optimizer/state/{name}/{m}" for m in ("exp_avg", "exp_avg_sq")),
        ):
            sizes[key], shape_of[key] = math.prod(shape) * 4, shape
    planned = sizes if kind == "ddp" else {n: b for n, b in sizes.items() if n.startswith("model/")}
    best, owners = float("inf"), {}
    for _ in range(3):
        start = time.perf_counter()
        owners = plan_owners(planned, range(ranks), set(planned))
        best = min(best, time.perf_counter() - start)
    if kind == "zero1":  # ZeroRedundancyOptimizer's partition, by parameter size
        partition = assign({n: sizes[f"model/{n}"] for n in params}, range(ranks))
        for name in params:
            for moment in ("exp_avg", "exp_avg_sq"):
                owners[f"optimizer/state/{name}/{moment}"] = partition[name]
    records, files = {}, FileTable()
    for name, nbytes in sizes.items():
        kind_of = "model" if name.startswith("model/") else "state"
        file = f"{kind_of}-{owners[name]:05d}.safetensors"
        chunks = tuple("0" * 16 for _ in range(-(-nbytes // CHUNK)) if nbytes > CHUNK)
        entry = TensorEntry(file, name, "F32", shape_of[name], 1 << 33, (1 << 33) + nbytes,
                            "0" * 16, chunks)  # fmt: skip
        records[name] = tensor_to_json(entry)
        files[file] = FileEntry(file, 1 << 36, "0" * 16, owners[name])
    for writer in range(ranks):
        name = f"rank-{writer:05d}.safetensors"
        files[name] = FileEntry(name, 20_000, "0" * 16, writer)
    blobs = {}
    if ranks > filetable.TABLE_RANKS:
        blobs = files.tabulate({r["file"] for r in records.values()}, "0" * 12, 0)
    listed = {name: file_to_json(f) for name, f in files.inline.items()}
    tables = files.tables_to_json() if files.tables else {}
    table = blobs.get(filetable.table_name(rank // filetable.TABLE_RANKS), b"")
    layout = sorted((n, "torch.float32", list(shape_of[n])) for n in sizes)
    return {
        "tensors": len(sizes),
        "plan_ms": best * 1e3,
        "fingerprint_bytes": len(json.dumps(layout)),
        "manifest_bytes": len(json.dumps(records)),
        "files_bytes": len(json.dumps(listed)) + len(json.dumps(tables)),
        "table_bytes": len(table),
        "index_bytes": 0,
        "indexes_read": 0,
        "tables_read": 1 if table else 0,
    }


def measure(
    kind: str, ranks: int, layers: int, exact_resume_per_rank: int, model: str = "7b"
) -> dict[str, Any]:
    rank = ranks - 1
    common = {
        "held_bytes": held_bytes(ranks),
        **exact_resume(ranks, exact_resume_per_rank),
        "fast_rounds": fast_save(ranks)[0],
        "fast_files": fast_save(ranks)[1],
        "repair_rounds": repair(ranks)[0],
        "repair_parts": repair(ranks)[1],
    }
    if kind in ("ddp", "zero1"):
        return {**replicated(kind, ranks, layers, model), **common}
    snapshot = snapshot_for(kind, ranks, rank, layers, model)
    fingerprint = [[n, *s.fingerprint()] for n, s in sorted(snapshot.sharded.items())]
    return {
        "tensors": len(snapshot.sharded),
        "plan_ms": plan_ms(snapshot, ranks, rank),
        "fingerprint_bytes": len(json.dumps(fingerprint)),
        **sharded_records(snapshot, ranks, rank),
        **common,
    }


def _growth(values: list[float]) -> float:
    """Last over first of ``values``, from the first that is not 0 (a file table exists
    only from ``TABLE_RANKS`` + 1 ranks on)."""
    found = [v for v in values if v]
    return found[-1] / found[0] if found else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,256,1024,4096,16384")
    parser.add_argument("--model", choices=sorted(MODELS), default="7b")
    parser.add_argument("--layers", type=int, help="blocks (default: the model's)")
    parser.add_argument("--layouts", default="ddp,zero1,fsdp2,hsdp")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    counts = [int(n) for n in args.ranks.split(",")]
    per_rank = len(json.dumps(pack({"rng": capture_streams(), "loaders": [{"position": 0}]})))
    layers = args.layers or MODELS[args.model][3]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for kind in args.layouts.split(","):
        results[kind] = {}
        for ranks in counts:
            results[kind][ranks] = row = measure(kind, ranks, layers, per_rank, args.model)
            print(f"{kind} N={ranks}: {json.dumps(row)}", flush=True)
    count = len(shapes(layers, args.model))
    print(
        f"\n{args.model}-like: {count} parameters x 3 (AdamW), one rank of N, {PER_NODE} per node"
    )
    header = ("layout", "N", "plan ms", "fingerprint B", "manifest B", "files B", "table B",
              "tables", "index B", "indexes", "held B", "ExactResume B", "ExactResume read B",
              "fast rounds",
              "fast files", "repair rounds", "repair parts")  # fmt: skip
    print(" | ".join(header))
    for kind, rows in results.items():
        for ranks, r in rows.items():
            print(f"{kind} | {ranks} | {r['plan_ms']:.1f} | {r['fingerprint_bytes']} | "
                  f"{r['manifest_bytes']} | {r['files_bytes']} | {r['table_bytes']} | "
                  f"{r['tables_read']} | {r['index_bytes']} | "
                  f"{r['indexes_read']} | {r['held_bytes']} | {r['exact_resume_bytes']} | "
                  f"{r['exact_resume_read']} | "
                  f"{r['fast_rounds']} | {r['fast_files']} | "
                  f"{r['repair_rounds']} | {r['repair_parts']}")  # fmt: skip
    low, high = counts[0], counts[-1]
    print(f"\nfrom N={low} to N={high} ({high // low}x the ranks):")
    for column in ("plan_ms", "fingerprint_bytes", "manifest_bytes", "files_bytes", "table_bytes",
                   "tables_read", "index_bytes", "indexes_read", "held_bytes", "exact_resume_bytes", "exact_resume_read", "fast_rounds",
                   "fast_files", "repair_rounds", "repair_parts"):  # fmt: skip
        growth = max(_growth([rows[n][column] for n in counts]) for rows in results.values())
        logarithmic = column.startswith(("repair", "fast_rounds")) and all(
            rows[high][column] <= (high // PER_NODE).bit_length() for rows in results.values()
        )
        verdict = "log N" if logarithmic else "flat" if growth < 2 else "grows"
        print(f"  {column}: x{growth:.1f} ({verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
