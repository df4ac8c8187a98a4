"""The store seam: the default group's store, leader values, connections per call
(ddpckpt._coord.store)."""

from __future__ import annotations

import threading
import time

import pytest

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.store import StoreGroup, _default_store, namespace
from ddpckpt.errors import CheckpointError, CollectiveTimeoutError
from thread_ranks import ranks


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

        def write() -> None:  # rank 0 then waits in the gather while rank 1 still works
            waiting.set()
            time.sleep(0.5 if group.rank else 0)

        thread = threading.Thread(target=lambda: outcome.append(comm.run("write", write)))
        thread.start()
        waiting.wait()  # the call is open on this rank
        decision = Comm.from_leader("Checkpointer.should_save", lambda: b"1", group=group)
        thread.join()
        comm.close()
        return [decision, *outcome]

    results, _ = ranks(2, body)
    assert results == [[b"1", None], [b"1", None]]


def _namespace_of(monkeypatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return namespace()


def test_nodes_whose_restart_counts_differ_share_one_namespace(monkeypatch) -> None:
    """torchrun counts a restart only on the node whose worker failed; the other nodes'
    ranks must still meet the restarted ones under the same keys, and a new round's keys
    must differ from the last one's."""
    round_ = {"TORCHELASTIC_RUN_ID": "job", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    failed = _namespace_of(
        monkeypatch, **round_, MASTER_PORT="2001", TORCHELASTIC_RESTART_COUNT="1"
    )
    healthy = _namespace_of(
        monkeypatch, **round_, MASTER_PORT="2001", TORCHELASTIC_RESTART_COUNT="0"
    )
    assert failed == healthy
    first = _namespace_of(monkeypatch, **round_, MASTER_PORT="1999", TORCHELASTIC_RESTART_COUNT="0")
    assert first != healthy
    one_node = {"TORCHELASTIC_RUN_ID": "job", "GROUP_WORLD_SIZE": "1", "MASTER_PORT": "2001"}
    assert _namespace_of(monkeypatch, **one_node, TORCHELASTIC_RESTART_COUNT="0") != _namespace_of(
        monkeypatch, **one_node, TORCHELASTIC_RESTART_COUNT="1"
    )
