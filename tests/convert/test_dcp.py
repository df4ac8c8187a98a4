"""Importing torch.distributed.checkpoint (DCP) directories as torch's own dcp.save writes
them, without running their pickle (ddpckpt._convert.dcp)."""

from __future__ import annotations

import io
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import ddpckpt
from ddpckpt._cli.main import main as cli
from ddpckpt._convert import dcp_metadata as reader
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from launch import forked_ranks

WORKER = Path(__file__).parents[1] / "support" / "dcp_worker.py"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 13), nn.ReLU(), nn.Linear(13, 5), nn.LayerNorm(5))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(5)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _same(a: nn.Module | dict, b: nn.Module | dict) -> bool:
    a = a.state_dict() if isinstance(a, nn.Module) else a
    b = b.state_dict() if isinstance(b, nn.Module) else b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_moments(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa["param_groups"] == sb["param_groups"] and all(
        torch.equal(sa["state"][i][k], sb["state"][i][k])
        for i in sa["state"]
        for k in sa["state"][i]
    )


@pytest.fixture
def saved(tmp_path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """The DCP tutorial's save: get_state_dict's model and optimizer inside {"app": ...}."""
    model, opt = _trained()
    model_state, optim_state = get_state_dict(model, opt)
    _dcp_save({"app": {"model": model_state, "optim": optim_state}}, tmp_path / "dcp")
    return tmp_path / "dcp", model, opt


def test_a_dcp_save_resumes_with_its_weights_moments_and_next_step(saved, tmp_path, caplog) -> None:
    source, model, opt = saved
    path, dropped = import_checkpoint(source, tmp_path / "imported")
    assert dropped == []
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ddpckpt.load(path, model=fresh, optimizer=fresh_opt, rng=False)
    assert _same(fresh, model) and _same_moments(fresh_opt, opt)
    assert "keys it by position" not in caplog.text  # get_state_dict keys it by name
    _step(model, opt)
    _step(fresh, fresh_opt)
    assert _same(fresh, model) and _same_moments(fresh_opt, opt)


def test_the_command_imports_a_dcp_directory(saved, tmp_path, capsys) -> None:
    source, model, _ = saved
    assert cli(["import", str(source), str(tmp_path / "out")]) == 0
    assert f"imported {source} -> {tmp_path / 'out'}" in capsys.readouterr().out
    fresh = _model()
    ddpckpt.load(tmp_path / "out", model=fresh, rng=False)
    assert _same(fresh, model)


def test_a_model_beside_its_optimizer_at_the_top_level_is_refused_not_misread(tmp_path) -> None:
    """The model's keys at the top, beside an "optimizer" not flattened as torchtitan's is
    (tests/convert/test_torchtitan.py imports that one)."""
    model, opt = _trained()
    model_state, optim_state = get_state_dict(model, opt)
    _dcp_save({**model_state, "optimizer": optim_state}, tmp_path / "dcp")
    with pytest.raises(CorruptCheckpointError, match="whose keys are not torchtitan's"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_buffer_item_holding_a_pickle_that_would_run_code_is_refused(tmp_path) -> None:
    """DCP pickles an io.BytesIO as it is (torchtitan's train state): the buffer is read as
    bytes, and the torch.save file in it through the weights-only unpickler."""
    marker = tmp_path / "ran.txt"
    model, _ = _trained()
    buffer = io.BytesIO()
    torch.save({"losses": [1.0], "hook": _Runs(marker)}, buffer)
    _dcp_save({"model": model.state_dict(), "train_state": {"losses": buffer}}, tmp_path / "dcp")
    with pytest.raises(UnsafeCheckpointError, match=r"in its buffer.*builtins\.eval"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "out")
    assert not marker.exists()


def test_a_bare_model_state_dict_saved_with_dcp_imports(tmp_path) -> None:
    model, _ = _trained()
    _dcp_save(dict(model.state_dict()), tmp_path / "dcp")
    path, _ = import_checkpoint(tmp_path / "dcp", tmp_path / "out")
    fresh = _model()
    ddpckpt.load(path, model=fresh, rng=False)
    assert _same(fresh, model)


# ---------------------------------------------------------------- hostile directories


class _Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what a hostile .metadata holds: code to run
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


def _metadata(source: Path):
    with open(source / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file: trusted here


def _write_metadata(source: Path, metadata) -> None:
    (source / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_metadata_pickle_that_would_run_code_is_refused_before_it_runs(saved, tmp_path) -> None:
    source, *_ = saved
    marker = tmp_path / "ran"
    _write_metadata(source, _Runs(marker))
    with pytest.raises(
        UnsafeCheckpointError, match=r"unpickling would call builtins\.eval, which is none"
    ):
        import_checkpoint(source, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_an_item_placed_past_its_files_end_is_named(saved, tmp_path) -> None:
    source, *_ = saved
    metadata = _metadata(source)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = type(info)(info.relative_path, info.offset + 10**9, info.length)
    _write_metadata(source, metadata)
    with pytest.raises(CorruptCheckpointError, match="past the file's end"):
        import_checkpoint(source, tmp_path / "out")


def test_a_data_file_named_outside_the_directory_is_refused(saved, tmp_path) -> None:
    source, *_ = saved
    metadata = _metadata(source)
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)("../secret", info.offset, info.length)
    _write_metadata(source, metadata)
    with pytest.raises(CorruptCheckpointError, match="not a file of the directory"):
        import_checkpoint(source, tmp_path / "out")


def test_a_data_file_that_is_a_link_is_not_followed(saved, tmp_path) -> None:
    source, *_ = saved
    (data,) = source.glob("*.distcp")
    shutil.move(data, tmp_path / "elsewhere.distcp")
    data.symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(CorruptCheckpointError, match="not a DCP data file"):
        import_checkpoint(source, tmp_path / "out")


def test_a_tensor_claiming_more_bytes_than_its_chunks_hold_is_refused_unallocated(
    saved, tmp_path
) -> None:
    source, *_ = saved
    metadata = _metadata(source)
    key, meta = next(
        (k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")
    )
    meta.size = torch.Size([10**6, 10**6])
    meta.chunks[0].sizes = torch.Size([10**6, 10**6])
    meta.chunks[0].offsets = torch.Size([0, 0])
    index = next(i for i in metadata.storage_data if i.fqn == key)
    metadata.storage_data[type(index)(key, torch.Size([0, 0]))] = metadata.storage_data.pop(index)
    _write_metadata(source, metadata)
    with pytest.raises(CorruptCheckpointError, match="claims 4000000000000 bytes"):
        import_checkpoint(source, tmp_path / "out")


def test_a_metadata_sharing_its_parts_many_times_over_is_refused(saved, tmp_path) -> None:
    """A memo bomb: one list of 20,000 chunks shared by 2,000 tensors is 200 kB of pickle
    and 40 million chunks to walk."""
    source, *_ = saved
    metadata = _metadata(source)
    meta = next(
        v for v in metadata.state_dict_metadata.values()
        if hasattr(v, "chunks") and len(v.size) == 2
    )  # fmt: skip
    meta.chunks = meta.chunks * 20_000  # at one offset: they add up to the size below
    meta.size = torch.Size([meta.size[0] * 20_000, meta.size[1]])
    metadata.state_dict_metadata = {f"k{i}": meta for i in range(2_000)}
    index, info = next(iter(metadata.storage_data.items()))
    offset = meta.chunks[0].offsets
    metadata.storage_data = {type(index)(f"k{i}", offset): info for i in range(2_000)}
    _write_metadata(source, metadata)
    assert (source / ".metadata").stat().st_size < 300_000
    with pytest.raises(CorruptCheckpointError, match="walked, exceed"):
        reader.read_metadata(str(source))


def test_chunks_that_overlap_are_refused(saved, tmp_path) -> None:
    source, *_ = saved
    metadata = _metadata(source)
    key, meta = next(
        (k, v) for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "chunks") and len(v.size) == 2
    )  # fmt: skip
    rows, cols = meta.size
    whole = meta.chunks[0]
    # two chunks of the top half each: their elements add up, but they overlap
    half = type(whole)(offsets=torch.Size([0, 0]), sizes=torch.Size([rows // 2, cols]))
    meta.chunks = [
        half,
        type(whole)(offsets=torch.Size([0, 0]), sizes=torch.Size([rows - rows // 2, cols])),
    ]
    assert rows % 2 == 1  # 13 rows: the second chunk is a row longer, both at row 0
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data.pop(index)
    metadata.storage_data[type(index)(key, torch.Size([0, 0]))] = info
    _write_metadata(source, metadata)
    with pytest.raises(CorruptCheckpointError):
        import_checkpoint(source, tmp_path / "out")


# ---------------------------------------------------------------- dcp.save on two ranks


def _check_against_reference(root: Path, imported: str) -> None:
    """What ddpckpt loads from the import equals what torch's own
    get_state_dict(full_state_dict=True) gathered when the ranks saved."""
    reference = torch.load(root / "reference.pt", weights_only=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddpckpt.load(imported, model=model, optimizer=opt, rng=False)
    assert _same(model, reference["model"])
    loaded = opt.state_dict()
    params = [n for n in reference["model"] if n in dict(model.named_parameters())]
    for i, name in enumerate(params):
        for k, v in reference["optim"]["state"][name].items():
            assert torch.equal(loaded["state"][i][k], v), (name, k)


@pytest.mark.processes
def test_a_two_rank_ddp_dcp_save_imports_as_torch_gathers_it(tmp_path) -> None:
    forked_ranks("ddp", tmp_path / "out", args=["--ckpt", str(tmp_path)], worker=WORKER,
                 timeout=120).ok()  # fmt: skip
    path, dropped = import_checkpoint(tmp_path / "dcp", tmp_path / "imported")
    assert dropped == []
    _check_against_reference(tmp_path, path)


@pytest.mark.processes
def test_an_imported_fsdp2_save_resumes_under_fsdp2_as_dcp_load_does_at_two_and_three_ranks(
    tmp_path,
) -> None:
    """FSDP2's shards (uneven, one per rank) are put together into whole tensors equal to
    what torch gathers; and the import continues the source's run: at another world size than
    it was written at, the model and optimizer loaded by ddpckpt equal what dcp.load restores
    (resharding both), and two more steps keep them equal."""
    forked_ranks("fsdp2", tmp_path / "save", args=["--ckpt", str(tmp_path)], worker=WORKER,
                 timeout=120).ok()  # fmt: skip
    imported, dropped = import_checkpoint(tmp_path / "dcp", tmp_path / "imported")
    assert dropped == []
    _check_against_reference(tmp_path, imported)
    for nproc in (3,):  # another world size than the save's 2
        launch = forked_ranks("resume", tmp_path / f"resume-{nproc}", nproc=nproc, worker=WORKER,
                              args=["--ckpt", str(tmp_path), "--imported", imported],
                              timeout=120).ok()  # fmt: skip
        for rank in range(nproc):
            assert launch.result(rank) == {"loaded": True, "trained": True}, (nproc, rank)


# ---------------------------------------------------------------- found in review


def test_a_plain_optimizer_state_dict_saved_with_dcp_keeps_its_moments(tmp_path) -> None:
    """DCP stores the state's integer keys as text while the groups keep integers."""
    model, opt = _trained()
    _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "dcp")
    path, _ = import_checkpoint(tmp_path / "dcp", tmp_path / "out")
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ddpckpt.load(path, model=fresh, optimizer=fresh_opt, rng=False)
    assert _same(fresh, model) and _same_moments(fresh_opt, opt)


def test_optimizer_names_lose_the_models_wrapper_prefix_in_every_group(tmp_path) -> None:
    model, opt = _trained()
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    named = {f"module.{n}": p for n, p in model.named_parameters()}
    by_param = {id(p): n for n, p in named.items()}
    optim = opt.state_dict()
    first = [by_param[id(p)] for p in model.parameters()]
    state = {first[i]: v for i, v in optim["state"].items()}
    groups = [  # two groups: a prefix common to each group is not the model's
        {**optim["param_groups"][0], "params": first[:2]},
        {**optim["param_groups"][0], "params": first[2:]},
    ]
    _dcp_save(
        {"model": wrapped, "optim": {"state": state, "param_groups": groups}}, tmp_path / "dcp"
    )
    path, _ = import_checkpoint(tmp_path / "dcp", tmp_path / "out")
    fresh = _model()
    fresh_opt = torch.optim.AdamW(
        [{"params": list(fresh.parameters())[:2]}, {"params": list(fresh.parameters())[2:]}],
        lr=1e-2,
    )
    ddpckpt.load(path, model=fresh, optimizer=fresh_opt, rng=False)
    loaded = fresh_opt.state_dict()["state"]
    assert len(loaded) == len(first)
    assert all(torch.equal(loaded[i]["exp_avg"], optim["state"][i]["exp_avg"]) for i in loaded)


def _tuple_bomb() -> bytes:
    """A dict keyed by a tuple that nests itself 40 levels deep through the memo: 200 bytes,
    2**40 steps to hash."""
    ops = [b"\x80\x02}", b")q\x00"]
    for i in range(1, 40):
        ops.append(b"h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"\x86q" + bytes([i]))
    return b"".join([*ops, b"Ns."])


def _shared_list(depth: int) -> list:
    nested: list = []
    for _ in range(depth):
        nested = [nested, nested]
    return nested


def _hostile_path(metadata) -> None:
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = _shared_list(40)  # its repr would take 2**40 steps


def _shared_bytes(metadata) -> None:
    infos = list(metadata.storage_data.items())
    (_, first), (index, second) = infos[0], infos[1]
    metadata.storage_data[index] = type(second)(first.relative_path, first.offset, first.length)


def _huge_dimension(metadata) -> None:
    meta = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    meta.size = torch.Size([2**20000])


def _quantized(metadata) -> None:
    meta = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    meta.properties.dtype = torch.qint8


def _single_chunk_of_another_shape(metadata) -> None:
    meta = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks") and len(v.size) == 2)  # fmt: skip
    meta.size = torch.Size([meta.size[0] * meta.size[1], 1])


@pytest.mark.parametrize(
    "damage",
    [_hostile_path, _shared_bytes, _huge_dimension, _quantized, _single_chunk_of_another_shape],
)
def test_damaged_metadata_is_one_documented_error(saved, tmp_path, damage) -> None:
    source, *_ = saved
    metadata = _metadata(source)
    damage(metadata)
    _write_metadata(source, metadata)
    with pytest.raises((CorruptCheckpointError, UnsafeCheckpointError)):
        import_checkpoint(source, tmp_path / "out")


@pytest.mark.parametrize(
    "raw",
    [_tuple_bomb(), b"\x80\x02J\x01\x02", b"\x80\x02]q\x00(h\x00h\x00e."],
    ids=["tuple-bomb", "truncated", "set-free"],
)
def test_a_metadata_pickle_of_no_dcp_shape_is_one_documented_error(saved, tmp_path, raw) -> None:
    source, *_ = saved
    (source / ".metadata").write_bytes(raw)
    with pytest.raises(CorruptCheckpointError):
        import_checkpoint(source, tmp_path / "out")


def test_the_unpicklers_stand_ins_keep_no_state_between_reads(saved, tmp_path) -> None:
    """BUILD on the torch.Size stand-in cannot change how the next read builds sizes."""
    source, *_ = saved
    poisoned = b"\x80\x02ctorch\nSize\nq\x00N}q\x01X\x0c\x00\x00\x00__defaults__q\x02]q\x03K\x07a\x85q\x04s\x86b."
    (tmp_path / "poison").mkdir()
    (tmp_path / "poison" / ".metadata").write_bytes(poisoned)
    with pytest.raises(CorruptCheckpointError):
        reader.read_metadata(str(tmp_path / "poison"))
    path, _ = import_checkpoint(source, tmp_path / "out")  # sizes read as written
    assert ddpckpt.verify(path)
