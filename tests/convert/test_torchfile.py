"""Reading torch.save files you did not write: refused when they would run code, exhaust
memory or time, or import bytes that are not their weights; each seen on the old importer."""

from __future__ import annotations

import builtins
import dataclasses
import os
import subprocess
import warnings
import zipfile

import pytest
import torch

import ddpckpt
from conftest import make_mlp
from ddpckpt._cli.main import main
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt._convert.pickle_trust import why_not_plain
from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError


@dataclasses.dataclass
class Hyper:
    """A plain data class a user trusts."""

    lr: float
    layers: list


def test_a_stride_zero_view_is_refused_not_written_out_whole(tmp_path) -> None:
    """A 1.6 KB pickle of one float viewed 2**28 times became a 1 GiB checkpoint."""
    torch.save({"w": torch.zeros(1).as_strided((2**28,), (0,))}, tmp_path / "s.pt")
    with pytest.raises(CorruptCheckpointError, match="stride-0 or overlapping view"):
        import_checkpoint(tmp_path / "s.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_pickle_sharing_itself_exponentially_is_refused_quickly(tmp_path) -> None:
    """A 1.9 KB memo DAG (a list holding one list twice, 40 deep) hung `import`."""
    nested: list = []
    for _ in range(40):
        nested = [nested, nested]
    torch.save({"model": {"w": torch.zeros(2)}, "dag": nested}, tmp_path / "dag.pt")
    assert os.path.getsize(tmp_path / "dag.pt") < 4096
    with pytest.raises(CorruptCheckpointError, match="walked as a tree, exceed"):
        import_checkpoint(tmp_path / "dag.pt", tmp_path / "out")


def _shorten_record(source, target, record_suffix: str, keep: int) -> None:
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, data[:keep] if info.filename.endswith(record_suffix) else data)


def test_a_storage_record_shorter_than_its_tensor_is_refused(tmp_path) -> None:
    """Memory-mapped, the short record's tensor read the zip's next bytes as weights and
    `import` exited 0 (plain torch.load refuses the file)."""
    weights = {"a": torch.arange(1000.0), "b": torch.arange(1000.0)}
    torch.save(weights, tmp_path / "two.pt")
    _shorten_record(tmp_path / "two.pt", tmp_path / "short.pt", "/data/0", 16)
    with pytest.raises(CorruptCheckpointError, match="storage '0' has 16 bytes stored"):
        import_checkpoint(tmp_path / "short.pt", tmp_path / "out")


def test_a_truncated_file_is_named(tmp_path) -> None:
    """A truncated file said "[Errno 22] Invalid argument", naming no file."""
    torch.save(make_mlp().state_dict(), tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    for cut in (len(data) // 2, len(data) - 30, 100):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match=r"cut\.pt: "):
            import_checkpoint(tmp_path / "cut.pt", tmp_path / "out")


@pytest.mark.timeout(60)
def test_a_fifo_or_device_is_refused_without_blocking(tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(CorruptCheckpointError, match=r"a FIFO, not a torch\.save file"):
        import_checkpoint(tmp_path / "fifo.pt", tmp_path / "out")
    with pytest.raises(CorruptCheckpointError, match="a character device"):
        import_checkpoint("/dev/zero", tmp_path / "out")


class _Popen:
    def __init__(self, marker) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return (subprocess.Popen, (["touch", self.marker],))


class _Eval:
    def __init__(self, marker) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return (builtins.eval, (f"open({self.marker!r}, 'w')",))


@pytest.mark.parametrize(
    ("payload", "name"), [(_Popen, "subprocess.Popen"), (_Eval, "builtins.eval")]
)
def test_trust_global_never_lets_a_payload_run_nor_suggests_it(
    tmp_path, capsys, payload, name
) -> None:
    """The refusal suggested --trust-global; with it, Popen and eval ran the payload."""
    marker = tmp_path / "PWNED"
    torch.save({"model": make_mlp().state_dict(), "x": payload(marker)}, tmp_path / "evil.pt")
    assert main(["import", str(tmp_path / "evil.pt"), str(tmp_path / "out")]) == 2
    refusal = capsys.readouterr().err
    assert f"unpickling would call {name}" in refusal and "cannot be imported safely" in refusal
    assert "--trust-global" not in refusal
    command = ["import", str(tmp_path / "evil.pt"), str(tmp_path / "out"), "--trust-global", name]
    assert main(command) == 2
    assert f"refusing to trust {name}" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_only_plain_data_classes_can_be_trusted(tmp_path) -> None:
    torch.save({"state_dict": make_mlp().state_dict(), "h": Hyper(0.1, [2])}, tmp_path / "h.pt")
    with pytest.raises(UnsafeCheckpointError, match=f"--trust-global {__name__}.Hyper"):
        import_checkpoint(tmp_path / "h.pt", tmp_path / "out")  # suggested: it could be
    path, dropped = import_checkpoint(
        tmp_path / "h.pt", tmp_path / "out", trusted_globals=[f"{__name__}.Hyper"]
    )
    assert dropped and dropped[0].startswith("h ")  # read, and left out: not storable
    assert ddpckpt.verify(path).step is None
    for name, obj in [("os.system", os.system), ("logging.FileHandler", None),
                      ("pkg.Thing", subprocess.Popen), ("pkg.f", len), ("x.y", print)]:  # fmt: skip
        assert why_not_plain(name, obj) is not None, name
    assert why_not_plain("argparse.Namespace", object) is None


def test_an_optimizer_entry_of_another_shape_is_refused(tmp_path) -> None:
    """Found by the fuzzer: parameter ids that are lists raised "unhashable type"."""
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": [[0]]}]}
    torch.save({"model": make_mlp().state_dict(), "optimizer": optimizer}, tmp_path / "o.pt")
    with pytest.raises(CorruptCheckpointError, match="not an optimizer state_dict"):
        import_checkpoint(tmp_path / "o.pt", tmp_path / "out")


def test_the_old_zip_less_format_still_imports(tmp_path) -> None:
    model = make_mlp()
    torch.save(model.state_dict(), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    path, _ = import_checkpoint(tmp_path / "old.pt", tmp_path / "out")
    loaded = ddpckpt.load_state_dict(path)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def _rezipped(target, records) -> None:
    with warnings.catch_warnings():  # zipfile warns of the duplicate name it is asked to write
        warnings.simplefilter("ignore", UserWarning)
        with zipfile.ZipFile(target, "w") as archive:
            for name, data in records:
                archive.writestr(name, data)


@pytest.mark.parametrize("where", ["twice", "elsewhere"])
def test_a_second_pickle_the_scan_and_torch_could_read_apart_is_refused(tmp_path, where):
    """torch reads <first record's directory>/data.pkl; a pickle of the same name twice, or
    another data.pkl placed first, would have the scan check one pickle and torch run another."""
    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "other.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as archive:
        records = [(i.filename, archive.read(i.filename)) for i in archive.infolist()]
    with zipfile.ZipFile(tmp_path / "other.pt") as archive:
        other = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    prefix = records[0][0].split("/")[0]
    if where == "twice":
        records.append((f"{prefix}/data.pkl", other))
    else:
        records.insert(0, (f"{prefix}/x/data.pkl", other))
    _rezipped(tmp_path / "mixed.pt", records)
    refused = r"mixed\.pt: (two records|holds a pickle where)"
    with pytest.raises(CorruptCheckpointError, match=refused):
        import_checkpoint(tmp_path / "mixed.pt", tmp_path / "out")
