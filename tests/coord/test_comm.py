"""Collectives over the store: results where needed, one error everywhere, constant traffic
(ddpckpt._coord.comm)."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ddpckpt._coord import liveness
from ddpckpt._coord.comm import Comm, node_id
from ddpckpt._coord.limits import resolve_timeout
from ddpckpt._coord.store import StoreGroup
from ddpckpt.errors import (
    CheckpointWriteError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankFailureError,
)
from thread_ranks import ranks, sim


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


def test_scattered_parts_reach_only_the_ranks_that_ask_for_them() -> None:
    def body(group: StoreGroup) -> dict:
        r = group.rank
        with Comm.open("ddpckpt.test", timeout=30, group=group) as comm:
            part = comm.run_scatter(
                "parts",
                lambda: r * 10,
                lambda found: {0: found[:2], 2: found[2:], 3: "never asked for"},
                receive=r in (0, 1, 2),
            )
            try:
                comm.run_scatter("broken", lambda: r, lambda found: {9: found[9]}, receive=True)
            except RankFailureError:  # rank 0's bug, raised on every rank
                return {"part": part, "error": True}
            return {"part": part, "error": False}

    results, stats = ranks(4, body)
    assert [out["part"] for out in results] == [[0, 10], None, [20, 30], None]
    assert all(out["error"] for out in results)
    # one read more for the ranks that asked (rank 1's part is empty); none for rank 3
    assert [s.by_op["get"] for s in stats[1:]] == [4, 4, 3]


def test_a_reduced_answer_is_the_same_on_every_rank_and_a_failing_reduce_raises_everywhere() -> (
    None
):
    def body(group: StoreGroup) -> dict:
        r = group.rank
        with Comm.open("ddpckpt.test", timeout=30, group=group) as comm:
            newest = comm.run_reduce("max", lambda: {"step": r * 10}, lambda v: (max(v, key=str),))
            by_rank = comm.run_reduce("keys", lambda: r, lambda v: {i: x for i, x in enumerate(v)})
            try:
                comm.run_reduce("broken", lambda: r, lambda v: v[99])
            except RankFailureError as exc:  # rank 0's bug, raised on every rank
                return {"newest": newest, "by_rank": by_rank, "error": str(exc)}
            return {"newest": newest, "by_rank": by_rank, "error": None}

    results, _ = ranks(4, body)
    for out in results:
        assert not isinstance(out, BaseException), out
        assert out == results[0]  # JSON on every rank, rank 0 included: lists, string keys
    assert results[0]["newest"] == [{"step": 30}]
    assert results[0]["by_rank"] == {"0": 0, "1": 1, "2": 2, "3": 3}
    assert "list index out of range" in results[0]["error"]
    with Comm.open("ddpckpt.test") as comm:  # one process: the same JSON value
        assert comm.run_reduce("one", lambda: 1, lambda v: {0: tuple(v)}) == {"0": [1]}


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


def _exchange_sequence(group: StoreGroup) -> None:
    with Comm.open("ddpckpt.save", timeout=600, group=group) as comm:
        comm.run("capture", lambda: None)
        comm.run_gather("write", lambda: {"files": [f"rank{group.rank}"]})
        comm.broadcast("state", b"{}" if group.rank == 0 else None)
        comm.barrier("commit")
    Comm.from_leader("Checkpointer.should_save", lambda: b"0", group=group)


def test_store_operations_per_rank_do_not_grow_with_the_ranks(monkeypatch) -> None:
    # A wait longer than one period re-checks liveness; on a loaded machine that would add
    # operations by timing, not by the number of ranks. Nobody is silent here.
    monkeypatch.setattr(liveness, "MAX_PERIOD", 60.0)
    counts = {}
    for n in (3, 12):
        server = sim.Server()
        results, stats = ranks(n, _exchange_sequence, server)
        assert results == [None] * n
        # The last rank to leave a call also deletes the call's shared keys: which rank that
        # is depends on timing, so the busiest rank's deletions vary by those few keys.
        deletes = [s.by_op.get("delete_key", 0) for s in stats]
        ops = [
            s.ops - d for s, d in zip(stats, deletes, strict=True)
        ]  # main connection only: heartbeats
        received = [s.bytes - s.bytes_by_op.get("delete_key", 0) for s in stats[1:]]
        counts[n] = (ops[0], max(ops[1:]), max(received), max(deletes))
        assert server.store.num_keys() == n + 1  # what is left: the heartbeat records, their roster
    (lead3, other3, bytes3, deleted3), (lead12, other12, bytes12, deleted12) = counts[3], counts[12]
    # Rank 0 waits for the last rank to leave the call unless it is the last itself, and that
    # rank tells it: one operation (and key) more or less, by timing.
    assert abs(lead12 - lead3) <= 1 and abs(other12 - other3) <= 1
    assert deleted12 <= 2 * deleted3  # O(N) per rank would be 4x at 12 ranks against 3
    assert bytes12 <= bytes3 + 64 + 96  # longer rank numbers in key names, nothing per rank


def _timed_failure(group: StoreGroup, fail: Callable[[Comm], None]) -> tuple[Any, float]:
    """Every rank opens a call with a long timeout; ``fail`` runs on every rank between two
    steps. Returns what each rank raised and after how many seconds."""
    started = time.monotonic()
    try:
        with Comm.open("ddpckpt.save", timeout=60, group=group) as comm:
            comm.run("plan", lambda: None)
            fail(comm)
            comm.run("write", lambda: None)
    except BaseException as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def test_a_rank_failing_between_steps_is_named_on_every_rank_within_seconds() -> None:
    """Rank 1's staging fails outside any step: the others, waiting in the next step, raise
    rank 1's error within a heartbeat period, not "stopped responding" after the timeout."""

    def stage(comm: Comm) -> None:
        if comm.rank == 1:
            comm.alone(lambda: torch.empty(1 << 62, dtype=torch.uint8))  # host out of memory

    results, _ = ranks(3, lambda group: _timed_failure(group, stage))
    errors = [error for error, _ in results]
    for rank, (error, elapsed) in enumerate(results):
        assert isinstance(error, RankFailureError), error
        assert list(error.failures) == [1] and "RuntimeError" in error.failures[1]
        assert str(error) == str(errors[0]) and "(on rank 1)" in str(error)
        assert isinstance(error.__cause__, RuntimeError) == (rank == 1)
        assert elapsed < 5, elapsed  # 60 s before; about a second now


def test_an_interrupt_inside_a_step_or_an_error_leaving_the_call_reaches_every_rank() -> None:
    def interrupt(comm: Comm) -> None:
        def step() -> None:
            if comm.rank == 2:
                raise KeyboardInterrupt

        comm.run("retain", step)

    def leave(comm: Comm) -> None:
        if comm.rank == 0:
            raise ValueError("rank 0 gave up")  # leaves the `with`: Comm.close posts it

    for fail, rank, kind in ((interrupt, 2, "KeyboardInterrupt"), (leave, 0, "ValueError")):
        results, _ = ranks(3, lambda group, fail=fail: _timed_failure(group, fail))
        for r, (error, elapsed) in enumerate(results):
            if r == rank:  # the failing rank raises its own exception, unchanged
                assert type(error).__name__ == kind
                continue
            assert isinstance(error, RankFailureError) and list(error.failures) == [rank]
            assert error.failures[rank].startswith(kind) and elapsed < 5, (error, elapsed)


def test_rank_zero_alone_in_a_call_says_which_ranks_it_waits_for(monkeypatch, caplog) -> None:
    """The seeds' ``if rank == 0: save(...)``: a warning naming the missing ranks after the
    notice period (once), then the error that says every rank must call."""
    monkeypatch.setenv("DDPCKPT_WAIT_NOTICE", "0.5")
    seen: list[float] = []
    caplog.set_level(logging.WARNING, logger="ddpckpt")
    original = logging.Logger.callHandlers

    def stamp(self: logging.Logger, record: logging.LogRecord) -> None:
        seen.append(time.monotonic())
        original(self, record)

    monkeypatch.setattr(logging.Logger, "callHandlers", stamp)

    def body(group: StoreGroup) -> Any:
        if group.rank != 0:
            return None
        started = time.monotonic()
        try:
            Comm.open("ddpckpt.save", timeout=2.5, group=group)
        except CollectiveTimeoutError as exc:
            return exc, started
        return None

    results, _ = ranks(4, body)
    error, started = results[0]
    notices = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(notices) == 1, notices
    assert "ddpckpt.save for ranks 1-3, which did not call it yet" in notices[0]
    assert "every rank must call ddpckpt.save" in notices[0]
    assert 0.5 <= seen[0] - started < 2.0
    assert "every rank must call it (not inside `if rank == 0`)" in str(error)


@pytest.mark.parametrize("how", ["exchanged", "derived"])
def test_after_a_failure_every_rank_raises_rank_0_leaves_the_call_last(monkeypatch, how) -> None:
    """Rank 0's process often holds the store. After a call that failed on every rank, rank 0
    used to return at once: a script whose last call it was could end, taking the store
    with it, while another rank was still counting itself out of the call (a CI run: rank 1
    got "Connection reset by peer" there, and the job hung). Now it waits, as after a call
    that succeeded: here it cannot return before rank 1 is let leave. Also when the error
    is one each rank derives from an answer they all got (a fast tier refused on one node:
    the CI run's case), which the call marks with ``everywhere``."""
    released = threading.Event()
    returned_after_release: dict[int, bool] = {}
    close = Comm.close

    def held_close(self: Comm, error: BaseException | None = None) -> None:
        if self.rank == 1:
            released.wait(30)
        close(self, error)

    monkeypatch.setattr(Comm, "close", held_close)

    def body(group: StoreGroup) -> None:
        def step() -> None:
            if group.rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/rank1")

        try:
            with Comm.open("ddpckpt.save", timeout=30, group=group) as comm:
                if how == "exchanged":  # rank 1's error comes to every rank through the call
                    comm.run("write", step)
                else:  # every rank raises an error it derives from an answer they all got
                    refused = comm.run_reduce("trust", lambda: group.rank == 1, any)
                    if refused:
                        raise comm.everywhere(CheckpointWriteError(errno.EACCES, "refused"))
        finally:
            returned_after_release[group.rank] = released.is_set()

    timer = threading.Timer(0.5, released.set)  # time for rank 0 to return on its own
    timer.start()
    results, _ = ranks(2, body)
    timer.cancel()
    assert all(isinstance(r, CheckpointWriteError) for r in results), results
    assert returned_after_release[0], "rank 0 left before rank 1 could"
