"""What only S3 storage does, against a real S3 server on loopback (moto, ``s3_endpoint``):
multipart uploads, damaged objects, a server that goes away mid-save, retention, the CLI."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import ddpckpt
import s3server
from conftest import StoredPath, make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._cli.main import main
from ddpckpt.errors import CheckpointWriteError
from ddpckpt.storage import ManifestLastCommit, storage_for
from ddpckpt.storage._registry import configure, mount
from launch import forked_ranks, torchrun

pytestmark = pytest.mark.skipif(bool(s3server.missing()), reason=str(s3server.missing()))

MiB = 1 << 20


def small_parts(endpoint: str, **options):
    from ddpckpt.storage.s3 import S3Storage

    return S3Storage(endpoint_url=endpoint, part_size=5 * MiB, small_object=1 * MiB, **options)


@pytest.fixture
def mounted(s3_endpoint, s3_root):
    """``s3_root`` served by a storage with 5 MiB parts, so a few MiB go multipart."""
    storage = small_parts(s3_endpoint)
    mount(s3_root, storage)
    yield storage, s3_root
    mount(s3_root, None)


def test_s3_urls_resolve_to_one_storage_with_manifest_last_commit(s3_endpoint) -> None:
    from ddpckpt.storage.s3 import S3Storage

    storage = storage_for(f"s3://{s3server.BUCKET}/run/step-1")
    assert isinstance(storage, S3Storage)
    assert storage is storage_for(f"s3://{s3server.BUCKET}/other")
    assert isinstance(storage.commit, ManifestLastCommit)
    assert s3_endpoint in repr(storage) and "testing" not in repr(storage)  # no credentials
    with pytest.raises(ValueError, match="name a bucket"):
        storage.read("s3://")


def test_a_large_object_goes_up_in_parts_and_comes_back_by_parallel_ranges(mounted) -> None:
    storage, root = mounted
    data = os.urandom(12 * MiB + 12345)  # three parts, the last one short
    with storage.create(f"{root}/big") as writer:
        for start in range(0, len(data), 3 * MiB):
            writer.write(data[start : start + 3 * MiB])
        assert not storage.exists(f"{root}/big")  # invisible until complete
        writer.sync()
    assert storage.size(f"{root}/big") == len(data)
    reader = storage.open(f"{root}/big")
    try:
        buffer = bytearray(11 * MiB)
        assert reader.read_into(memoryview(buffer), 100) == len(buffer)
        assert bytes(buffer) == data[100 : 100 + len(buffer)]
        assert bytes(reader.map()) == data
    finally:
        reader.close()
    storage.copy(f"{root}/big", f"{root}/copy")  # server-side
    assert storage.read(f"{root}/copy") == data
    storage.write_new(f"{root}/empty", b"")  # no byte to range over
    reader = storage.open(f"{root}/empty")
    assert reader.size == 0 and reader.map() is None
    reader.close()


def test_an_upload_closed_without_sync_leaves_nothing(mounted) -> None:
    storage, root = mounted
    writer = storage.create(f"{root}/big")
    writer.write(os.urandom(11 * MiB))  # two parts in flight
    writer.close()
    assert not storage.exists(f"{root}/big")
    bucket, key = storage._split(f"{root}/big")
    uploads = storage._client.list_multipart_uploads(Bucket=bucket, Prefix=key)
    assert uploads.get("Uploads", []) == []  # aborted, no parts left to pay for


def test_a_large_object_replaced_after_open_is_an_error_not_mixed_bytes(mounted) -> None:
    storage, root = mounted
    storage.write_new(f"{root}/big", b"a" * (2 * MiB))
    reader = storage.open(f"{root}/big")  # its first MiB (small_object) comes at once
    storage.replace(f"{root}/big", b"b" * (2 * MiB))
    buffer = bytearray(10)
    reader.read_into(memoryview(buffer), 0)
    assert bytes(buffer) == b"a" * 10  # the bytes opened
    with pytest.raises(OSError, match="big"):
        reader.read_into(memoryview(bytearray(10)), MiB + 10)  # the server's are another's
    reader.close()


def test_listing_and_delete_tree_go_page_by_page_and_batch_by_batch(s3_root, monkeypatch) -> None:
    import ddpckpt.storage.s3 as s3

    monkeypatch.setattr(s3, "_LIST_PAGE", 4)  # the real sizes (1000) need 1000s of objects
    monkeypatch.setattr(s3, "_DELETE_BATCH", 3)
    storage = storage_for(s3_root)
    names = [f"{n:02d}" for n in range(11)] + [f"sub/{n}" for n in range(6)]
    for name in names:
        storage.replace(f"{s3_root}/many/{name}", b"x")
    assert storage.walk(f"{s3_root}/many") == sorted(names)
    assert storage.list(f"{s3_root}/many") == sorted([*names[:11], "sub"])
    storage.delete_tree(f"{s3_root}/many")
    assert storage.walk(s3_root) == []


def saved_run(run: StoredPath, steps=(1, 2)) -> torch.nn.Module:
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(run, model=model, optimizer=opt, keep_last=None) as ckpt:
        for step in steps:
            train_steps(model, opt, steps=1)
            ckpt.save(step)
    return model


def test_a_truncated_object_falls_back_to_the_older_checkpoint_naming_it(s3_root, caplog) -> None:
    run = s3_root / "run"
    saved_run(run)
    damaged = run / "step-00000002" / "model-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-100])  # an upload cut short
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert Checkpointer(run, model=make_mlp(3)).resume().step == 1
    assert "step-00000002/model-00000.safetensors: file is" in caplog.text


def test_a_bit_flipped_large_object_is_caught_while_streaming(mounted, caplog) -> None:
    _, root = mounted
    run = root / "run"
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: read by ranges, not at once
    with Checkpointer(run, model=model, keep_last=None) as ckpt:
        ckpt.save(1)
        ckpt.save(2)
    damaged = run / "step-00000002" / "model-00000.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    fresh = torch.nn.Linear(1024, 1024)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert Checkpointer(run, model=fresh).resume().step == 1
    assert "step-00000002/model-00000.safetensors" in caplog.text
    assert "checksum mismatch" in caplog.text
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.processes
def test_the_server_stopped_mid_save_is_a_bounded_error_and_training_goes_on(caplog) -> None:
    """A server of its own, killed when the first data object of step 2 is created: the
    save fails after bounded retries, nothing of step 2 is committed, training goes on."""
    from ddpckpt.storage.s3 import S3Storage

    process, endpoint = s3server.start()
    try:
        s3server.make_bucket(endpoint, "doomed")
        root = "s3://doomed/run"

        class DyingServer(S3Storage):
            kill_at: str | None = None

            def create(self, location: str):
                if self.kill_at and location.startswith(self.kill_at):
                    s3server.stop(process)
                return super().create(location)

        storage = DyingServer(
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            connect_timeout=2,
            read_timeout=5,
            max_attempts=2,
        )
        mount("s3://doomed", storage)
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = Checkpointer(root, model=model, optimizer=opt, retries=1, retry_backoff=0.01)
        ckpt.save(1)
        storage.kill_at = f"{root}/step-00000002/"
        with caplog.at_level(logging.WARNING, logger="ddpckpt"):
            train_steps(model, opt, steps=1)
            assert ckpt.save(2) is None  # on_error="warn" (the default)
            train_steps(model, opt, steps=1)  # training goes on
        assert isinstance(ckpt.last_error, ddpckpt.CheckpointWriteError)
        assert isinstance(ckpt.last_error.__cause__ or ckpt.last_error, OSError)
        assert "step-00000002" in str(ckpt.last_error)
        assert "training goes on" in caplog.text
        assert ckpt.failed_saves == 1
        ckpt.close()  # the server is gone: the lock stays, with one warning
        assert "could not remove the lock" in caplog.text
    finally:
        mount("s3://doomed", None)
        s3server.stop(process)


def test_a_server_gone_at_the_lock_check_is_a_failed_save_not_a_crash(
    s3_endpoint, s3_root, caplog, no_mounts
) -> None:
    """The lock read before a save's writes is a request too: a server that stops answering
    there fails that save (logged, training goes on), and the next save, with the server
    back, commits."""
    outage = s3server.Outage(s3_endpoint, trip=b"never sent")
    run = f"{s3_root}/run"
    options = {"endpoint_url": outage.endpoint, "connect_timeout": 2, "read_timeout": 2}
    options["max_attempts"] = 1
    model = make_mlp()
    ckpt = Checkpointer(run, model=model, storage_options=options, retries=0)
    try:
        assert ckpt.save(1) is not None
        outage.arm(f"/{run.split('/', 2)[2]}/.lock ".encode())  # the lock's read, not its write
        with caplog.at_level(logging.WARNING, logger="ddpckpt"):
            assert ckpt.save(2) is None
        assert outage.tripped.is_set()
        assert isinstance(ckpt.last_error, CheckpointWriteError)
        assert "training goes on" in caplog.text
        outage.arm(b"never sent")
        outage.up()
        assert ckpt.save(3) is not None
        assert ckpt.steps() == [1, 3]
    finally:
        ckpt.close()
        outage.close()


def test_retention_on_s3_deletes_manifest_first_and_keeps_the_newest(s3_root, monkeypatch) -> None:
    from ddpckpt.storage.s3 import S3Storage

    deletions: list[str] = []
    for method in ("delete", "delete_tree"):
        real = getattr(S3Storage, method)

        def record(self, location, _real=real, _method=method):
            deletions.append(f"{_method} {location}")
            return _real(self, location)

        monkeypatch.setattr(S3Storage, method, record)
    run = s3_root / "run"
    model = make_mlp()
    with Checkpointer(run, model=model, keep_last=2) as ckpt:
        for step in (1, 2, 3, 4):
            if step == 3:  # step 1 was saved; now retention removes it
                deletions.clear()
            ckpt.save(step)
    steps = [n for n in run.iterdir() if n.name.startswith("step-")]
    assert sorted(p.name for p in steps) == ["step-00000003", "step-00000004"]
    assert (run / "latest").read_text() == "step-00000004\n"
    first = [d for d in deletions if "step-00000001" in d]
    assert first[0] == f"delete {run}/step-00000001/manifest.json"  # uncommitted first
    assert storage_for(run).walk(f"{run}/step-00000001") == []  # nothing of it left behind
    assert ddpckpt.latest(run) == f"{run}/step-00000004"


def test_a_prefix_without_manifest_is_a_leftover_that_resume_skips(s3_root, capsys) -> None:
    run = s3_root / "run"
    saved_run(run, steps=(1,))
    storage = storage_for(run)
    storage.write_new(f"{run}/step-00000002/model-00000.safetensors", b"an upload cut off")
    assert ddpckpt.latest(run) == f"{run}/step-00000001"
    assert main(["ls", run]) == 1  # found a problem
    out = capsys.readouterr().out
    assert "verified" in out and "step-00000002: has no manifest.json" in out
    assert Checkpointer(run, model=make_mlp()).resume().step == 1
    assert main(["clean", run]) == 0
    assert storage.walk(f"{run}/step-00000002") == []
    assert ddpckpt.latest(run) == f"{run}/step-00000001"


def test_cli_ls_verify_inspect_on_an_s3_url(s3_root, capsys) -> None:
    run = s3_root / "run"
    saved_run(run)
    step = f"{run}/step-00000002"
    assert main(["ls", run]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(row[0], row[5], row[-1]) for row in rows] == [
        ("1", "verified", "-"),
        ("2", "verified", "latest"),
    ]
    assert main(["inspect", step]) == 0
    assert "model/0.weight" in capsys.readouterr().out
    assert main(["verify", step]) == 0
    damaged = run / "step-00000002" / "model-00000.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", step]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "model-00000.safetensors" in out


def test_storage_errors_are_os_errors_a_caller_can_classify(s3_endpoint) -> None:
    storage = storage_for(f"s3://{s3server.BUCKET}/x")
    with pytest.raises(FileNotFoundError):
        storage.read(f"s3://no-such-bucket-{os.getpid()}/x")
    unreachable = small_parts("http://127.0.0.1:9", connect_timeout=1, max_attempts=1)
    with pytest.raises(ConnectionError) as caught:
        unreachable.read(f"s3://{s3server.BUCKET}/x")
    assert caught.value.errno == errno.ECONNREFUSED and caught.value.filename.endswith("/x")


def test_two_ranks_under_torchrun_save_and_resume_on_s3(s3_root, tmp_path) -> None:
    """Both ranks reach the server through the inherited AWS_ENDPOINT_URL and credentials."""
    run = f"{s3_root}/run"
    args = ["--ckpt", run, "--steps", "12"]  # the last step is saved (every 4 steps)
    results = torchrun("checkpointer_run", tmp_path / "out", nproc=2, args=args).ok().results
    assert results[0]["saved"] == results[1]["saved"] and len(results[0]["saved"]) >= 2
    newest = results[0]["saved"][-1]
    for result in results.values():
        assert result["resumed"] == newest and result["resumed_digest"] == results[0]["digest"]
    kept = [n for n in storage_for(run).list(run) if n.startswith("step-")]
    assert f"step-{newest:08d}" in kept and len(kept) <= 3
    ddpckpt.verify(f"{run}/step-{newest:08d}")


@pytest.mark.processes
def test_without_the_extra_an_s3_url_says_what_to_install(tmp_path) -> None:
    code = "import sys; sys.modules['boto3'] = None\nimport ddpckpt\nddpckpt.latest('s3://b/run')"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "ImportError: s3:// locations need boto3: pip install 'ddpckpt[s3]'" in done.stderr


def test_a_server_without_conditional_writes_gets_plain_ones_after_a_warning(
    mounted, monkeypatch, caplog
) -> None:
    import botocore.exceptions

    storage, root = mounted
    real = storage._client.put_object

    def put_object(**kwargs):
        if "IfNoneMatch" in kwargs:
            error = {"Error": {"Code": "NotImplemented", "Message": "not implemented"}}
            raise botocore.exceptions.ClientError(error, "PutObject")
        return real(**kwargs)

    monkeypatch.setattr(storage._client, "put_object", put_object)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        storage.write_new(f"{root}/a", b"1")
        storage.write_new(f"{root}/b", b"2")
    assert caplog.text.count("does not support conditional writes") == 1
    assert storage.read(f"{root}/a") == b"1" and storage.read(f"{root}/b") == b"2"
    with pytest.raises(FileExistsError):
        storage.write_new(f"{root}/a", b"again")  # still checked before writing


_KILLED_TRAINER = """
import sys, time, torch, ddpckpt
from ddpckpt.storage import register
from ddpckpt.storage.s3 import S3Storage

root = sys.argv[1]

class Stalling(S3Storage):
    def create(self, location):
        if location.endswith("step-00000002/manifest.json"):
            print("UPLOADED", flush=True)  # step 2's data is up, its manifest is not
            time.sleep(600)
        return super().create(location)

stalling = Stalling(part_size=5 << 20)
register("s3", lambda url: stalling)  # this process's s3:// URLs: the one way to add a backend
torch.manual_seed(0)
model = torch.nn.Linear(1024, 2048)  # 8 MiB: a multipart upload
with ddpckpt.Checkpointer(root + "/run", model=model) as ckpt:
    ckpt.save(1)
    with torch.no_grad():
        model.weight.add_(1)
    ckpt.save(2)
"""


def test_a_trainer_killed_during_upload_resumes_from_the_previous_checkpoint(s3_root) -> None:
    """SIGKILL after step 2's data objects are uploaded and before its manifest: step 2 is
    no checkpoint, resume() loads step 1 and removes the leftovers."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_TRAINER, s3_root], stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout.readline().strip() == "UPLOADED"
    finally:
        trainer.kill()
        trainer.wait(60)
    run = f"{s3_root}/run"
    storage = storage_for(run)
    assert storage.walk(f"{run}/step-00000002")  # data objects, and no manifest
    assert ddpckpt.latest(run) == f"{run}/step-00000001"
    torch.manual_seed(0)
    expected = torch.nn.Linear(1024, 2048)
    fresh = torch.nn.Linear(1024, 2048)
    with Checkpointer(run, model=fresh) as ckpt:  # the dead trainer's lock is taken over
        assert ckpt.resume().step == 1
    assert torch.equal(fresh.weight, expected.weight)
    assert storage.walk(f"{run}/step-00000002") == []  # resume() removed the leftovers


@pytest.fixture
def no_mounts(monkeypatch):
    """Mounts and configured storages made by the test are forgotten after it."""
    from ddpckpt.storage import _registry

    monkeypatch.setattr(_registry, "_mounts", {})
    monkeypatch.setattr(_registry, "_configured", {})


SECRET = "SECRET-never-logged-7f3a"


def test_storage_options_reach_a_server_the_environment_does_not_name(
    s3_endpoint, s3_root, tmp_path, monkeypatch, no_mounts
) -> None:
    import ddpckpt.storage.s3

    monkeypatch.setattr(ddpckpt.storage.s3, "_default", None)  # made anew after the test
    with monkeypatch.context() as environment:
        for name in s3server.environment(s3_endpoint):
            environment.delenv(name)
        environment.setenv("AWS_CONFIG_FILE", os.fspath(tmp_path / "none"))
        environment.setenv("AWS_SHARED_CREDENTIALS_FILE", os.fspath(tmp_path / "none"))
        round_trips_with_options(s3_endpoint, s3_root)


def round_trips_with_options(s3_endpoint: str, s3_root: StoredPath) -> None:
    options = {  # as s3fs / DCP users write them
        "key": "testing",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 5, "retries": {"max_attempts": 2}},
    }
    model = make_mlp()
    path = f"{s3_root}/single/step-1"
    ddpckpt.save(path, model=model, step=1, storage_options=options)
    fresh = make_mlp(seed=1)
    assert ddpckpt.load(path, model=fresh, storage_options=options).step == 1
    assert torch.equal(fresh[0].weight, model[0].weight)
    storage = storage_for(path)
    assert storage._client.meta.endpoint_url == s3_endpoint and SECRET not in repr(storage)
    run = s3_root / "run"
    with Checkpointer(run, model=model, storage_options=options) as ckpt:
        ckpt.save(5)
    with Checkpointer(run, model=fresh, storage_options=options) as ckpt:
        assert ckpt.resume().step == 5


def test_credentials_in_storage_options_never_reach_messages_or_logs(
    s3_endpoint, caplog, no_mounts
) -> None:
    url = f"s3://{s3server.BUCKET}/nowhere/step-1"
    dead = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": SECRET, "max_attempts": 0}
    with caplog.at_level(logging.DEBUG, logger="ddpckpt"), pytest.raises(Exception) as caught:
        ddpckpt.load(url, model=make_mlp(), storage_options=dead)
    assert "127.0.0.1:9" in str(caught.value) or "127.0.0.1:9" in repr(caught.value.__cause__)
    with pytest.raises(ValueError, match="missing: aws_access_key_id") as partial:
        configure(url, {"secret": SECRET})
    with pytest.raises(ValueError, match="unknown S3 option 'bogus'") as unknown:
        configure(url, {"secret": SECRET, "bogus": SECRET})
    with pytest.raises(ValueError, match="'key' and 'aws_access_key_id' both set") as twice:
        configure(url, {"key": SECRET, "aws_access_key_id": "other"})
    with pytest.raises(ValueError, match="a local path takes none"):
        ddpckpt.save("/tmp/x", model=make_mlp(), storage_options={"secret": SECRET})
    texts = [caplog.text, str(caught.value), repr(caught.value.__cause__), str(unknown.value)]
    texts += [str(twice.value), str(partial.value), repr(storage_for(url))]
    assert not [t for t in texts if SECRET in t]


def test_the_endpoint_comes_from_aws_endpoint_url_with_or_without_options(
    s3_endpoint, s3_root, no_mounts
) -> None:
    from ddpckpt.storage.s3 import S3Storage

    assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint
    assert S3Storage()._client.meta.endpoint_url == s3_endpoint
    path = f"{s3_root}/step-1"
    options = {"read_timeout": 30}  # no endpoint: still the environment's
    ddpckpt.save(path, model=make_mlp(), storage_options=options)
    assert storage_for(path)._client.meta.endpoint_url == s3_endpoint
    assert ddpckpt.verify(path).step is None


def test_two_ranks_whose_server_stops_mid_upload_are_told_alike_and_train_on(
    s3_endpoint, s3_root, tmp_path
) -> None:
    """The server stops answering at the second object of step 2 (the first is uploaded):
    every rank's save fails within bounds, nothing of step 2 is committed, training goes on
    under on_error="warn", and resume() loads step 1."""
    outage = s3server.Outage(s3_endpoint, trip=b"/step-00000002/state-0000")
    run = f"{s3_root}/run"
    try:
        launch = forked_ranks(
            "s3_outage", tmp_path / "out", nproc=2, args=["--ckpt", run], timeout=240,
            env={"AWS_ENDPOINT_URL": outage.endpoint},
        ).ok()  # fmt: skip
    finally:
        outage.close()
    assert outage.tripped.is_set()
    for result in launch.results.values():
        assert result["saved"] == [f"{run}/step-00000001", None]
        assert result["error"] == "CheckpointWriteError" and result["failed_saves"] == 1
        assert "step-00000002" in result["message"]
        assert "rank 0" in result["message"] and "rank 1" in result["message"]  # and objects
        assert result["message"].count(".safetensors: S3 endpoint unreachable") == 2
        assert result["trained"] == 3
    storage = storage_for(run)  # the server itself, which kept what was uploaded
    assert storage.walk(f"{run}/step-00000002")  # data objects, and no manifest
    assert not storage.exists(f"{run}/step-00000002/manifest.json")
    assert ddpckpt.latest(run) == f"{run}/step-00000001"
    model = torch.nn.Sequential(  # the workers' model
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(run, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.resume().step == 1
    assert storage.walk(f"{run}/step-00000002") == []  # resume() removed the leftovers


def test_parts_grow_every_thousand_parts(mounted, monkeypatch) -> None:
    import ddpckpt.storage._s3io as s3io

    monkeypatch.setattr(s3io, "_PARTS_PER_SIZE", 2)  # 1000 parts would take 5 GB here
    storage, root = mounted
    data = os.urandom(27 * MiB)  # parts of 5, 5, 10 and 7 (the rest) MiB
    with storage.create(f"{root}/growing") as writer:
        writer.write(data)
        writer.sync()
    bucket, key = storage._split(f"{root}/growing")
    sizes = [
        storage._client.head_object(Bucket=bucket, Key=key, PartNumber=n)["ContentLength"]
        for n in (1, 2, 3, 4)
    ]
    assert sizes == [5 * MiB, 5 * MiB, 10 * MiB, 7 * MiB]
    assert storage.read(f"{root}/growing") == data


def test_an_async_save_makes_no_request_on_the_training_thread(s3_root, monkeypatch) -> None:
    """The design property behind "the async stall is the local disk's": every HTTP request
    of an ``async_save`` (lock, listing, uploads, manifest, ``latest``, retention) is sent
    from a background thread; the training thread only copies tensors. Recorded where
    botocore sends a request, so a request added anywhere on the training thread fails it."""
    import botocore.endpoint

    senders: list[tuple[int, str]] = []
    send = botocore.endpoint.Endpoint._send

    def recorded(endpoint, request):
        senders.append((threading.get_ident(), f"{request.method} {request.url}"))
        return send(endpoint, request)

    monkeypatch.setattr(botocore.endpoint.Endpoint, "_send", recorded)
    training = threading.get_ident()
    run = s3_root / "run"
    model = make_mlp()
    with Checkpointer(run, model=model, async_save=True, keep_last=1) as checkpointer:
        checkpointer.resume()  # nothing yet: the one synchronous call, outside training
        for step in (1, 2, 3):
            train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
            senders.clear()
            checkpointer.save(step=step)
            on_training_thread = [what for thread, what in senders if thread == training]
            assert on_training_thread == [], f"save(step={step}) made requests on the caller"
            checkpointer.wait()
            assert any(thread != training for thread, _ in senders)  # the seam sees them
        senders.clear()
        pending = ddpckpt.save(f"{s3_root}/single", model=model, async_save=True)
        assert [what for thread, what in senders if thread == training] == []
        pending.wait()
    assert ddpckpt.latest(run) == f"{run}/step-00000003"


def test_an_async_save_into_a_run_another_job_took_over_writes_nothing(s3_root) -> None:
    """The lock check moved off the training thread still comes before any write."""
    import json

    run = s3_root / "run"
    checkpointer = Checkpointer(run, model=make_mlp(), async_save=True)
    checkpointer.save(step=1)
    checkpointer.wait()
    taker = {"host": "another-node", "pid": 1, "job": "job-9", "since": 0}
    (run / ".lock").write_text(json.dumps(taker))
    checkpointer.save(step=2)  # returns at once; the background save refuses to write
    with pytest.raises(
        ddpckpt.errors.CheckpointLockedError, match="took this directory's lock over"
    ):
        checkpointer.save(step=3)
    assert not (run / "step-00000002").exists() and not (run / "step-00000003").exists()
    assert json.loads((run / ".lock").read_text())["host"] == "another-node"  # left alone
    with pytest.raises(ddpckpt.errors.CheckpointLockedError):  # the failed save, reported once more
        checkpointer.close()


def test_a_missing_bucket_and_missing_credentials_are_named_errors_saying_what_to_do(
    s3_endpoint, monkeypatch
) -> None:
    from ddpckpt.storage.s3 import S3Storage

    with pytest.raises(FileNotFoundError, match=r"NoSuchBucket.*create it"):
        storage_for(f"s3://{s3server.BUCKET}/x").read(f"s3://no-such-bucket-{os.getpid()}/x")
    # "nothing saved yet" would have a script start over, and an evaluator wait, forever
    with pytest.raises(FileNotFoundError, match=r"NoSuchBucket.*create it"):
        ddpckpt.latest(f"s3://no-such-bucket-{os.getpid()}/run")
    assert ddpckpt.latest(f"s3://{s3server.BUCKET}/no-run-here-{os.getpid()}") is None
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask
    anonymous = S3Storage(endpoint_url=s3_endpoint, max_attempts=0)
    with pytest.raises(PermissionError, match="AWS_ACCESS_KEY_ID") as caught:
        anonymous.read(f"s3://{s3server.BUCKET}/x")
    assert caught.value.filename == f"s3://{s3server.BUCKET}/x"


def test_a_checkpointer_in_a_missing_bucket_says_the_bucket_is_missing(s3_endpoint) -> None:
    """The run lock is the first write: its failure is the error the user sees, not the
    cleanup's (there is no half-written lock object to delete)."""
    run = f"s3://no-such-bucket-{os.getpid()}/runs/exp1"
    expected = pytest.raises(CheckpointWriteError, match=r"NoSuchBucket.*create it")
    with Checkpointer(run, model=make_mlp()) as ckpt, expected as caught:
        ckpt.resume()
    assert caught.value.errno == errno.ENOENT


@pytest.mark.parametrize(
    ("code", "status", "kind", "says"),
    [
        ("ExpiredToken", 400, PermissionError, "expired: renew them"),
        ("AccessDenied", 403, PermissionError, "may use this bucket"),
        ("InvalidAccessKeyId", 403, PermissionError, "check the credentials"),
        ("PermanentRedirect", 301, OSError, "region_name"),
        ("AuthorizationHeaderMalformed", 400, OSError, "AWS_REGION"),
    ],
)
def test_errors_a_real_s3_answers_name_their_cause_and_remedy(code, status, kind, says) -> None:
    """Answers moto does not give (it checks no credentials and has one region), as AWS
    sends them."""
    import botocore.exceptions

    from ddpckpt.storage._s3client import os_error

    answer = {
        "Error": {"Code": code, "Message": "as AWS says it"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    error = os_error(botocore.exceptions.ClientError(answer, "PutObject"), "s3://b/run/x")
    assert type(error) is kind and error.filename == "s3://b/run/x"
    assert code in str(error) and says in str(error)


def test_a_profile_that_is_not_there_is_one_line_saying_where_profiles_come_from(
    s3_root, tmp_path, monkeypatch, capsys, no_mounts
) -> None:
    """``AWS_PROFILE`` naming no profile (a typo): the CLI prints one error line, not
    botocore's traceback, and ``storage_options`` profile= is a ValueError saying so."""
    import ddpckpt.storage.s3

    saved_run(s3_root / "run")
    monkeypatch.setattr(ddpckpt.storage.s3, "_default", None)  # reads AWS_PROFILE anew
    monkeypatch.setenv("AWS_CONFIG_FILE", os.fspath(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "trainnig")
    assert main(["ls", os.fspath(s3_root / "run")]) == 2
    err = capsys.readouterr().err
    assert "ddpckpt ls: error:" in err and "trainnig" in err and "AWS_PROFILE" in err
    monkeypatch.delenv("AWS_PROFILE")
    with pytest.raises(ValueError, match=r"\(trainnig\).*profile="):
        ddpckpt.load(f"{s3_root}/run", model=make_mlp(), storage_options={"profile": "trainnig"})


def test_a_server_that_stops_answering_is_reported_at_its_first_timeout(
    s3_endpoint, caplog
) -> None:
    """A hung server (it accepts connections, never answers) holds a request for up to
    (retries + 1) x read_timeout: the first timeout says so at once, with the settings that
    shorten it, instead of silence until the last attempt."""
    import socket

    from ddpckpt.storage.s3 import S3Storage

    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens, never accepts
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        storage = S3Storage(endpoint_url=endpoint, read_timeout=1, max_attempts=1)
        with caplog.at_level(logging.WARNING, logger="ddpckpt"), pytest.raises(TimeoutError):
            storage.read(f"s3://{s3server.BUCKET}/x")
    warnings = [r.getMessage() for r in caplog.records if "got no answer" in r.getMessage()]
    assert len(warnings) == 1
    assert "retrying up to 1 times" in warnings[0] and "read_timeout=" in warnings[0]


def test_a_dot_segment_key_under_the_run_is_skipped_with_a_warning_not_re_split(
    s3_root, caplog
) -> None:
    """An object named ``step-00000006/./manifest.json`` (put there by another tool) is no
    name ddpckpt writes: listing skips it with a WARNING naming it, and never reads it as
    ``step-00000006/manifest.json``, so resume() still works."""
    run = s3_root / "run"
    model = saved_run(run, steps=(1, 2))
    storage = storage_for(run)
    bucket, key = storage._split(run)
    manifest = storage.read(f"{run}/step-00000002/manifest.json")
    storage._client.put_object(Bucket=bucket, Key=f"{key}/step-00000006/./manifest.json",
                               Body=manifest)  # fmt: skip
    storage._client.put_object(Bucket=bucket, Key=f"{key}/step-00000002/../x", Body=b"x")
    storage._client.put_object(Bucket=bucket, Key=f"{key}//step-00000007", Body=b"x")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        restored = make_mlp()
        for _ in range(2):  # the second resume() is not blocked by what the first did
            assert Checkpointer(run, model=restored).resume().step == 2
        listed = storage.walk(f"{run}/step-00000002")
        assert "manifest.json" in listed and not [n for n in listed if ".." in n]
        assert storage.list(f"{run}/step-00000006") == []  # all it holds was skipped
    for weight, saved in zip(restored.parameters(), model.parameters(), strict=True):
        assert torch.equal(weight, saved)
    assert f"'{key}/step-00000006/./'" in caplog.text  # the prefix holding it, as listed
    assert "step-00000006 aside" not in caplog.text  # nothing there can be moved: none said
    assert f"every object whose key starts with '{key}/step-00000002/../'" in caplog.text
    assert "skipped" in caplog.text
    listed = storage._client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/")["Contents"]
    assert f"{key}/step-00000006/./manifest.json" in {item["Key"] for item in listed}


@pytest.mark.processes
def test_ls_lists_no_checkpoint_for_a_prefix_of_skipped_keys_and_warns_once(
    s3_root, capsys, caplog
) -> None:
    """``step-00000006/./manifest.json`` alone (put there by another tool) is no checkpoint:
    ``ddpckpt ls`` lists none there and exits 0, after one WARNING (however many listings
    meet it) saying which keys are skipped. Once a key ddpckpt could have written lies
    there too, it is listed again, as an incomplete checkpoint."""
    run = s3_root / "run"
    saved_run(run, steps=(1, 2))
    storage = storage_for(run)
    bucket, key = storage._split(run)
    storage._client.put_object(Bucket=bucket, Key=f"{key}/step-00000006/./manifest.json",
                               Body=b"{}")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for _ in range(2):
            assert main(["ls", run]) == 0
            rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
            assert rows == ["1", "2"]
        warnings = [r.getMessage() for r in caplog.records]
        assert warnings == [
            f"{run}/step-00000006: skipped every object whose key starts with "
            f"'{key}/step-00000006/./' in bucket '{bucket}' (listed there as a prefix): that "
            "prefix has an empty, '.' or '..' segment, which ddpckpt never writes and which "
            "would read as another key; ddpckpt never reads them. Delete them with your "
            "storage's own tools if nobody needs them"
        ]
        storage.write_new(f"{run}/step-00000006/model-00000.safetensors", b"an upload cut off")
        assert main(["ls", run]) == 1
    out = capsys.readouterr().out
    assert "step-00000006: has no manifest.json" in out  # never hidden once ddpckpt's
    assert len(caplog.records) == 1


@pytest.mark.processes
def test_a_skipped_key_is_reported_once_whichever_listing_meets_it(s3_root, caplog) -> None:
    """The delimited listing of ``step-00000006`` shows the prefix ``step-00000006/./``; the
    walks of the run and of ``step-00000006`` show the key under it: one WARNING in all."""
    storage = storage_for(s3_root)
    bucket, key = storage._split(s3_root)
    storage._client.put_object(Bucket=bucket, Key=f"{key}/step-00000006/./manifest.json",
                               Body=b"{}")  # fmt: skip
    storage.replace(f"{s3_root}/step-00000002/manifest.json", b"{}")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert storage.list(f"{s3_root}/step-00000006") == []
        assert storage.walk(s3_root) == ["step-00000002/manifest.json"]
        assert storage.walk(f"{s3_root}/step-00000006") == []
        assert not storage.is_dir(f"{s3_root}/step-00000006")
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"every object whose key starts with '{key}/step-00000006/./'" in warning
