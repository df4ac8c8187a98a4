"""Asynchronous saves: consistent snapshots, durable before `latest`, errors that surface."""

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
import ddpckpt._io.writing as writing
from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._io.staging import StagingPool
from held_copies import HeldCopies


def objects():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt)
    return model, opt


class Gate:
    """Makes the background writer block until the test opens the gate."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        real = writing.write_file

        def gated(*args, **kwargs):
            self.entered.set()
            assert self.opened.wait(30), "the gate was never opened"
            return real(*args, **kwargs)

        monkeypatch.setattr(writing, "write_file", gated)


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_the_checkpoint_holds_the_state_as_of_save(ckpt_dir, mode) -> None:
    model, opt = objects()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = opt.state[model[0].weight]["exp_avg"].clone()
    pending = ddpckpt.save(ckpt_dir, model=model, optimizer=opt, async_save=mode)
    train_steps(model, opt)  # the parameters and moments change right after save() returns
    assert pending.wait() == ckpt_dir
    fresh, fresh_opt = make_mlp(seed=3), None
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    ddpckpt.load(ckpt_dir, model=fresh, optimizer=fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], expected_moments)


def test_overlap_makes_optimizer_step_wait_for_the_snapshot(ckpt_dir, monkeypatch) -> None:
    model, opt = objects()
    before = model[0].weight.detach().clone()
    release, copied = threading.Event(), threading.Event()
    import ddpckpt._io.staging as staging

    real_copy = staging._copy

    def held_copy(pairs):
        if pairs and threading.current_thread().name == "ddpckpt-snapshot":
            assert release.wait(30)
            real_copy(pairs)
            copied.set()
            return
        real_copy(pairs)

    monkeypatch.setattr(staging, "_copy", held_copy)
    pending = ddpckpt.save(ckpt_dir, model=model, optimizer=opt, async_save="overlap")
    stepper = threading.Thread(target=train_steps, args=(model, opt, 1))
    stepper.start()  # forward and backward run; step() must wait for the copy
    stepper.join(0.5)
    assert stepper.is_alive() and not copied.is_set()
    release.set()
    stepper.join(30)
    assert copied.is_set() and not stepper.is_alive()
    pending.wait()
    assert torch.equal(ddpckpt.load_state_dict(ckpt_dir)["0.weight"], before)


def test_overlap_needs_the_optimizer(ckpt_dir) -> None:
    with pytest.raises(ValueError, match="optimizer"):
        ddpckpt.save(ckpt_dir, model=make_mlp(), async_save="overlap")
    with pytest.raises(ValueError, match="async_save"):
        ddpckpt.save(ckpt_dir, model=make_mlp(), async_save="later")


def test_latest_moves_only_once_the_checkpoint_is_durable(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    model, opt = objects()
    ckpt = Checkpointer(run, model=model, optimizer=opt, async_save=True)
    ckpt.save(1)
    ckpt.wait()
    gate = Gate(monkeypatch)
    ckpt.save(2)  # returns while its writer is held at the gate
    assert gate.entered.wait(30)
    assert (run / "latest").read_text() == "step-00000001\n"
    assert not (run / "step-00000002").exists()
    gate.opened.set()
    ckpt.wait()
    assert (run / "latest").read_text() == "step-00000002\n"
    assert ddpckpt.verify(run / "step-00000002").step == 2
    ckpt.close()


def test_one_save_in_flight_the_next_waits(tmp_path, monkeypatch) -> None:
    model, opt = objects()
    ckpt = Checkpointer(
        tmp_path / "run", model=model, optimizer=opt, async_save=True, keep_last=None
    )
    gate = Gate(monkeypatch)
    ckpt.save(1)
    assert gate.entered.wait(30)
    second = threading.Thread(target=ckpt.save, args=(2,))
    second.start()  # must wait for step 1 before reusing the host buffers
    second.join(0.5)
    assert second.is_alive()
    gate.opened.set()
    second.join(30)
    ckpt.close()
    assert ddpckpt.verify(tmp_path / "run" / "step-00000001").step == 1
    assert ddpckpt.verify(tmp_path / "run" / "step-00000002").step == 2


def fail_writes(monkeypatch, code: int) -> threading.Event:
    failed = threading.Event()

    def fail(path, *args, **kwargs):
        failed.set()
        raise OSError(code, os.strerror(code), path)

    monkeypatch.setattr(writing, "write_file", fail)
    return failed


def test_a_background_failure_surfaces_at_the_next_call(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    model, opt = objects()
    ckpt = Checkpointer(
        run, model=model, optimizer=opt, async_save=True, on_error="raise", retries=0
    )
    ckpt.save(1)
    ckpt.wait()
    failed = fail_writes(monkeypatch, errno.ENOSPC)
    assert ckpt.save(2) == os.fspath(run / "step-00000002")  # returns: the failure comes later
    assert failed.wait(5)
    monkeypatch.undo()
    with pytest.raises(ddpckpt.CheckpointWriteError) as caught:
        ckpt.save(3)
    assert caught.value.errno == errno.ENOSPC
    assert sorted(n for n in os.listdir(run) if n != ".lock") == [
        "latest",
        "run.json",
        "step-00000001",
    ]
    assert ckpt.save(2) is not None  # nothing half-committed: step 2 can be saved again
    ckpt.close()


def test_a_background_failure_only_warns_by_default(tmp_path, monkeypatch, caplog) -> None:
    model, opt = objects()
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=opt, async_save=True, retries=0)
    failed = fail_writes(monkeypatch, errno.EIO)
    ckpt.save(1)
    assert failed.wait(5)
    monkeypatch.undo()
    ckpt.wait()
    assert "training goes on" in caplog.text
    assert ckpt.save(1) is not None  # the failed step was never committed
    ckpt.close()


def test_transient_background_errors_are_retried(tmp_path, monkeypatch) -> None:
    model, opt = objects()
    real = writing.write_file
    failures = [errno.EIO]

    def flaky(path, *args, **kwargs):
        if failures:
            raise OSError(failures.pop(), "I/O error", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(writing, "write_file", flaky)
    ckpt = Checkpointer(
        tmp_path / "run", model=model, optimizer=opt, async_save=True, retry_backoff=0.01
    )
    ckpt.save(1)
    ckpt.close()
    assert ddpckpt.verify(tmp_path / "run" / "step-00000001").step == 1


def test_host_buffers_are_reused_not_reallocated() -> None:
    pool = StagingPool()
    tensors = [("a", torch.randn(100)), ("b", torch.randn(7, 3)), ("c", torch.tensor(2.0))]
    first, fence = pool.stage(tensors)
    fence.wait()
    pointer = first[0][1].data_ptr()
    second, _ = pool.stage(tensors)
    assert second[0][1].data_ptr() == pointer and pool.nbytes >= sum(
        t.numel() * 4 for _, t in tensors
    )
    assert all(torch.equal(host, t) for (_, host), (_, t) in zip(second, tensors, strict=True))


def test_host_buffers_are_freed_on_request_and_by_close(tmp_path) -> None:
    from ddpckpt._io.async_saver import DEFAULT_SAVER

    model, opt = objects()
    ddpckpt.save(tmp_path / "a", model=model, optimizer=opt, async_save=True)
    assert DEFAULT_SAVER.pool.nbytes > 0
    ddpckpt.release_async_buffers()  # waits for the save in flight first
    assert DEFAULT_SAVER.pool.nbytes == 0
    assert ddpckpt.verify(tmp_path / "a").path
    ddpckpt.save(tmp_path / "b", model=model, optimizer=opt, async_save=True).wait()
    ddpckpt.release_async_buffers()

    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=opt, async_save=True)
    ckpt.save(1)
    assert ckpt._saver.pool.nbytes > 0
    ckpt.close()
    assert ckpt._saver.pool.nbytes == 0 and ddpckpt.verify(tmp_path / "run" / "step-00000001")


def test_save_and_each_checkpointer_have_their_own_buffer(tmp_path) -> None:
    from ddpckpt._io.async_saver import DEFAULT_SAVER

    model, opt = objects()
    ddpckpt.save(tmp_path / "a", model=model, optimizer=opt, async_save=True).wait()
    with Checkpointer(tmp_path / "run", model=model, optimizer=opt, async_save=True) as ckpt:
        ckpt.save(1)
        ckpt.wait()
        assert ckpt._saver is not DEFAULT_SAVER and ckpt._saver.pool.nbytes > 0
        ddpckpt.release_async_buffers()  # frees save()'s buffer, not the run's
        assert DEFAULT_SAVER.pool.nbytes == 0 and ckpt._saver.pool.nbytes > 0
        ckpt.save(2)
    assert ckpt._saver.pool.nbytes == 0
    assert ddpckpt.verify(tmp_path / "run" / "step-00000002").step == 2


@pytest.mark.processes
def test_a_save_in_flight_when_the_program_ends_is_completed(tmp_path) -> None:
    script = (
        "import torch, ddpckpt\n"
        "model = torch.nn.Linear(1024, 1024)\n"  # 4 MiB: hashed on the helper thread
        f"ddpckpt.save({str(tmp_path / 'ckpt')!r}, model=model, async_save=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert ddpckpt.verify(tmp_path / "ckpt").path


def test_a_failed_background_save_is_logged_even_if_nobody_waits(caplog) -> None:
    from ddpckpt._io.background import Persister

    persister = Persister()

    def fail() -> None:
        raise ddpckpt.CheckpointWriteError(errno.ENOSPC, "disk full")

    with caplog.at_level(logging.ERROR, logger="ddpckpt"):
        persister.submit(fail, "step-7")
        persister._thread.join()
    assert "background save step-7 failed" in caplog.text
    with pytest.raises(ddpckpt.CheckpointWriteError):
        persister.raise_unseen()


def test_overlap_fences_a_second_optimizer_passed_in_extra(ckpt_dir, monkeypatch) -> None:
    """GAN-style: the discriminator's optimizer steps first; it must not beat the copy."""
    torch.manual_seed(0)
    gan = torch.nn.ModuleDict({"G": torch.nn.Linear(4, 4), "D": torch.nn.Linear(4, 1)})
    opt_g = torch.optim.Adam(gan["G"].parameters(), lr=0.1)
    opt_d = torch.optim.Adam(gan["D"].parameters(), lr=0.1)

    def discriminator_step() -> None:
        opt_d.zero_grad()
        real, fake = torch.randn(8, 4), gan["G"](torch.randn(8, 4)).detach()
        (gan["D"](fake).mean() - gan["D"](real).mean()).backward()
        opt_d.step()

    discriminator_step()
    before = {k: v.clone() for k, v in gan.state_dict().items()}
    moments = opt_d.state[gan["D"].weight]["exp_avg"].clone()
    release = threading.Event()
    import ddpckpt._io.staging as staging

    real_copy = staging._copy

    def held_copy(pairs):
        if pairs and threading.current_thread().name == "ddpckpt-snapshot":
            assert release.wait(30)
        real_copy(pairs)

    monkeypatch.setattr(staging, "_copy", held_copy)
    pending = ddpckpt.save(
        ckpt_dir, model=gan, optimizer=opt_g, extra={"opt_d": opt_d}, async_save="overlap"
    )
    stepper = threading.Thread(target=discriminator_step)
    stepper.start()
    stepper.join(2)  # bounded wait only: with the fence the step is still blocked here
    release.set()
    stepper.join(30)
    pending.wait()
    saved = ddpckpt.load_state_dict(ckpt_dir)
    for key, value in before.items():
        assert torch.equal(saved[key], value), key  # not the values after opt_d.step()
    fresh_d = torch.optim.Adam(gan["D"].parameters())
    ddpckpt.load(ckpt_dir, model=gan, extra={"opt_d": fresh_d})
    assert torch.equal(fresh_d.state[gan["D"].weight]["exp_avg"], moments)


def test_each_pending_save_reports_its_own_outcome(tmp_path, monkeypatch) -> None:
    model, opt = objects()
    real = writing.write_file
    first_fails = [errno.ENOSPC]

    def write_file(location, *args, **kwargs):
        if first_fails and "first" in location.path:
            raise OSError(first_fails.pop(), os.strerror(errno.ENOSPC), location.path)
        return real(location, *args, **kwargs)

    monkeypatch.setattr(writing, "write_file", write_file)
    p1 = ddpckpt.save(tmp_path / "first", model=model, optimizer=opt, async_save=True)
    # the second save waits for the first and raises its unseen failure: the first one's
    with pytest.raises(ddpckpt.CheckpointWriteError) as raised:
        ddpckpt.save(tmp_path / "second", model=model, optimizer=opt, async_save=True)
    assert raised.value.errno == errno.ENOSPC
    p2 = ddpckpt.save(tmp_path / "second", model=model, optimizer=opt, async_save=True)
    assert p2.wait() == os.fspath(tmp_path / "second") and p2.exception() is None
    assert p1.done() and p2.done()
    for _ in range(2):  # its own error, every time it is asked
        with pytest.raises(ddpckpt.CheckpointWriteError):
            p1.wait()
    assert isinstance(p1.exception(), ddpckpt.CheckpointWriteError)
    assert p2.wait() == os.fspath(tmp_path / "second")  # not the first one's error
    assert ddpckpt.verify(tmp_path / "second").path and not (tmp_path / "first").exists()


def test_a_failure_seen_through_its_handle_is_not_raised_again(tmp_path, monkeypatch) -> None:
    model, _ = objects()
    failed = fail_writes(monkeypatch, errno.EIO)
    p1 = ddpckpt.save(tmp_path / "a", model=model, async_save=True)
    assert failed.wait(5)
    monkeypatch.undo()
    with pytest.raises(ddpckpt.CheckpointWriteError):
        p1.wait()
    p2 = ddpckpt.save(tmp_path / "b", model=model, async_save=True)  # does not raise p1's error
    assert p2.wait() == os.fspath(tmp_path / "b")
    assert isinstance(p1.exception(), ddpckpt.CheckpointWriteError)
    ddpckpt.release_async_buffers()


@pytest.mark.processes
def test_a_background_failure_asked_on_one_rank_only_is_raised_on_every_rank(tmp_path) -> None:
    """Rank 0 reads the failed save's handle (or waits on its Checkpointer), rank 1 does not:
    the next save must fail on both ranks with the save's error, not leave rank 0 waiting
    for rank 1 until the timeout and the ranks one collective call apart."""
    from launch import forked_ranks

    args = ["--ckpt", str(tmp_path / "ckpt"), "--timeout", "60"]
    launch = forked_ranks("failed_async_asked_on_one_rank", tmp_path / "out", args=args).ok()
    for rank in (0, 1):
        result = launch.result(rank)
        assert result["next_save"] == "CheckpointWriteError", result
        assert result["third_save"].endswith("c"), result
        assert result["checkpointer_next_save"] == "CheckpointWriteError", result
        assert result["checkpointer_steps"] == [3], result
    assert "ENOSPC" in launch.result(0)["asked"] or "No space" in launch.result(0)["asked"]
    assert launch.result(0)["rank0_wait"] == "raised"


def save_overlap(where: str, model, opt, how: str):
    """An overlap save through ``ddpckpt.save`` or a Checkpointer; returns a waiter."""
    if how == "save":
        pending = ddpckpt.save(where, model=model, optimizer=opt, async_save="overlap")
        return pending.wait
    ckpt = Checkpointer(where, model=model, optimizer=opt, async_save="overlap")
    ckpt.save(1)
    return ckpt.close


@pytest.mark.parametrize("how", ["save", "checkpointer"])
def test_overlap_copies_an_embedding_that_renormalises_its_rows_before_save_returns(
    tmp_path, monkeypatch, caplog, how
) -> None:
    # nn.Embedding(max_norm=...) rewrites the rows each forward looks up, in place, so its
    # weight is not left to the background: the checkpoint holds the rows as of save(),
    # not renormalised ones, with no warning, while the optimizer's state is still
    # copied during the forward.
    torch.manual_seed(0)
    model = torch.nn.Embedding(64, 8, max_norm=1.0)
    with torch.no_grad():
        model.weight.mul_(10)  # every row's norm is over max_norm
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.arange(2)).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    held = HeldCopies(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        done = save_overlap(os.fspath(tmp_path / "ckpt"), model, opt, how)
        model(torch.arange(64))  # renormalises every row, at once
        assert not torch.equal(model.weight, before)
        held.release()  # the momentum, copied in the background
        done()
    where = os.fspath(tmp_path / "ckpt")
    saved = ddpckpt.load_state_dict(where if how == "save" else ddpckpt.latest(where))
    assert torch.equal(saved["weight"], before)
    assert held.copied.is_set()  # the momentum was deferred
    fresh = torch.nn.Embedding(64, 8, max_norm=1.0)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ddpckpt.load(
        where if how == "save" else ddpckpt.latest(where), model=fresh, optimizer=fresh_opt
    )
    assert torch.equal(fresh_opt.state[fresh.weight]["momentum_buffer"], momentum)
    assert "written in place" not in caplog.text


@pytest.mark.parametrize("write", ["no_grad", "data"])
def test_overlap_copies_again_and_warns_about_a_tensor_written_before_its_copy(
    tmp_path, monkeypatch, caplog, write
) -> None:
    # A write to a parameter after save() returns, by something other than step(): the
    # checkpoint holds one value of it (never a mix of rows), a WARNING names it, and from
    # then on this saver copies it before save() returns, so the next checkpoint is exact.
    from ddpckpt._io.async_saver import DEFAULT_SAVER

    monkeypatch.setattr(DEFAULT_SAVER, "_eager", set())  # what earlier tests taught it
    model, opt = objects()
    weight = model[0].weight

    def scale(factor: float) -> None:
        if write == "data":
            weight.data.copy_(weight.data * factor)
        else:
            with torch.no_grad():
                weight.mul_(factor)

    held = HeldCopies(monkeypatch, hold_check=True)
    first = os.fspath(tmp_path / "first")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        pending = ddpckpt.save(first, model=model, optimizer=opt, async_save="overlap")
        held.release()
        assert held.copied.wait(30)
        scale(2.0)  # after the copy landed, before it was checked: detected
        held.checked.set()
        pending.wait()
    assert "0.weight" in caplog.text and "written in place after save() returned" in caplog.text
    assert torch.equal(ddpckpt.load_state_dict(first)["0.weight"], weight)  # one value

    caplog.clear()
    at_save = weight.detach().clone()
    second = os.fspath(tmp_path / "second")
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        pending = ddpckpt.save(second, model=model, optimizer=opt, async_save="overlap")
        scale(3.0)  # at once: the copy was taken before save() returned
        pending.wait()
    assert torch.equal(ddpckpt.load_state_dict(second)["0.weight"], at_save)
    assert "written in place" not in caplog.text
