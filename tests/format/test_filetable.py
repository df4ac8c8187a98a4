"""File tables (format 7): the manifest of a job of more than ``TABLE_RANKS`` ranks lists the
files its own records refer to and one table per ``TABLE_RANKS`` ranks; a rank that looks up
its own files reads the manifest and one table, whatever the number of ranks (counted at
4,096 and 16,384 simulated ranks, in one process); a table that is damaged, forged, missing
or lists the files of another group is refused, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_shards import _fixture_model

import ddpckpt
from ddpckpt._format import filetable
from ddpckpt._format.filetable import TABLE_RANKS, FileTable
from ddpckpt._format.manifest import MANIFEST_NAME, Manifest, read_manifest, relocated
from ddpckpt._format.rankparts import rank_file_name, rank_part
from ddpckpt._format.shardindex import ShardIndex
from ddpckpt._format.tensorfile import FileEntry, TensorEntry
from ddpckpt._io.reader import FileSource, find_problems
from ddpckpt.errors import CorruptCheckpointError, IncompleteCheckpointError
from ddpckpt.storage import storage_for
from ddpckpt.storage._location import Location, locate
from hostile import edit_manifest, manifest_doc, refresh_file

FIXTURE = Path(__file__).parent.parent / "data" / "format-v7-hsdp"
KINDS = ("model", "state", "rank", "shards")


def _name(kind: str, rank: int) -> str:
    return f"{kind}-{rank:05d}.json" if kind == "shards" else f"{kind}-{rank:05d}.safetensors"


def _job(root: Path, ranks: int) -> tuple[Path, int]:
    """The manifest and tables a save of ``ranks`` ranks writes: four files per rank, and
    whole tensors (the shared state) in rank 0's state file; its path and the manifest's
    size in bytes."""
    path = root / f"ckpt-{ranks}"
    path.mkdir()
    manifest = Manifest(id="0123456789ab", step=1, world_size=ranks)
    for rank in range(ranks):
        for kind in KINDS:
            name = _name(kind, rank)
            manifest.files[name] = FileEntry(name, 150_000_000 + rank, f"{rank:016x}", rank)
    manifest.tensors["step"] = TensorEntry(
        "state-00000.safetensors", "step", "I64", (), 0, 8, "0" * 16
    )
    whole = {entry.file for entry in manifest.tensors.values()}
    for name, blob in manifest.files.tabulate(whole, manifest.id, 0).items():
        (path / name).write_bytes(blob)
    text = manifest.to_json(str(path)).encode()
    (path / MANIFEST_NAME).write_bytes(text)
    return path, len(text)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The tables read, as each is read (the witness, not the code's own cache)."""
    found: list[str] = []
    real = filetable.read_listed

    def counting(location: Location, *args: Any, **kwargs: Any) -> bytes:
        found.append(location.name)
        return real(location, *args, **kwargs)

    monkeypatch.setattr(filetable, "read_listed", counting)
    return found


def test_a_rank_reads_one_table_and_the_manifest_grows_by_one_entry_per_table(
    tmp_path, reads
) -> None:
    sizes = {}
    for ranks in (4096, 16384):
        path, sizes[ranks] = _job(tmp_path, ranks)
        manifest = read_manifest(locate(str(path)))
        files = manifest.files
        assert manifest.format_version == 7
        assert len(files.tables) == ranks // TABLE_RANKS
        # what a whole checkpoint holds is known without reading a table
        assert len(files) == 4 * ranks + len(files.tables)
        assert reads == []
        last = ranks - 1
        rank_file = files.find(rank_file_name(last))
        assert rank_file == rank_file_name(last) and files[rank_file].writer == last
        index = ShardIndex(locate(str(path)), manifest.id, {}, {}, files, None)
        assert index.file_of(last) == _name("shards", last)
        assert files[_name("model", last)].size == 150_000_000 + last
        assert reads == [filetable.table_name(last // TABLE_RANKS)]  # one table, read once
        assert (path / reads[0]).stat().st_size < 128 * 4 * 110  # of TABLE_RANKS ranks' files
        assert files.get(_name("model", ranks + 5)) is None and len(reads) == 1
        reads.clear()
    # About 150 bytes per table: 0.9 bytes per rank (the list of every file: 390 bytes per rank)
    per_rank = (sizes[16384] - sizes[4096]) / (16384 - 4096)
    assert per_rank < 1.5, per_rank
    assert sizes[16384] < 32_000, sizes


def test_every_file_is_listed_once_and_iterating_reads_every_table(tmp_path, reads) -> None:
    path, _ = _job(tmp_path, 300)
    files = read_manifest(locate(str(path))).files
    names = list(files)
    assert len(names) == len(set(names)) == len(files) == 4 * 300 + 3
    assert set(names) >= {_name(kind, rank) for kind in KINDS for rank in range(300)}
    assert sorted(reads) == [f"files-0000{g}.json" for g in range(3)]
    assert files.nbytes == sum(f.size for f in files.values())


def test_a_job_of_table_ranks_or_fewer_lists_its_files_in_the_manifest(
    tmp_path, monkeypatch
) -> None:
    """As format 6 does, so that releases before format 7 still read it: here a job of
    one rank, with tables of one rank (a job of two writes them: test_fast_tier.py)."""
    monkeypatch.setattr(filetable, "TABLE_RANKS", 1)
    model = torch.nn.Linear(3, 2)
    ddpckpt.save(tmp_path / "ckpt", model=model, step=1)
    manifest = read_manifest(locate(str(tmp_path / "ckpt")))
    assert manifest.format_version < 7 and not manifest.files.tables
    assert "file_tables" not in manifest_doc(tmp_path / "ckpt")


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "run" / "ckpt"
    shutil.copytree(FIXTURE, path)
    return path


def _load(path: Path) -> None:
    model, opt = _fixture_model()
    ddpckpt.load(path, model=model, optimizer=opt, rng=False)


def _edit_table(path: Path, name: str, edit: Any) -> None:
    doc = json.loads((path / name).read_text())
    edit(doc)
    (path / name).write_text(json.dumps(doc))
    before, after = json.loads((FIXTURE / name).read_text())["files"], doc["files"]
    after = after if isinstance(after, dict) else before
    change = sum(f["size"] for f in after.values()) - sum(f["size"] for f in before.values())
    count = len(after) - len(before)

    def counts(manifest: dict[str, Any]) -> None:  # as a forger keeps the manifest consistent
        ref = manifest["file_tables"]["tables"][name]
        ref.update(files=ref["files"] + count, bytes=ref["bytes"] + change)

    edit_manifest(path, counts)
    refresh_file(path, name)


def _moved(doc: dict[str, Any], name: str, to: str) -> None:
    doc["files"][to] = doc["files"].pop(name)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(id="ffffffffffff"), "not the file table of ranks 0 to 1"),
        (lambda d: d.update(group=1), "not the file table of ranks 0 to 1"),
        (lambda d: _moved(d, "rank-00001.safetensors", "rank-00002.safetensors"),
         "'rank-00002.safetensors', no file of ranks 0 to 1"),
        (lambda d: _moved(d, "rank-00001.safetensors", ".next-x/rank-00001.safetensors"),
         "no file of ranks 0 to 1"),
        (lambda d: _moved(d, "rank-00001.safetensors", "../rank-00001.safetensors"),
         "no file of ranks 0 to 1"),
        (lambda d: d["files"].update({"state-00000.safetensors": d["files"]["rank-00000.safetensors"]}),
         "'state-00000.safetensors', which the manifest lists"),
        (lambda d: d["files"]["rank-00000.safetensors"].update(writer=4), "out of range"),
        (lambda d: d["files"]["rank-00000.safetensors"].update(xxh3_64="x" * 16), "digest"),
        (lambda d: d.update(files=[]), "not a JSON object"),
    ],
)  # fmt: skip
def test_a_forged_table_is_refused_naming_it(ckpt, edit, message) -> None:
    _edit_table(ckpt, "files-00000.json", edit)
    with pytest.raises(CorruptCheckpointError, match=r"files-00000\.json") as found:
        _load(ckpt)
    assert message in str(found.value)
    with pytest.raises(CorruptCheckpointError, match=message.replace(".", r"\.")[:20]):
        ddpckpt.verify(ckpt)


def test_a_table_that_lists_fewer_files_or_bytes_than_the_manifest_says_is_refused(ckpt) -> None:
    def drop(doc: dict[str, Any]) -> None:
        del doc["files"]["rank-00001.safetensors"]

    doc = json.loads((ckpt / "files-00000.json").read_text())
    drop(doc)
    (ckpt / "files-00000.json").write_text(json.dumps(doc))
    refresh_file(ckpt, "files-00000.json")  # the manifest's counts left as they were
    with pytest.raises(CorruptCheckpointError, match=r"lists 5 files of .* records 6 files"):
        _load(ckpt)


def test_a_damaged_or_missing_table_is_refused_naming_it(ckpt) -> None:
    data = bytearray((ckpt / "files-00001.json").read_bytes())
    data[10] ^= 0x01
    (ckpt / "files-00001.json").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"files-00001\.json: file checksum mismatch"):
        _load(ckpt)
    (ckpt / "files-00001.json").unlink()
    with pytest.raises(
        IncompleteCheckpointError, match=r"files-00001\.json, listed in the manifest, is missing"
    ):
        _load(ckpt)
    with pytest.raises(CorruptCheckpointError, match=r"1 problem.*\n.*files-00001\.json, listed"):
        ddpckpt.verify(ckpt)  # once, not once per file it lists


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["file_tables"]["tables"].update({"files-00002.json": {"files": 1, "bytes": 1}}),
         "'files-00002.json', no file table of the 4 ranks"),
        (lambda d: d["file_tables"].update(ranks=0), "out of range"),
        (lambda d: d["file_tables"]["tables"]["files-00000.json"].update(files=0), "out of range"),
        (lambda d: d["file_tables"].update(tables={"state-00000.safetensors": {"files": 1, "bytes": 1}}),
         "no file table of the 4 ranks"),
        (lambda d: d.update(file_tables=[]), "not a JSON object"),
    ],
)  # fmt: skip
def test_a_manifest_s_forged_tables_are_refused(ckpt, edit, message) -> None:
    edit_manifest(ckpt, edit)
    with pytest.raises(CorruptCheckpointError, match="malformed manifest") as e:
        read_manifest(locate(str(ckpt)))
    assert message in str(e.value)


def test_a_replacement_committed_under_a_prefix_resolves_its_tables_names_there(ckpt) -> None:
    """An object store's overwrite commits the files under ``.next-<token>/`` and a manifest
    relocated there: the tables keep their own names, which resolve under the prefix."""
    prefix = ".next-abc"
    (ckpt / prefix).mkdir()
    for file in list(ckpt.iterdir()):
        if file.is_file() and file.name != MANIFEST_NAME:
            file.rename(ckpt / prefix / file.name)
    text = relocated((ckpt / MANIFEST_NAME).read_bytes(), prefix, str(ckpt))
    (ckpt / MANIFEST_NAME).write_bytes(text)
    manifest = read_manifest(locate(str(ckpt)))
    assert sorted(manifest.files.tables) == [
        f"{prefix}/files-00000.json",
        f"{prefix}/files-00001.json",
    ]
    assert manifest.files.find("rank-00003.safetensors") == f"{prefix}/rank-00003.safetensors"
    ddpckpt.verify(ckpt)
    model, opt = _fixture_model()
    ddpckpt.load(ckpt, model=model, optimizer=opt, rng=False)
    expected = load_file(f"{FIXTURE}-expected.safetensors")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[f"model/{name}"])


def test_the_files_become_read_only_once_in_tables() -> None:
    files = FileTable()
    files["rank-00000.safetensors"] = FileEntry("rank-00000.safetensors", 1, "0" * 16, 0)
    files.ranks = 1
    files.tabulate(set(), "id", 0)
    with pytest.raises(TypeError, match="read only"):
        files["rank-00001.safetensors"] = FileEntry("rank-00001.safetensors", 1, "0" * 16, 1)


def test_reading_one_rank_s_state_or_one_whole_tensor_reads_only_its_writer_s_table(
    ckpt, reads
) -> None:
    """The fixture's files of ranks 0-1 and 2-3 are in two tables: rank 3's own file, and a
    tensor in rank 2's state file (whose writer's shard index the reader opens with it),
    need only the second."""
    manifest = read_manifest(locate(str(ckpt)))
    rank_part(manifest, locate(str(ckpt)), 3)
    assert reads == ["files-00001.json"]
    source = FileSource(locate(str(ckpt)), manifest)
    assert source.get("optimizer/state/2.bias/step").shape == ()
    assert reads == ["files-00001.json"]  # read once, and not the other group's


def test_an_overwrite_on_an_object_store_keeps_every_file_its_tables_list(tmp_path) -> None:
    """The replacement is committed under ``.next-<token>/`` by switching the manifest, then
    the old checkpoint's objects are deleted: those its file tables list are the new
    checkpoint's too (they were deleted, as not listed in the manifest itself)."""
    where = f"memory://tables-{tmp_path.name}/ckpt"
    store = storage_for(where)

    def put(prefix: str) -> None:
        for file in sorted(FIXTURE.iterdir(), key=lambda f: f.name == MANIFEST_NAME):
            store.replace(f"{prefix}/{file.name}", file.read_bytes())  # the manifest last

    put(where)
    staging = store.commit.staging(store, where, "tok123", overwrite=True)
    put(staging)
    store.commit.publish(store, staging, where, overwrite=True)
    assert all(name.startswith(".next-") for name in store.walk(where) if name != MANIFEST_NAME)
    ddpckpt.verify(where)
    model, opt = _fixture_model()
    ddpckpt.load(where, model=model, optimizer=opt, rng=False)


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory of two format-7 checkpoints, steps 1 and 2."""
    root = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(FIXTURE, root / f"step-{step:08d}")
        edit_manifest(root / f"step-{step:08d}", lambda d, step=step: d.update(step=step))
    return root


def test_a_damaged_table_makes_its_checkpoint_skipped_or_reported_never_the_listing_fail(
    run, caplog
) -> None:
    newest = run / "step-00000002"
    data = bytearray((newest / "files-00001.json").read_bytes())
    data[10] ^= 0x01
    (newest / "files-00001.json").write_bytes(bytes(data))
    model, opt = _fixture_model()
    info = ddpckpt.load_latest(run, model=model, optimizer=opt, rng=False)
    assert info.step == 1  # the damaged step 2 skipped, as any damaged checkpoint
    assert "instead of" in caplog.text and "files-00001.json" in caplog.text
    problems = find_problems(locate(newest))
    assert any("files-00001.json" in p for p in problems), problems
    (newest / "files-00001.json").unlink()
    problems = find_problems(locate(newest))
    assert any("files-00001.json" in p and "missing" in p for p in problems), problems
    assert ddpckpt.latest(run) == str(run / "step-00000001")


def test_two_tables_of_one_group_or_a_table_not_named_by_its_group_are_refused(ckpt) -> None:
    def twice(doc: dict[str, Any]) -> None:
        doc["files"]["files-000000.json"] = doc["files"]["files-00000.json"]
        doc["file_tables"]["tables"]["files-000000.json"] = {"files": 6, "bytes": 1}

    shutil.copy(ckpt / "files-00000.json", ckpt / "files-000000.json")
    edit_manifest(ckpt, twice)
    with pytest.raises(CorruptCheckpointError, match="no file table of the 4 ranks"):
        read_manifest(locate(str(ckpt)))


def test_load_latest_lists_without_reading_tables_and_falls_back_past_a_missing_file(
    run, reads, caplog
) -> None:
    """Every rank lists the run directory: it reads manifests, not the file tables (which
    grow with N); a file a table lists that is missing is found when it is loaded, and the
    load falls back to the checkpoint before, as for any damaged one."""
    from ddpckpt._run.catalog import newest_first

    assert [c[-1] for c in newest_first(locate(str(run)), every_file=False)] == [
        "step-00000002",
        "step-00000001",
    ]
    assert reads == []
    (run / "step-00000002" / "model-00003.safetensors").unlink()  # its shards are loaded
    model, opt = _fixture_model()
    info = ddpckpt.load_latest(run, model=model, optimizer=opt, rng=False)
    assert info.step == 1
    assert "model-00003.safetensors" in caplog.text and "instead of" in caplog.text
