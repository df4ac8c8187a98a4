"""The collective wrapper without torch.distributed, and how per-rank failures combine."""

from __future__ import annotations

import errno
import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from unittest.mock import ANY

import pytest

from ddpckpt.dist.comm import Comm, StoreGroup, _combine, _default_store, node_id, resolve_timeout
from ddpckpt.errors import (
    CheckpointError,
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
    RankFailureError,
)


def test_single_process_is_local_and_errors_pass_unchanged() -> None:
    with Comm.open("ddpckpt.test", path="p") as comm:
        assert (comm.rank, comm.world_size, comm.path) == (0, 1, "p")
        assert comm.all_gather("x", b"a") == [b"a"]
        assert comm.run_all("y", lambda: {"v": 1}) == [{"v": 1}]
        with pytest.raises(KeyError):
            comm.run("z", lambda: {}["missing"])


def test_timeout_comes_from_argument_environment_or_default(monkeypatch) -> None:
    monkeypatch.delenv("DDPCKPT_TIMEOUT", raising=False)
    assert resolve_timeout(None) == 600.0
    monkeypatch.setenv("DDPCKPT_TIMEOUT", "12.5")
    assert resolve_timeout(None) == 12.5
    assert resolve_timeout(3) == 3.0
    monkeypatch.setenv("DDPCKPT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DDPCKPT_TIMEOUT='soon'"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="positive"):
        resolve_timeout(0)


def failure(kind: str, message: str, err: int | None = None) -> dict:
    return {"type": kind, "message": message, "errno": err, "host": "node-a"}


def test_same_failure_everywhere_keeps_its_type() -> None:
    error = _combine(
        "ddpckpt.load",
        {0: failure("CorruptCheckpointError", "bad"), 2: failure("CorruptCheckpointError", "bad")},
    )
    assert type(error) is CorruptCheckpointError
    assert str(error) == "bad (on ranks 0, 2)"
    assert error.failures == {0: "CorruptCheckpointError: bad", 2: "CorruptCheckpointError: bad"}


def test_os_errors_become_write_errors_with_errno() -> None:
    error = _combine("ddpckpt.save", {1: failure("OSError", "disk full", errno.ENOSPC)})
    assert isinstance(error, CheckpointWriteError) and error.errno == errno.ENOSPC


def test_different_failures_list_every_rank() -> None:
    error = _combine(
        "ddpckpt.save", {0: failure("KeyError", "'x'"), 3: failure("OSError", "gone", errno.EIO)}
    )
    assert type(error) is RankFailureError
    assert "rank 0 (node-a): KeyError: 'x'" in str(error)
    assert "rank 3 (node-a): OSError: gone" in str(error)


# --------------------------------------------------------------------------- several ranks
# Threads as ranks, each with its own client of one real TCPStore (see StoreGroup).


def _load_simulation() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "coordination.py"
    spec = importlib.util.spec_from_file_location("coordination_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


sim = _load_simulation()


def ranks(n: int, body, server=None) -> tuple[list, list]:
    """Run ``body(group)`` on ``n`` thread ranks; each rank's result (or exception) and stats."""
    return sim.run_ranks(n, lambda rank, store: body(StoreGroup(store, rank, n)), server)


def test_results_reach_the_ranks_that_need_them() -> None:
    def body(group: StoreGroup) -> dict:
        r = group.rank
        with Comm.open("ddpckpt.test", path=f"p{r}", timeout=30, group=group) as comm:
            return {
                "path": comm.path,
                "token": comm.token,
                "nodes": comm.nodes,
                "run": comm.run("run", lambda: r * 10),
                "all": comm.run_all("all", lambda: {"r": r}),
                "gather": comm.run_gather("gather", lambda: r + 1),
                "bytes": comm.all_gather("bytes", bytes([r])),
                "from2": comm.broadcast("b", b"two" if r == 2 else None, src=2),
                "barrier": comm.barrier("end"),
            }

    results, _ = ranks(4, body)
    for r, out in enumerate(results):
        assert not isinstance(out, BaseException), out
        assert out["path"] == "p0" and out["token"] == results[0]["token"]
        assert out["nodes"] == [node_id()] * 4
        assert out["run"] == r * 10
        assert out["all"] == [{"r": 0}, {"r": 1}, {"r": 2}, {"r": 3}]
        assert out["gather"] == ([1, 2, 3, 4] if r == 0 else None)
        assert out["bytes"] == [b"\0", b"\1", b"\2", b"\3"]
        assert out["from2"] == b"two"


def test_failures_are_combined_and_raised_on_every_rank() -> None:
    def body(group: StoreGroup) -> None:
        def step() -> None:
            if group.rank in (1, 3):
                raise OSError(errno.ENOSPC, "No space left on device", f"/ckpt/rank{group.rank}")

        with Comm.open("ddpckpt.save", timeout=30, group=group) as comm:
            comm.run("write", step)

    results, _ = ranks(4, body)
    for r, error in enumerate(results):
        assert isinstance(error, CheckpointWriteError) and error.errno == errno.ENOSPC
        assert sorted(error.failures) == [1, 3]
        assert "No space left on device" in str(error)
        assert str(error) == str(results[0])
        assert isinstance(error.__cause__, OSError) == (r in (1, 3))


def test_ranks_in_different_calls_fail_at_once_everywhere() -> None:
    def body(group: StoreGroup) -> None:
        call = "ddpckpt.load" if group.rank == 2 else "ddpckpt.save"
        with Comm.open(call, timeout=30, group=group):
            pass

    results, _ = ranks(3, body)
    for error in results:
        assert isinstance(error, CollectiveMismatchError)
        assert "rank 1: ddpckpt.save, rank 2: ddpckpt.load" in str(error)


def test_a_rank_that_never_calls_is_named_within_one_and_a_half_timeouts() -> None:
    timeout = 3.0

    def body(group: StoreGroup) -> tuple[BaseException, float] | None:
        if group.rank == 3:
            return None
        started = time.monotonic()
        try:
            with Comm.open("ddpckpt.save", timeout=timeout, group=group):
                pass
        except CollectiveTimeoutError as exc:
            return exc, time.monotonic() - started
        return None

    results, _ = ranks(4, body)
    for error, elapsed in results[:3]:
        assert "rank 3 did not call ddpckpt.save" in str(error) and error.failures == {3: ANY}
        assert timeout <= elapsed < 1.5 * timeout


def test_a_rank_that_dies_mid_call_is_named_on_every_other_rank() -> None:
    everyone_done = threading.Barrier(3)

    def body(group: StoreGroup) -> BaseException | None:
        comm = Comm.open("ddpckpt.save", timeout=2.0, group=group)
        if group.rank == 1:
            comm._stop.set()  # its heartbeat ends, as when the process is killed
            comm._beater.join()  # type: ignore[union-attr]
            everyone_done.wait()
            return None
        try:
            comm.run("write", lambda: None)
        except CollectiveTimeoutError as exc:
            return exc
        finally:
            comm.close()
            everyone_done.wait()
        return None

    results, _ = ranks(3, body)
    for error in (results[0], results[2]):
        assert "rank 1 stopped responding during ddpckpt.save (step 'write')" in str(error)


def test_ranks_waiting_in_different_exchanges_time_out() -> None:
    def body(group: StoreGroup) -> BaseException | None:
        try:
            with Comm.open("test.cycle", timeout=1.5, group=group) as comm:
                comm.barrier("a" if group.rank == 0 else "b")
        except CollectiveTimeoutError as exc:
            return exc
        return None

    results, _ = ranks(2, body)
    assert all(isinstance(e, CollectiveTimeoutError) for e in results), results
    assert str(results[0]) == str(results[1])


def test_a_slow_rank_that_heartbeats_is_waited_for() -> None:
    def body(group: StoreGroup) -> int:
        with Comm.open("ddpckpt.save", timeout=0.8, group=group) as comm:
            return comm.run("write", lambda: time.sleep(2.0 if group.rank == 2 else 0) or 7)

    results, _ = ranks(3, body)
    assert results == [7, 7, 7]


def _exchange_sequence(group: StoreGroup) -> None:
    with Comm.open("ddpckpt.save", timeout=600, group=group) as comm:
        comm.run("capture", lambda: None)
        comm.run_gather("write", lambda: {"files": [f"rank{group.rank}"]})
        comm.broadcast("state", b"{}" if group.rank == 0 else None)
        comm.barrier("commit")
    Comm.from_leader("Checkpointer.should_save", lambda: b"0", group=group)


def test_store_operations_per_rank_do_not_grow_with_the_ranks() -> None:
    counts = {}
    for n in (3, 12):
        server = sim.Server()
        results, stats = ranks(n, _exchange_sequence, server)
        assert results == [None] * n
        ops = [s.ops for s in stats]  # the main connection only: heartbeats are per second
        received = [s.bytes for s in stats[1:]]
        counts[n] = (ops[0], max(ops[1:]), max(received))
        assert server.store.num_keys() == n  # what is left: each rank's heartbeat record
    (lead3, other3, bytes3), (lead12, other12, bytes12) = counts[3], counts[12]
    assert lead12 == lead3 and other12 == other3
    assert bytes12 <= bytes3 + 64  # longer rank numbers in key names, nothing per rank


def test_leader_value_needs_no_call_and_names_a_missing_rank_zero() -> None:
    def body(group: StoreGroup) -> bytes:
        return Comm.from_leader("decide", lambda: b"yes" if group.rank == 0 else b"no", group=group)

    results, stats = ranks(3, body)
    assert results == [b"yes"] * 3 and stats[0].ops == 1

    def absent(group: StoreGroup) -> BaseException | None:
        if group.rank == 0:
            return None
        try:
            Comm.from_leader("Checkpointer.should_save", lambda: b"1", timeout=0.5, group=group)
        except CollectiveTimeoutError as exc:
            return exc
        return None

    results, _ = ranks(2, absent)
    assert "rank 0 did not call Checkpointer.should_save" in str(results[1])


def test_a_process_group_without_a_store_gets_a_clear_error(monkeypatch) -> None:
    from torch.distributed import distributed_c10d

    def no_store() -> None:
        raise AttributeError("no store")

    monkeypatch.setattr(distributed_c10d, "_get_default_store", no_store)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(CheckpointError, match="MASTER_ADDR and MASTER_PORT"):
        _default_store()


def test_a_background_call_waiting_does_not_block_the_training_threads_decision() -> None:
    """An asynchronous save's call waits in its thread while training asks should_save."""

    def body(group: StoreGroup) -> list:
        comm = Comm.open("Checkpointer.save", timeout=30, group=group)
        waiting = threading.Event()
        outcome = []

        def background() -> None:  # rank 0 waits in the gather while rank 1 still works
            waiting.set()
            outcome.append(comm.run("write", lambda: time.sleep(0.5 if group.rank else 0)))

        thread = threading.Thread(target=background)
        thread.start()
        waiting.wait()
        time.sleep(0.1)
        decision = Comm.from_leader("Checkpointer.should_save", lambda: b"1", group=group)
        thread.join()
        comm.close()
        return [decision, *outcome]

    results, _ = ranks(2, body)
    assert results == [[b"1", None], [b"1", None]]
