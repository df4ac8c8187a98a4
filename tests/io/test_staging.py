"""Staging host copies: per-device CUDA ordering (with a stand-in for torch.cuda), fences
waited on from several threads, buffers allocated ahead of the first save."""

from __future__ import annotations

import contextlib
import threading
from unittest import mock

import pytest
import torch

import ddpckpt
import ddpckpt._io.copy_checks as copy_checks
import ddpckpt._io.staging as staging
from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._io.staging import Fence, StagingPool, by_device, staged_nbytes


class FakeCuda:
    """Records which device and stream each CUDA call of the staging code runs under."""

    def __init__(self) -> None:
        self.device_now = 0
        self.current: dict[int, FakeStream] = {}
        self.log: list[tuple] = []
        self.landing = threading.Event()  # cleared: the copies have not landed yet
        self.landing.set()

    @contextlib.contextmanager
    def device(self, device: torch.device):
        previous, self.device_now = self.device_now, device.index
        try:
            yield
        finally:
            self.device_now = previous

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        index = self.device_now if device is None else device.index
        return self.current.setdefault(index, FakeStream(self, index, "default"))

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self, device.index, f"side{len(self.log)}")

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous = self.current_stream(torch.device("cuda", stream.device))
        self.current[stream.device] = stream
        try:
            yield
        finally:
            self.current[stream.device] = previous

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def synchronize(self, device: torch.device) -> None:
        self.log.append(("synchronize", device.index))


def fake_digests(monkeypatch) -> list[object]:
    """Digests of fake tensors: what ``bytes_now`` says they hold. Returns the tensors
    digested, in order."""
    summed: list[object] = []
    # staging's copies call copy_checks.digest by the name staging imported it under
    monkeypatch.setattr(staging, "digest", lambda t: summed.append(t) or t.bytes_now)
    monkeypatch.setattr(copy_checks, "_fetch", list)
    return summed


class FakeStream:
    def __init__(self, cuda: FakeCuda, device: int, name: str) -> None:
        self.cuda, self.device, self.name = cuda, device, name
        self.waits_for: list[object] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waits_for.append(other)

    def wait_event(self, event: FakeEvent) -> None:
        self.waits_for.append(event)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.stream, self.synchronized = cuda, None, 0

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.cuda.log.append(("record", stream.device, stream.name))

    def synchronize(self) -> None:
        assert self.cuda.landing.wait(30), "the copies were never let land"
        self.synchronized += 1

    def query(self) -> bool:
        return self.synchronized > 0


class FakeGpuTensor:
    def __init__(self, cuda: FakeCuda, index: int, name: str) -> None:
        self.cuda, self.device, self.name, self.is_cuda = (
            cuda,
            torch.device("cuda", index),
            name,
            True,
        )
        self.kept_for: list[FakeStream] = []
        self._version = 0
        self.bytes_now = 0  # what a digest of it reads: changed by a write through .data

    def is_contiguous(self) -> bool:
        return True

    def record_stream(self, stream: FakeStream) -> None:
        self.kept_for.append(stream)


class FakeHost:
    bytes_now = 0

    def copy_(self, source: FakeGpuTensor, non_blocking: bool = False) -> None:
        self.bytes_now = source.bytes_now
        cuda = source.cuda
        # torch runs a device-to-host copy on the source device's current stream
        stream = cuda.current_stream(source.device)
        cuda.log.append(
            ("copy", source.name, cuda.device_now, stream.device, stream.name, non_blocking)
        )


def test_copies_are_grouped_by_source_device_and_ordered_on_that_device(monkeypatch) -> None:
    cuda = FakeCuda()
    monkeypatch.setattr(staging, "_cuda", cuda)
    # current device stays 0 (no torch.cuda.set_device), the tensors live on devices 1 and 0
    sources = [
        FakeGpuTensor(cuda, 1, "a"),
        FakeGpuTensor(cuda, 0, "b"),
        FakeGpuTensor(cuda, 1, "c"),
    ]
    pairs = [(FakeHost(), s) for s in sources]

    assert list(by_device(pairs)) == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert [s.name for _, s in by_device(pairs)[torch.device("cuda", 1)]] == ["a", "c"]

    events = staging._start_copies(pairs)

    assert [device.index for device, _ in events] == [1, 0]
    copies = [entry for entry in cuda.log if entry[0] == "copy"]
    for _, name, guard, stream_device, stream_name, non_blocking in copies:
        index = 0 if name == "b" else 1
        assert (guard, stream_device) == (index, index), name  # under its own device
        assert stream_name.startswith("side") and non_blocking, name
    for device, event in events:
        stream = event.stream
        assert stream.device == device.index  # the event is recorded on that device
        assert stream.waits_for == [cuda.current[device.index]]  # after training's work there
        assert all(stream in s.kept_for for s in sources if s.device == device)
    assert cuda.device_now == 0

    fence = Fence(events=[event for _, event in events])
    assert not fence.done()
    fence.wait()
    assert all(event.synchronized == 1 for _, event in events) and fence.done()


def test_deferred_copies_wait_on_every_device(monkeypatch) -> None:
    cuda = FakeCuda()
    monkeypatch.setattr(staging, "_cuda", cuda)
    fake_digests(monkeypatch)
    deferred = [
        copy_checks.Deferred(f"t{i}", FakeHost(), FakeGpuTensor(cuda, i, f"t{i}"), 0)
        for i in (2, 0, 3)
    ]
    earlier = FakeEvent(cuda)
    fence = staging._copy_later(deferred, [earlier])
    fence.wait()
    recorded = {entry[1] for entry in cuda.log if entry[0] == "record"}
    assert recorded == {0, 2, 3}
    assert earlier.synchronized == 1 and len(fence._events) == 0


def test_a_cuda_tensor_written_before_its_copy_landed_is_copied_again(monkeypatch) -> None:
    # The version counter moves at the write's launch, on the training thread: a counter
    # unchanged once the copy's event is done means no write could reach the copy.
    cuda = FakeCuda()
    monkeypatch.setattr(staging, "_cuda", cuda)
    fake_digests(monkeypatch)
    sources = [FakeGpuTensor(cuda, 0, name) for name in ("kept", "written")]
    deferred = [copy_checks.Deferred(s.name, FakeHost(), s, 0) for s in sources]
    reported: list[list[str]] = []
    cuda.landing.clear()
    fence = staging._copy_later(deferred, [], reported.append)
    sources[1]._version = 1  # e.g. torch.no_grad(): weight.mul_(...) after save()
    assert not fence.done()
    cuda.landing.set()
    fence.wait()
    fence.wait()  # checked once
    assert reported == [["written"]]
    copies = [entry[1] for entry in cuda.log if entry[0] in ("copy", "synchronize")]
    assert copies == ["kept", "written", 0, "written"]  # again, after every stream's writes
    assert fence.done()


class WrittenAfterItsCopyRead(FakeHost):
    """A copy whose source a `.data` write changes right after the copy read it (the write's
    kernel on the current stream is not ordered after the side stream's copy)."""

    def copy_(self, source: FakeGpuTensor, non_blocking: bool = False) -> None:
        super().copy_(source, non_blocking)
        if non_blocking:
            source.bytes_now += 1


class WrittenBeforeItsCopyStarted(FakeHost):
    """A copy that starts only once a `.data` write queued after save() has landed: it
    holds the later value whole (the copy engine was busy with the tensors before it)."""

    def copy_(self, source: FakeGpuTensor, non_blocking: bool = False) -> None:
        if non_blocking:
            source.bytes_now += 1
        super().copy_(source, non_blocking)


def deferred_copy_of(monkeypatch, written: type[FakeHost]) -> tuple[list[list[str]], list]:
    """Two deferred CUDA copies, the second's host of type ``written``, copied and checked:
    what was reported written, and the hosts."""
    cuda = FakeCuda()
    monkeypatch.setattr(staging, "_cuda", cuda)
    summed = fake_digests(monkeypatch)
    sources = [FakeGpuTensor(cuda, 0, name) for name in ("kept", "written")]
    hosts = [FakeHost(), written()]
    deferred = [copy_checks.Deferred(s.name, h, s, 0) for s, h in zip(sources, hosts, strict=True)]
    reported: list[list[str]] = []
    staging._copy_later(deferred, [], reported.append).wait()
    # The check and the copy taken again read the GPU's bytes on the GPU: a host-side sum
    # of a 4 GB state took seconds that the next optimizer.step() waited for.
    assert summed and all(isinstance(t, FakeGpuTensor) for t in summed), summed
    return reported, hosts


@pytest.mark.parametrize("written", [WrittenBeforeItsCopyStarted, WrittenAfterItsCopyRead])
def test_a_cuda_tensor_written_through_data_after_save_is_caught(monkeypatch, written) -> None:
    # `.data` writes leave the version counter alone. The source's bytes are summed on its
    # GPU at save(), on the current stream before the write, and right after its copy: the
    # sums differ whether the write landed before the copy started (the copy holds the later
    # value whole; a sum after the copy alone agreed with it) or while it read the tensor.
    reported, hosts = deferred_copy_of(monkeypatch, written)
    assert reported == [["written"]]
    assert hosts[1].bytes_now == 1  # copied again: one value, the later one, and said so
    assert hosts[0].bytes_now == 0


def test_a_digest_sums_the_bytes_of_any_dtype() -> None:
    for tensor in (torch.arange(6, dtype=torch.float16), torch.ones(3, dtype=torch.bool)):
        assert int(copy_checks.digest(tensor)) == int(copy_checks.digest(tensor.clone()))
    x = torch.arange(8, dtype=torch.float32)
    y = x.clone()
    y[5] = -1
    assert int(copy_checks.digest(x)) != int(copy_checks.digest(y))
    # a view at a 2-byte offset is summed as bytes, and sees a write to any of them
    flat = torch.arange(9, dtype=torch.bfloat16)
    view = flat[1:]
    before = int(copy_checks.digest(view))
    flat[8] = 100
    assert int(copy_checks.digest(view)) != before


def test_a_digest_of_bytes_one_by_one_is_summed_in_chunks(monkeypatch) -> None:
    monkeypatch.setattr(copy_checks, "_DIGEST_CHUNK", 7)
    raw = torch.arange(51, dtype=torch.uint8) * 5  # 51 bytes: neither 32- nor 64-bit words
    assert int(copy_checks.digest(raw)) == int(raw.to(torch.int64).sum())
    assert int(copy_checks.digest(raw[:0])) == 0


@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_cpu_tensor_written_during_its_deferred_copy_is_copied_again(how) -> None:
    # The write lands once the copy thread has copied, before it checked; `.data` bypasses
    # the version counter, so the copy is also compared with the tensor.
    source = torch.arange(8, dtype=torch.float32)
    host = torch.empty_like(source)
    copied, gate, reported = threading.Event(), threading.Event(), []
    original = staging._copy

    def held_copy(pairs) -> None:
        original(pairs)
        copied.set()
        gate.wait(30)

    with mock.patch.object(staging, "_copy", held_copy):
        deferred = [copy_checks.Deferred("w", host, source.detach(), source._version)]
        fence = staging._copy_later(deferred, [], reported.append)
        assert copied.wait(30)
        if how == "data":
            source.data.copy_(torch.full((8,), 7.0))
        else:
            with torch.no_grad():
                source.fill_(7.0)
        gate.set()
        fence.wait()
    assert reported == [["w"]]
    assert torch.equal(host, source)  # one value of the tensor, never a mix


def test_a_deferred_copy_nothing_wrote_is_not_reported() -> None:
    source = torch.arange(8, dtype=torch.float32)
    source[3] = float("nan")  # NaN compares as its bytes
    reported: list[list[str]] = []
    pool = StagingPool()
    staged, fence = pool.stage([("w", source)], lambda name: True, reported.append)
    fence.wait()
    assert reported == []
    assert torch.equal(staged[0][1].view(torch.int32), source.view(torch.int32))


class InterleavedFence(Fence):
    """A fence whose copy thread is read through a property that forces the interleaving
    of two waiters a race needs: the second waiter sees the copy thread still set, then
    pauses until the first waiter has finished waiting, then goes on."""

    def __init__(self, thread: threading.Thread) -> None:
        self.first: threading.Thread | None = None
        self.second_looked, self.first_done = threading.Event(), threading.Event()
        super().__init__(thread=thread)

    @property
    def _thread(self) -> threading.Thread | None:
        value = self.__dict__["thread"]
        me = threading.current_thread()
        if value is not None and self.first is None:
            self.first = me
        elif value is not None and me is not self.first:
            self.second_looked.set()
            self.first_done.wait(5)
        return value

    @_thread.setter
    def _thread(self, value: threading.Thread | None) -> None:
        self.__dict__["thread"] = value


class SlowJoin(threading.Thread):
    def __init__(self, fence_box: list) -> None:
        super().__init__(target=lambda: None)
        self.fence_box = fence_box

    def join(self, timeout: float | None = None) -> None:
        self.fence_box[0].second_looked.wait(0.5)  # let the other waiter look meanwhile
        super().join(timeout)


def test_one_fence_waited_on_by_two_threads_at_once() -> None:
    # The optimizer's step hook (training thread) and the background writer wait on the
    # same fence in overlap mode; neither may fail, and both return after the copy.
    box: list = []
    copier = SlowJoin(box)
    fence = InterleavedFence(copier)
    box.append(fence)
    copier.start()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            fence.wait()
            assert not copier.is_alive()
        except BaseException as exc:
            errors.append(exc)
        finally:
            if threading.current_thread() is fence.first:
                fence.first_done.set()

    waiters = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(30)
    assert not errors, repr(errors[0])
    assert fence.done()


def test_every_waiter_gets_the_copy_error() -> None:
    fence = Fence()

    def fail() -> None:
        fence._error = OSError("copy failed")

    fence._thread = threading.Thread(target=fail)
    fence._thread.start()
    for _ in range(2):
        with pytest.raises(OSError, match="copy failed"):
            fence.wait()


def test_buffer_reserved_ahead_is_the_one_the_first_save_uses() -> None:
    pool = StagingPool()
    items = [("a", torch.randn(1000)), ("b", torch.randn(3, 5)), ("empty", torch.empty(0))]
    assert pool.reserve([t for _, t in items])
    assert not pool.reserve([t for _, t in items])  # under way or done: nothing more
    assert pool.nbytes == staged_nbytes([t for _, t in items])  # exactly the share
    pointer = pool._buffer.data_ptr()
    staged, fence = pool.stage(items)
    fence.wait()
    assert staged[0][1].data_ptr() == pointer
    assert all(torch.equal(h, t) for (_, h), (_, t) in zip(staged, items, strict=True))
    assert not pool.reserve([t for _, t in items[:1]])  # a smaller save fits already


def test_a_failed_reservation_is_reported_and_the_save_allocates(monkeypatch, caplog) -> None:
    pool = StagingPool()
    real_empty = torch.empty

    def refuse(*args, **kwargs):
        if threading.current_thread().name == "ddpckpt-reserve":
            raise RuntimeError("out of pinned memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refuse)
    items = [("a", torch.randn(64))]
    pool.reserve([t for _, t in items])
    with caplog.at_level("WARNING", logger="ddpckpt"):
        staged, fence = pool.stage(items)
    fence.wait()
    assert "out of pinned memory" in caplog.text
    assert torch.equal(staged[0][1], items[0][1])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("defer", [False, True])
def test_cuda_copies_see_queued_work_and_precede_later_work(side_stream, defer) -> None:
    # Training queued slow work that produces the values; staging must copy the values it
    # produced, and work queued after stage() returns must not reach the copy.
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        x = torch.zeros(16 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the values exist
        x.fill_(7)
        pool = StagingPool()
        staged, fence = pool.stage([("x", x)], defer=(lambda name: True) if defer else None)
        if defer:  # deferred copies: the optimizer step waits for the fence first
            fence.wait()
        x.fill_(9)  # the next step's update, queued at once
        fence.wait()
        host = staged[0][1]
        assert host.is_pinned() and torch.equal(host, torch.full_like(host, 7))
        torch.cuda.synchronize()
        assert float(x[0]) == 9
        assert pool.nbytes == 64 << 20  # exactly the share: no power-of-two rounding
        pool.release()
        assert pool.nbytes == 0


def test_checkpointer_sizes_its_buffer_before_the_first_save(tmp_path) -> None:
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(
        tmp_path / "run", model=model, optimizer=optimizer, async_save=True, every_steps=3
    )
    assert ckpt.resume() is None
    assert ckpt._saver.pool.nbytes == 0
    for step in range(1, 4):
        train_steps(model, optimizer, 1)  # the optimizer state exists after the first step
        if ckpt.should_save(step):
            break
        if step == 1:  # a step without a save: allocated now, on a helper thread
            reserved = ckpt._saver.pool.nbytes
            pointer = ckpt._saver.pool._buffer.data_ptr()
    assert reserved > 0
    ckpt.save(step)  # the first save stages into that buffer: no allocation
    assert (ckpt._saver.pool.nbytes, ckpt._saver.pool._buffer.data_ptr()) == (reserved, pointer)
    ckpt.close()
    fresh = make_mlp(seed=1)
    fresh.load_state_dict(ddpckpt.load_state_dict(tmp_path / "run" / "step-00000003"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_the_fast_tier_sizes_its_buffer_before_its_first_save(tmp_path) -> None:
    """On the GPU the fast tier's first save used to stall for its pinned buffer (0.94 s
    for 1.3 GiB on an H200): only the durable tier's was sized ahead. Now both are, the
    fast tier's also when the durable tier saves synchronously."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(
        tmp_path / "run", model=model, optimizer=optimizer, every_steps=100,
        fast_tier=ddpckpt.FastTier(tmp_path / "fast", every_steps=3),
    )  # fmt: skip
    assert ckpt.resume() is None
    pool = ckpt._fast.saver.pool
    assert pool.nbytes == 0
    for step in range(1, 4):
        train_steps(model, optimizer, 1)
        if ckpt.should_save(step):
            break
        if step == 1:
            reserved, pointer = pool.nbytes, pool._buffer.data_ptr()
    assert reserved > 0 and ckpt._saver.pool.nbytes == 0  # the durable tier saves in line
    ckpt.save(step)
    ckpt.wait()
    assert (pool.nbytes, pool._buffer.data_ptr()) == (reserved, pointer)
    ckpt.close()


def test_a_save_in_flight_keeps_its_buffer_when_a_later_step_would_size_one(
    tmp_path, monkeypatch
) -> None:
    """Saved at step 0, before Adam has moments: the state grows by step 1, but sizing the
    buffer ahead must not replace (and unpin) the one the background save is writing from."""
    import ddpckpt._io.writing as writing

    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(
        tmp_path / "run", model=model, optimizer=optimizer, async_save=True, every_steps=5
    )
    entered, opened = threading.Event(), threading.Event()
    real = writing.write_file

    def held(*args, **kwargs):
        entered.set()
        assert opened.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(writing, "write_file", held)
    ckpt.save(0)  # no resume(): the first save sizes the buffer itself
    assert entered.wait(30)
    buffer = ckpt._saver.pool._buffer
    train_steps(model, optimizer, 1)  # the moments appear: the state is now larger
    try:
        assert not ckpt.should_save(1)
        assert ckpt._saver.pool._reserving is None and ckpt._saver.pool._buffer is buffer
    finally:
        opened.set()
    ckpt.close()
    assert ckpt.steps() == [0]


def test_sizing_ahead_never_makes_should_save_raise(tmp_path) -> None:
    class Broken:
        def state_dict(self):
            raise TypeError("not today")

        def load_state_dict(self, state):
            pass

    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, async_save=True,
                        every_steps=5, extra={"broken": Broken()})  # fmt: skip
    assert ckpt.resume() is None
    assert not ckpt.should_save(1)  # the save itself reports the broken extra
    with pytest.raises(TypeError, match="not today"):
        ckpt.save(5)
    ckpt.close()


def test_a_plan_that_fails_on_this_rank_alone_never_makes_should_save_raise(
    tmp_path, monkeypatch
) -> None:
    """Sizing the buffer is local: a node that lacks a shard of the state fails there on its
    ranks only, and raising in should_save() would leave the other ranks waiting in the
    next collective. The save, which is collective, reports it on every rank."""
    import ddpckpt._run.saving as saving
    from ddpckpt.errors import UnsupportedValueError

    def lacking(*args):
        raise UnsupportedValueError("w: no rank of one node holds its shard at [4]")

    monkeypatch.setattr(saving, "staging_share", lacking)
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(
        tmp_path / "run", model=model, optimizer=optimizer, async_save=True, every_steps=5
    ) as ckpt:
        assert ckpt.resume() is None
        assert not ckpt.should_save(1)


class Restless:
    """A CPU source something writes again between every two looks at it."""

    is_cuda = False
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.looks = 0

    @property
    def _version(self) -> int:
        self.looks += 1
        return self.looks


class Sink:
    def copy_(self, source, non_blocking: bool = False) -> None:
        pass


def test_a_tensor_that_keeps_changing_while_copied_again_fails_the_save() -> None:
    from ddpckpt.errors import CheckpointWriteError

    reported: list[list[str]] = []
    check = staging._checked([copy_checks.Deferred("w", Sink(), Restless(), 0)], reported.append)
    with pytest.raises(CheckpointWriteError, match="w kept changing while they were copied"):
        check()
    assert reported == []  # nothing claims a good copy


def test_digests_are_fetched_once_per_device() -> None:
    assert copy_checks._fetch([torch.tensor(3), torch.tensor(-5), torch.tensor(7)]) == [3, -5, 7]
    assert copy_checks._fetch([]) == []
