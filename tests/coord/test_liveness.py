"""A silent or dead rank is named within the timeout; a slow one that heartbeats is waited for
(ddpckpt._coord.liveness)."""

from __future__ import annotations

import threading
import time
from unittest.mock import ANY

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.liveness import Liveness, Watch, beat_key, roster_key
from ddpckpt._coord.store import StoreGroup
from ddpckpt.errors import CollectiveTimeoutError
from thread_ranks import ranks, sim


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
            comm._live._stop.set()  # its heartbeat ends, as when the process is killed
            comm._live._thread.join()  # type: ignore[union-attr]
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


def test_a_rank_silent_since_the_wait_began_is_judged_at_its_deadline_not_a_period_later() -> None:
    live = Liveness(StoreGroup(None, 0, 2), 0, "ddpckpt.save", 8.0, "failed")
    assert live.period == 1.0 and live._pause(None) == 1.0
    now = time.monotonic()
    due_soon = Watch("enter", {1: "key"}, 1, gather=True, started=now - 7.5)
    assert live._pause(due_soon) < 0.52  # wakes at the deadline, 0.5 s on, not in 1 s
    overdue = Watch("enter", {1: "key"}, 1, gather=True, started=now - 9.0)
    assert live._pause(overdue) == 1.0  # judged already: back to one beat a period


def test_ranks_with_a_heartbeat_are_found_in_one_read_however_many_are_missing() -> None:
    server = sim.Server()
    stats = sim.StoreStats()
    client = sim.CountingStore(server.client(), stats)
    for rank in range(1, 64, 2):  # half the ranks have started heartbeating
        client.set(beat_key(rank), b"0 1 1 0 0 0")
        client.append(roster_key(), f"{rank} ".encode())
    live = Liveness(StoreGroup(client, 0, 64), 0, "ddpckpt.save", 8.0, "failed")
    before = stats.ops
    assert live._present(client, list(range(64))) == list(range(1, 64, 2))
    assert stats.ops - before == 2  # check the roster, read it: not a search per missing rank
