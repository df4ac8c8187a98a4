"""Commands on one checkpoint: ``inspect``, ``verify``, ``export``, ``import``."""

from __future__ import annotations

import argparse
import json

from ddpckpt._cli._format import size, table, when
from ddpckpt._cli.command import CannotRun, Command
from ddpckpt.errors import CheckpointError, CheckpointExistsError
from ddpckpt.storage._location import locate


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (step-N/), local or s3://")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-tensors", action="store_true", help="omit the tensor table")


def _inspect(args: argparse.Namespace) -> int:
    from ddpckpt._cli.tools import summary

    info = summary(args.checkpoint, tensors=not args.no_tensors)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    metrics = ", ".join(f"{k}={v}" for k, v in info["metrics"].items()) or "-"
    print(f"checkpoint  {info['path']}")
    print(f"step        {info['step']}    epoch {info['epoch']}    metrics {metrics}")
    print(f"created     {when(info['created'])} on {info['host']}")
    print(
        f"written by  ddpckpt {info['library_version']} (format {info['format_version']}), "
        f"torch {info['torch_version']}, {info['world_size']} rank(s)"
    )
    copy = info["copy"]
    if copy.get("count", 1) > 1:
        print(f"copy        {copy['index'] + 1} of {copy['count']} (node-local storage)")
    print(
        f"size        {size(info['bytes'])} in {info['files']} files, {info['tensor_count']} tensors"
    )
    for name, kind in info["sections"].items():
        if name.startswith("optimizer_groups"):  # "optimizer_groups NAME" for named ones
            owner = name.removeprefix("optimizer_groups").strip()
            for i, group in enumerate(kind):
                hyper = ", ".join(f"{k}={v}" for k, v in group.items())
                print(f"  {owner + ' ' if owner else ''}param group {i}: {hyper}")
        elif name == "extra":
            print(f"  extra: {', '.join(f'{k} ({v})' for k, v in kind.items())}")
        else:
            print(f"  {name}: {kind}")
    if not args.no_tensors:
        print()
        rows = [
            (t["name"], t["dtype"], list(t["shape"]), size(t["bytes"]), t["file"])
            for t in info["tensors"]
        ]
        print(table(("tensor", "dtype", "shape", "size", "file"), rows))
    return 0


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", metavar="checkpoint", help="checkpoint directories")


def _verify(args: argparse.Namespace) -> int:
    from ddpckpt._cli.tools import open_manifest
    from ddpckpt._io.reader import find_problems
    from ddpckpt.errors import CheckpointNotFoundError

    status = 0
    for path in args.checkpoints:
        location = locate(path)
        try:
            open_manifest(location)
        except CheckpointNotFoundError as exc:  # not a checkpoint at all: nothing to verify
            status = 2
            print(f"ERROR {path}\n      {exc}")
            continue
        except CheckpointError:
            pass  # incomplete or corrupt: find_problems says how
        problems = find_problems(location)
        if problems:
            status = max(status, 1)
            print(f"BAD   {path}")
            for problem in problems:
                print(f"      {problem}")
        else:
            print(f"OK    {path}")
    return status


def _shard_size(text: str) -> int:
    """``--max-shard-size`` read by argparse: out of range is a usage error (exit 2)."""
    from ddpckpt._cli.export import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (step-N/), local or s3://")
    p.add_argument(
        "out",
        help="what to write: OUT.safetensors (no pickle), OUT.pt (torch.save), or OUT without "
        "a suffix (or OUT/): a Hugging Face directory (model.safetensors, or model-0000i-of-0000n.safetensors "
        "and model.safetensors.index.json); with --format dcp, a DCP directory",
    )
    p.add_argument(
        "--format",
        choices=["dcp"],
        help="dcp: a torch.distributed.checkpoint directory that dcp.load reads into "
        '{"model": ..., "optim": ...} of get_state_dict (the weights, and the optimizer\'s '
        "state and param groups)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--model", help="the model to export, of a checkpoint of several")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=_shard_size,
        help="a directory's largest file before it is split, as 5GB, 500MB or bytes "
        "(default 5GB; decimal units, as Hugging Face's)",
    )


def _export(args: argparse.Namespace) -> int:
    from ddpckpt._cli.export import export
    from ddpckpt._cli.export_dcp import export_dcp

    if args.format == "dcp" and args.max_shard_size is not None:
        raise CannotRun("--max-shard-size is for a Hugging Face directory, not --format dcp")
    try:
        if args.format == "dcp":
            out = export_dcp(args.checkpoint, args.out, overwrite=args.overwrite, model=args.model)
        else:
            out = export(args.checkpoint, args.out, overwrite=args.overwrite, model=args.model,
                         max_shard_size=args.max_shard_size)  # fmt: skip
    except FileExistsError:
        raise CannotRun(f"{args.out} exists; pass --overwrite to replace it") from None
    print(f"wrote {out}")
    return 0


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "legacy",
        help="a file written by torch.save, a Lightning .ckpt, a torch.distributed.checkpoint "
        "(DCP) directory, a Trainer checkpoint-N directory, an Accelerate save_state directory, "
        "a DeepSpeed ZeRO checkpoint directory or a directory of safetensors weights",
    )
    p.add_argument("outdir", help="the ddpckpt checkpoint directory to create")
    p.add_argument("--model-key", help="the entry holding the model weights, if not detected")
    p.add_argument(
        "--trust-global",
        action="append",
        default=[],
        metavar="MODULE.NAME",
        help="allow unpickling this plain data class (repeatable); never a function",
    )
    p.add_argument(
        "--trusted-source",
        action="store_true",
        help="allow importing with a torch whose weights_only loader has known bypasses",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUTDIR if it is a checkpoint")


def _import(args: argparse.Namespace) -> int:
    from ddpckpt.convert import import_checkpoint

    try:
        imported = import_checkpoint(
            args.legacy,
            args.outdir,
            model_key=args.model_key,
            trusted_globals=args.trust_global,
            trusted_source=args.trusted_source,
            overwrite=args.overwrite,
        )
    except CheckpointExistsError:
        raise CannotRun(
            f"{args.outdir}: a checkpoint already exists here; pass --overwrite to replace it, "
            "or name another output directory"
        ) from None
    print(f"imported {args.legacy} -> {imported.path}")
    for item in imported.left_out:
        print(f"  left out: {item}")
    return 0


INSPECT = Command(
    "inspect",
    "show a checkpoint's metadata and tensors",
    _inspect_arguments,
    _inspect,
    description="Show a checkpoint's step, epoch, metrics, who wrote it (library, torch, "
    "world size), its sections (model, optimizers with their param groups, scheduler, "
    "scaler, extras) and a table of every tensor with dtype, shape, size and file. "
    "Reads the manifest (and, for the table of a sharded checkpoint, the index files that "
    "list its shards) only: run 'ddpckpt verify' to check the data.",
)
VERIFY = Command(
    "verify",
    "check every file against its checksums (exit 1 if bad)",
    _verify_arguments,
    _verify,
    description="Read every file of each checkpoint and check it against the checksums its "
    "manifest records (every file and every tensor). Prints OK or the damaged files; "
    "exit 1 if any checkpoint is damaged or incomplete, 2 if a path is not a checkpoint.",
)
EXPORT = Command(
    "export",
    "write the model weights to OUT.safetensors, OUT.pt, a Hugging Face or a DCP directory",
    _export_arguments,
    _export,
    description="Write one model's weights as a plain state dict (no 'module.' or "
    "'_orig_mod.' prefixes), for inference: load it with safetensors.torch.load_file or "
    "torch.load and model.load_state_dict, a directory with from_pretrained (add its "
    "config.json) or huggingface_hub.load_torch_model. One tensor is in memory at a time "
    "(a sharded one assembled from its pieces), and OUT appears only once complete. The "
    "checkpoint is verified while it is read. --format dcp writes a "
    "torch.distributed.checkpoint directory with the optimizer too, for DCP-based tools.",
)
IMPORT = Command(
    "import",
    "convert a torch.save / Lightning file, a DCP, Trainer, Accelerate, DeepSpeed or "
    "safetensors directory (no pickle code runs)",
    _import_arguments,
    _import,
    description="Convert a checkpoint written with torch.save (a state dict, the usual "
    "{'model': ..., 'optimizer': ...} dicts, a Lightning .ckpt) or a "
    "torch.distributed.checkpoint directory (dcp.save; a sharded save's pieces "
    "put together; torchtitan's layout too), a Hugging Face Trainer checkpoint-N directory "
    "or an Accelerate "
    "save_state directory (each process's random streams kept as that rank's) or a "
    "DeepSpeed ZeRO checkpoint, stage 1, 2 or 3 (fp32 master weights and moments put together from "
    "every rank's slice) into a "
    "ddpckpt checkpoint. torch.save files and DCP's items are read with "
    "torch's weights-only unpickler, DCP's .metadata with one that knows only DCP's own "
    "metadata records: a pickle naming any other global is refused before it runs. "
    "Optimizer state keyed by position (torch.save) is matched by position when loaded; "
    "keyed by parameter name (DCP's get_state_dict), by name.",
)
