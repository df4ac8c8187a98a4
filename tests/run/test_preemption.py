"""Preemption: signal handlers that chain, one checkpoint at the same step on every rank.

The distributed tests run 2 ranks under torchrun (gloo, CPU) through ``exact_worker.py``,
which pauses at ``--pause-at`` until the test has sent its signals and written ``go``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt import Checkpointer
from ddpckpt._coord.store import StoreGroup
from ddpckpt._run import preemption
from ddpckpt._run.preemption import PreemptionWatch
from ddpckpt._run.signals import Preemption
from ddpckpt._training.worker_signals import IgnoringPreemptionSignals
from launch import ONE_NODE, _env, _finish, _start
from test_exact_resume import EXACT, compare, launch


def objects():
    model = make_mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def deliver(sig: int) -> None:
    """Send ``sig`` to this process and let its Python handler run."""
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the handler runs at the next bytecode boundary of the main thread
        time.sleep(0.001)


# ---------------------------------------------------------------------- handlers


def test_handlers_chain_to_the_applications_and_are_removed_on_close(restore_signals) -> None:
    seen: list[int] = []
    app_handler = lambda signum, frame: seen.append(signum)  # noqa: E731
    signal.signal(signal.SIGUSR1, app_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch = PreemptionWatch(Preemption(), newest=lambda: "nothing")
    assert signal.getsignal(signal.SIGUSR1) is not app_handler
    deliver(signal.SIGUSR1)
    deliver(signal.SIGTERM)  # was ignored: ours records it, nothing else runs
    assert seen == [signal.SIGUSR1]
    assert watch._signal is not None and watch._signal[0] == signal.SIGUSR1 and watch._count == 2
    watch._signal = None
    watch.close()
    assert signal.getsignal(signal.SIGUSR1) is app_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_handler_installed_over_ours_is_left_in_place(restore_signals) -> None:
    watch = PreemptionWatch(Preemption(signals=["SIGUSR2"]), newest=lambda: "nothing")
    ours = signal.getsignal(signal.SIGUSR2)
    seen: list[int] = []

    def later(signum, frame) -> None:  # an application that chains to what it found
        seen.append(signum)
        ours(signum, frame)

    signal.signal(signal.SIGUSR2, later)
    watch.close()
    assert signal.getsignal(signal.SIGUSR2) is later
    deliver(signal.SIGUSR2)  # our handler, still chained, no longer records anything
    assert seen == [signal.SIGUSR2] and watch._signal is None


def test_off_the_main_thread_nothing_is_installed_and_a_warning_says_so(
    restore_signals, caplog
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    watches = []
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        thread = threading.Thread(
            target=lambda: watches.append(PreemptionWatch(Preemption(), lambda: ""))
        )
        thread.start()
        thread.join()
    assert signal.getsignal(signal.SIGTERM) is before
    assert "only be installed from the main thread" in caplog.text
    watches[0].close()


def test_bad_options_fail_when_the_checkpointer_is_made(tmp_path, restore_signals) -> None:
    model = make_mlp()
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        Checkpointer(tmp_path, model=model, preemption=Preemption(signals=[signal.SIGKILL]))
    with pytest.raises(ValueError, match="not a signal"):
        Checkpointer(tmp_path, model=model, preemption=Preemption(signals=["SIGNOPE"]))
    with pytest.raises(ValueError, match="positive"):
        Checkpointer(tmp_path, model=model, preemption=Preemption(grace_seconds=0))
    with pytest.raises(ValueError, match="read_only"):
        Checkpointer(tmp_path, model=model, read_only=True, preemption=True)


# ---------------------------------------------------------------------- one process


def test_without_preemption_no_handler_is_installed(tmp_path, restore_signals) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model, opt = objects()
    with Checkpointer(tmp_path, model=model, optimizer=opt, every_steps=2) as ckpt:
        assert signal.getsignal(signal.SIGTERM) is before
        assert [ckpt.should_save(s) for s in (1, 2, 3)] == [False, True, False]
        assert not ckpt.preempted and ckpt.exit_code == 0


@pytest.mark.parametrize("async_save", [False, True, "overlap"])
def test_a_signal_makes_the_next_step_a_synchronous_save_then_preempted(
    tmp_path, restore_signals, caplog, async_save
) -> None:
    model, opt = objects()
    with Checkpointer(
        tmp_path, model=model, optimizer=opt, every_steps=100, preemption=True,
        async_save=async_save,
    ) as ckpt:  # fmt: skip
        for step in range(1, 10):
            train_steps(model, opt, steps=1)
            if step == 4:
                deliver(signal.SIGUSR1)
                deliver(signal.SIGUSR1)  # twice: still one checkpoint
            if ckpt.should_save(step):
                ckpt.save(step)
                assert ckpt.steps() == [step]  # durable when save() returns, even async
            if ckpt.preempted:
                break
        assert step == 4 and ckpt.exit_code == 128 + signal.SIGUSR1
    err = caplog.text
    assert "SIGUSR1 received (rank 0 first): every rank saves step 4" in err
    assert "preemption checkpoint" in err and "exit with Checkpointer.exit_code (138)" in err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # removed by close()


def test_rank_0s_listener_blocks_in_the_store_and_follows_each_round(
    monkeypatch, restore_signals, capfd
) -> None:
    """Rank 0's listener waits for other ranks' posts without timing out once a second
    (torch's store client prints two c10d warnings at each timed-out wait: a README user
    saw two lines a second on stderr for the whole run), and after an agreement it waits
    for the next round's post."""
    server = TCPStore("127.0.0.1", 0, 1, True)
    group = StoreGroup(server, 0, 2)
    monkeypatch.setattr(preemption, "default_group", lambda: group)
    watch = PreemptionWatch(Preemption(signals=[signal.SIGUSR1]), lambda: "step-1")
    try:
        assert watch.requested() is None  # starts the listener
        time.sleep(2.5)  # two steps' time with no signal anywhere
        deliver(signal.SIGUSR1)  # rank 0's own signal: agreed without any post
        decision = watch.requested()
        assert decision == b"P%d,0" % signal.SIGUSR1
        watch.agree(1, decision)
        watch.run_save(lambda: "step-1")
        post = {"rank": 1, "signal": int(signal.SIGUSR2)}
        server.set(watch._key(), json.dumps(post).encode())  # rank 1, in the next round
        deadline = time.monotonic() + 60
        while (decision := watch.requested()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decision == b"P%d,1" % signal.SIGUSR2
    finally:
        watch.close()
    assert "waitForInput" not in capfd.readouterr().err


@pytest.mark.parametrize("async_save", [True, "overlap"])
def test_the_async_save_of_the_signalled_step_is_finished_not_captured_again(
    tmp_path, restore_signals, async_save
) -> None:
    model, opt = objects()
    with Checkpointer(
        tmp_path, model=model, optimizer=opt, every_steps=3, preemption=True, async_save=async_save
    ) as ckpt:
        train_steps(model, opt, steps=1)
        assert ckpt.should_save(3)
        ckpt.save(3)  # in flight
        deliver(signal.SIGTERM)
        assert not ckpt.should_save(3)  # the loop asks again at the same step
        assert ckpt.preempted and ckpt.exit_code == 143 and ckpt.steps() == [3]


def test_signals_during_the_preemption_save_fold_into_it(tmp_path, restore_signals) -> None:
    model, opt = objects()
    with Checkpointer(tmp_path, model=model, optimizer=opt, preemption=True) as ckpt:
        capture = ckpt._capture

        def signalled_capture():
            deliver(signal.SIGTERM)  # the scheduler repeats itself mid-save
            return capture()

        ckpt._capture = signalled_capture
        deliver(signal.SIGUSR1)
        assert ckpt.should_save(1)
        ckpt.save(1)
        assert ckpt.preempted and ckpt.exit_code == 128 + signal.SIGUSR1
        ckpt._capture = capture
        assert not ckpt.should_save(2)  # no second preemption checkpoint
        deliver(signal.SIGTERM)  # a new signal once it is saved: a new round
        assert ckpt.should_save(3)
        ckpt.save(3)
        assert ckpt.steps() == [1, 3] and ckpt.exit_code == 143


def test_a_signal_with_no_should_save_after_it_is_reported_at_close(
    tmp_path, restore_signals, caplog
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # was ignored: stays so, nothing re-sent
    model, opt = objects()
    with Checkpointer(tmp_path, model=model, optimizer=opt, preemption=True) as ckpt:
        ckpt.save(1)
        deliver(signal.SIGTERM)
    err = caplog.text
    assert "SIGTERM was received but no should_save() call followed" in err
    assert "resume() will load" in err and "step-00000001 (step 1)" in err
    assert "delivered again" not in err and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def run_script(script: str, tmp_path: Path) -> tuple[int, str]:
    """Run ``script`` in a Python process of its own session (its own process group)."""
    proc = _start([sys.executable, "-c", script, str(tmp_path)], _env(None), None)
    ((code, output),) = _finish([proc], 120)
    return code, output


AFTER_THE_LOOP = """
import os, signal, sys, time, torch, ddpckpt
ckpt = ddpckpt.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2), preemption=True)
for step in range(1, 4):
    if ckpt.should_save(step):
        ckpt.save(step)
os.kill(os.getpid(), signal.SIGTERM)  # after the loop, e.g. during a final evaluation
time.sleep(0.1)
print("alive until close", flush=True)
ckpt.close()
print("alive after close", flush=True)
"""


@pytest.mark.processes
def test_a_sigterm_after_the_last_should_save_ends_the_process_at_close(tmp_path) -> None:
    code, output = run_script(AFTER_THE_LOOP, tmp_path)
    assert code == -signal.SIGTERM, output
    assert "alive until close" in output and "alive after close" not in output
    assert "SIGTERM was received but no should_save() call followed" in output
    assert "SIGTERM is delivered again now that the preemption handlers are removed" in output


WORKERS_SIGNALLED = """
import os, signal, sys, torch, ddpckpt
from torch import nn
ACCUMULATE = 8  # batches per optimizer step: the agreed step needs more from the workers

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4000
    def __getitem__(self, i):
        return torch.randn(8), torch.randn(1)

model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2)
ckpt = ddpckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, extra={"loader": loader},
                            every_steps=1000, preemption=True)
step = batches = 0
for x, y in loader:
    (model(x) - y).pow(2).mean().backward()
    batches += 1
    if batches == 2 * ACCUMULATE + 1:
        os.killpg(os.getpgrp(), signal.SIGTERM)  # mid-step, to every process, as torchrun does
    if batches % ACCUMULATE:
        continue
    opt.step()
    opt.zero_grad()
    step += 1
    if ckpt.should_save(step):
        ckpt.save(step)
    if ckpt.preempted:
        break
print("RESULT", step, ckpt.preempted, ckpt.steps(), flush=True)
ckpt.close()
del loader
import gc, multiprocessing
gc.collect()
print("WORKERS LEFT", [p.pid for p in multiprocessing.active_children()], flush=True)
"""


@pytest.mark.processes
def test_a_tracked_loaders_workers_survive_a_group_wide_sigterm(tmp_path) -> None:
    code, output = run_script(WORKERS_SIGNALLED, tmp_path)
    assert code == 0, output
    assert "RESULT 3 True [3]" in output, output  # the signal came during step 3
    assert "WORKERS LEFT []" in output, output  # the loader still shuts its workers down


def test_a_signal_during_resume_is_agreed_at_the_next_should_save(
    tmp_path, restore_signals
) -> None:
    model, opt = objects()
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save(5)
    with Checkpointer(tmp_path, model=model, optimizer=opt, preemption=True) as ckpt:
        original = ckpt._load

        def signalled_load(step):
            deliver(signal.SIGTERM)
            return original(step)

        ckpt._load = signalled_load
        info = ckpt.resume()
        assert not ckpt.preempted
        assert ckpt.should_save(info.step + 1)
        ckpt.save(info.step + 1)
        assert ckpt.preempted and ckpt.steps() == [5, 6]


# ---------------------------------------------------------------------- torchrun, 2 ranks

STEPS, EVERY = 12, 5  # 3 optimizer steps make an epoch: step 4 is mid-epoch 1


def start(out: Path, *options: str, env: dict[str, str] | None = None):
    """torchrun exact_worker.py on 2 ranks, paused after step 4 (see the module docstring)."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2",
           *ONE_NODE, "--max-restarts=0",
           str(EXACT), "train", str(out / "run"), str(out), f"--steps={STEPS}",
           f"--every={EVERY}", "--preempt", "--pause-at=4", *options]  # fmt: skip
    return _start(cmd, _env({"OMP_NUM_THREADS": "1", **(env or {})}), None)


def wait_for(proc, *paths: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            ((_, out),) = _finish([proc], 30)
            pytest.fail(f"waited for {[p.name for p in paths]}; the job said:\n{out[-5000:]}")
        time.sleep(0.02)


def paused_pids(proc, out: Path) -> list[int]:
    files = [out / f"paused-rank{r}.json" for r in (0, 1)]
    wait_for(proc, *files)
    return [json.loads(f.read_text())["pid"] for f in files]


def signal_then_go(proc, out: Path, pid: int, sig: int, ranks=(0, 1), before_go=None) -> None:
    """Send ``sig`` to ``pid``, wait until ``ranks`` received it, then let the workers go on."""
    os.kill(pid, sig)
    wait_for(proc, *(out / f"signalled-rank{r}" for r in ranks))
    if before_go is not None:
        before_go()
    (out / "go").touch()


def preempted(out: Path) -> list[dict]:
    return [json.loads((out / f"preempted-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run every preempted one is compared with."""
    out = tmp_path_factory.mktemp("straight")
    launch(2, "train", str(out / "run"), str(out), f"--steps={STEPS}", f"--every={EVERY}")
    return out


@pytest.mark.processes
def test_sigterm_to_torchrun_saves_one_step_on_both_ranks_and_resumes_bit_identical(
    tmp_path, straight
) -> None:
    proc = start(tmp_path)
    paused_pids(proc, tmp_path)
    signal_then_go(proc, tmp_path, proc.pid, signal.SIGTERM)  # the agent forwards it to both
    ((code, output),) = _finish([proc], 120)
    assert code != 0, output[-3000:]
    first, second = preempted(tmp_path)
    assert first["step"] == second["step"] and 4 <= first["step"] < STEPS, output[-3000:]
    assert first["exit_code"] == second["exit_code"] == 128 + signal.SIGTERM
    assert first["step"] in first["committed"]  # durable before save() returned
    assert "SIGTERM received" in output and "preemption checkpoint" in output
    launch(2, "train", str(tmp_path / "run"), str(tmp_path), f"--steps={STEPS}", f"--every={EVERY}")
    compare(straight, tmp_path)


@pytest.mark.processes
def test_sigusr1_to_one_worker_makes_both_ranks_save_the_same_step(tmp_path) -> None:
    proc = start(tmp_path)
    rank1 = paused_pids(proc, tmp_path)[1]
    signal_then_go(proc, tmp_path, rank1, signal.SIGUSR1, ranks=[1])  # rank 0 hears nothing
    ((code, output),) = _finish([proc], 120)
    assert code != 0, output[-3000:]
    first, second = preempted(tmp_path)
    assert first["step"] == second["step"] and 4 <= first["step"] < STEPS, output[-3000:]
    assert first["exit_code"] == second["exit_code"] == 128 + signal.SIGUSR1
    # Rank 0 heard no SIGUSR1. It may hear torchrun's SIGTERM: rank 1 can exit first, and
    # torchrun then stops the ranks still running (rank 0 after its save, in its exit).
    heard = tmp_path / "signalled-rank0"
    assert set(heard.read_text().split() if heard.exists() else []) <= {"SIGTERM"}
    assert "SIGUSR1 received (rank 1 first)" in output


@pytest.mark.processes
def test_closing_one_checkpointer_leaves_another_alone_and_a_signal_preempts_both(
    tmp_path,
) -> None:
    proc = _start([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2",
                   *ONE_NODE, "--max-restarts=0",
                   str(EXACT), "two", str(tmp_path / "run"), str(tmp_path)],
                  _env({"OMP_NUM_THREADS": "1"}), None)  # fmt: skip
    ((code, output),) = _finish([proc], 120)
    assert code == 0, output[-3000:]
    records = [json.loads((tmp_path / f"two-rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0] == records[1], output[-3000:]
    record = records[0]
    assert record["alone"] == {"preempted": False, "steps": []}, output[-3000:]
    assert record["second"]["preempted"] and record["third"]["preempted"], output[-3000:]
    assert len(record["second"]["steps"]) == len(record["third"]["steps"]) == 1
    assert "SIGUSR1 received (rank 1 first)" in output


@pytest.mark.processes
def test_a_signal_during_an_async_save_finishes_it_then_saves_synchronously(tmp_path) -> None:
    (tmp_path / "hold").touch()  # the async save of step 3 stays in flight until released
    proc = start(tmp_path, "--async-save", "--every=3", "--hold-from=3")
    paused_pids(proc, tmp_path)
    signal_then_go(proc, tmp_path, proc.pid, signal.SIGTERM, before_go=(tmp_path / "hold").unlink)
    ((code, output),) = _finish([proc], 120)
    assert code != 0, output[-3000:]
    first, second = preempted(tmp_path)
    assert first["step"] == second["step"] and 4 <= first["step"] < 6, output[-3000:]
    assert first["committed"] == [3, first["step"]], output[-3000:]


@pytest.mark.processes
def test_a_grace_period_too_short_is_reported_and_the_previous_checkpoint_stays(
    tmp_path,
) -> None:
    (tmp_path / "hold").touch()  # the preemption save never ends: the scheduler kills the job
    proc = start(tmp_path, "--every=3", "--hold-from=4", env={"DDPCKPT_GRACE_SECONDS": "0.5"})
    workers = paused_pids(proc, tmp_path)
    signal_then_go(proc, tmp_path, proc.pid, signal.SIGTERM)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()  # what the user reads
    deadline = time.monotonic() + 120
    while not any("ran out before the preemption" in line for line in lines[:]):
        if time.monotonic() > deadline or not reader.is_alive():
            break
        time.sleep(0.05)
    for pid in workers:  # the scheduler's SIGKILL at the end of the grace period
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    reader.join(60)
    proc.wait(60)
    output = "".join(lines)
    assert "grace period of 0.5 s (DDPCKPT_GRACE_SECONDS) after SIGTERM ran out" in output, output
    run = tmp_path / "run"
    assert f"resume() loads {run / 'step-00000003'} (step 3)" in output
    assert Checkpointer(run, model=make_mlp(), read_only=True).steps() == [3]
    ddpckpt.verify(run / "step-00000003")
    assert (run / "latest").read_text() == "step-00000003\n"


def test_a_spawned_loader_worker_learns_the_signals_from_the_pickled_init(
    restore_signals,
) -> None:
    init = IgnoringPreemptionSignals(None)
    assert pickle.loads(pickle.dumps(init)).signals == []  # no preemption on: nothing ignored
    watch = PreemptionWatch(Preemption(signals=["SIGUSR2"]), newest=lambda: "nothing")
    try:
        spawned = pickle.loads(pickle.dumps(init))  # as torch starts a spawn worker
    finally:
        watch.close()
    assert spawned.signals == [signal.SIGUSR2]
