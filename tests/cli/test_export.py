"""``ddpckpt export`` to a Hugging Face directory: the layout, the split, atomicity, memory.

(The single-file exports are in test_tools.py; sharded checkpoints in tests/test_sharded.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ddpckpt
from ddpckpt._cli.export import export, parse_size, shard_keys
from ddpckpt._cli.main import main
from hostile import manifest_doc, write_manifest
from io_helpers import flip_byte

huggingface_hub = pytest.importorskip("huggingface_hub")


class TiedNet(nn.Module):
    """Embedding and head tied; a BatchNorm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 40)
        self.body = nn.Sequential(nn.Linear(40, 40), nn.BatchNorm1d(40))
        self.head = nn.Linear(40, 100, bias=False)
        self.head.weight = self.embed.weight


def _nbytes(model: nn.Module) -> dict[str, int]:
    return {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}


def test_a_directory_split_as_hugging_face_splits_loads_into_a_plain_model(tmp_path) -> None:
    torch.manual_seed(0)
    trained = TiedNet()
    ddpckpt.save(tmp_path / "step-1", model=nn.DataParallel(trained), step=1)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "step-1"), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes = _nbytes(trained)
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert set(index["weight_map"]) == set(sizes)  # no "module." prefix, tied key included
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in (1, 2, 3)]
    assert sorted(os.listdir(out)) == sorted([*files, "model.safetensors.index.json"])
    for name in files:
        held = load_file(out / name)
        assert {k for k, f in index["weight_map"].items() if f == name} == set(held)
        assert sum(sizes[k] for k in held) <= 20_000 or len(held) == 1  # over the limit: alone
    fresh = TiedNet()
    huggingface_hub.load_torch_model(fresh, out, strict=True)
    for key, value in trained.state_dict().items():  # on a GPU, DataParallel moved it there
        assert torch.equal(fresh.state_dict()[key], value.cpu()), key
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


def test_a_small_model_is_one_model_safetensors_without_an_index(tmp_path) -> None:
    model = nn.Linear(4, 3)
    ddpckpt.save(tmp_path / "ckpt", model=model)
    out = export(tmp_path / "ckpt", tmp_path / "hf/")
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights.keys() == {"weight", "bias"} and torch.equal(weights["weight"], model.weight)
    with pytest.raises(FileExistsError):
        export(tmp_path / "ckpt", out)
    with pytest.raises(ValueError, match="max_shard_size is for a directory"):
        export(tmp_path / "ckpt", tmp_path / "w.safetensors", max_shard_size="1GB")


def test_a_failed_export_leaves_no_directory_and_an_overwrite_replaces_it_whole(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ckpt = tmp_path / "ckpt"
    ddpckpt.save(ckpt, model=model)
    out = tmp_path / "hf"
    export(ckpt, out, max_shard_size=20_000)  # two files
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    manifest = json.loads((ckpt / "manifest.json").read_text())
    last = manifest["tensors"]["model/1.weight"]  # in the second file: the first is written
    flip_byte(str(ckpt / last["file"]), last["offsets"][0] + 5)
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=r"1\.weight"):
        export(ckpt, out, max_shard_size=20_000, overwrite=True)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    with pytest.raises(ddpckpt.CorruptCheckpointError):
        export(ckpt, tmp_path / "fresh", max_shard_size=20_000)
    assert not (tmp_path / "fresh").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]  # no temporary left behind


_MEASURE = """
import json, sys
import ddpckpt
from ddpckpt._cli.main import main


def resident(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def added(action):
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the peak (VmHWM) to the current resident size
    before = resident("VmRSS:")
    action()
    return resident("VmHWM:") - before


ckpt, out, limit = sys.argv[1:]
exported = added(lambda: main(["export", ckpt, out, "--max-shard-size", limit]))
whole = added(lambda: ddpckpt.load_state_dict(ckpt))
print(json.dumps([exported, whole]))
"""


@pytest.mark.processes
def test_export_holds_one_tensor_at_a_time(tmp_path) -> None:
    """A 96 MiB model exported in 3 files by a process of its own: the resident memory the
    export adds (mapped file pages included) stays near one tensor (16 MiB), where reading
    the state dict whole adds the model's 96 MiB. Freed memory goes back to the system at
    once (``MALLOC_MMAP_THRESHOLD_``), so that the peak counts what is held, not what the
    allocator kept."""
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(6)))
    ddpckpt.save(tmp_path / "ckpt", model=model)
    tensor = 2048 * 2048 * 4
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(2 * tensor)]
    run = subprocess.run([sys.executable, "-c", _MEASURE, *args], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    exported, whole = json.loads(run.stdout.splitlines()[-1])
    assert len(os.listdir(tmp_path / "hf")) == 4  # 3 files and the index
    assert whole > 5 * tensor, f"the whole model added only {whole / 2**20:.0f} MiB"
    assert exported < 2 * tensor, f"{exported / 2**20:.0f} MiB added"
    weights = load_file(tmp_path / "hf" / "model-00003-of-00003.safetensors")
    assert weights.keys() == {"4.weight", "5.weight"}


def test_sizes_and_the_split() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5 mb") == 1_500_000
    assert parse_size(1234) == parse_size("1234") == 1234
    for bad in ("5GiB", "-1", "0", "", "GB"):
        with pytest.raises(ValueError, match="is not a shard size"):
            parse_size(bad)
    # Hugging Face's rule: a file closes when the next tensor would overflow it; a tensor over
    # the limit goes alone, ahead of the file being filled.
    sizes = {"a": 6, "b": 6, "c": 2, "d": 12, "e": 2, "f": 2}
    assert shard_keys(sizes, 10) == [["a"], ["d"], ["b", "c", "e"], ["f"]]
    assert shard_keys({}, 10) == [[]]


def test_a_shard_size_out_of_range_is_an_error_naming_the_option_not_a_traceback(
    tmp_path, capsys
) -> None:
    ddpckpt.save(tmp_path / "ckpt", model=nn.Linear(4, 3))
    for size in ("9" * 400, str(2**62 + 1), "0.1", "1e3"):
        with pytest.raises(SystemExit) as exited:  # a usage error, as argparse reports one
            main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size",
                  size])  # fmt: skip
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--max-shard-size" in err and "2**62" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="max_shard_size"):
        export(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=2**64)
    assert parse_size(2**62) == 2**62 and parse_size("4611686018427387904") == 2**62


def test_a_sharded_record_of_an_empty_tensor_with_a_huge_dimension_is_corrupt(
    tmp_path, capsys
) -> None:
    """The manifest of a checkpoint records the bias as an empty sharded tensor whose second
    dimension is 2**63: ``export`` says the checkpoint is corrupt (exit 2), no traceback."""
    ckpt = tmp_path / "ckpt"
    ddpckpt.save(ckpt, model=nn.Linear(4, 3))
    manifest = manifest_doc(ckpt)
    entry = manifest["tensors"].pop("model/bias")
    manifest["shards"] = {"model/bias": {"dtype": entry["dtype"], "shape": [0, 2**63],
                          "mesh": [1], "placements": ["R"], "chunk": 64, "pieces": []}}  # fmt: skip
    manifest["format_version"] = max(manifest["format_version"], 5)
    write_manifest(ckpt, manifest)  # its checksum recomputed, as whoever crafted it would
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=r"2\*\*62"):
        export(ckpt, tmp_path / "w.safetensors")
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model/bias" in err and "Traceback" not in err and not (tmp_path / "hf").exists()
