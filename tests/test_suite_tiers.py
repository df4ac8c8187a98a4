"""The suite's own machinery: tiers enforced and dealt (tiers.py), agentless ranks stopped as torchrun stops
its workers (forked.py), a port lost to another process taken again (launch.py)."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from forked import run_ranks
from launch import _env, on_a_free_port
from tiers import dealing_order

pytest_plugins = ["pytester"]
SUPPORT = Path(__file__).parent / "support"

INNER = """
import subprocess
import sys

import pytest


def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.processes
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_stays_in_process():
    assert sum(range(4)) == 6
"""


@pytest.mark.processes  # the inner test marked processes starts one
def test_a_unit_test_that_starts_a_process_fails_and_names_the_marker(pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "tiers", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_unmarked_starts_a_process starts a subprocess but is in the unit tier: mark it*"]
    )


GROUPED = """
import os

import pytest


@pytest.fixture(scope="module")
def launched():
    with open(os.environ["BUILDS"], "a") as builds:
        builds.write("built\\n")


@pytest.mark.parametrize("case", range(4))
def test_shares_the_launch(launched, case):
    pass


@pytest.mark.parametrize("case", range(4))
def test_alone(case):
    pass
"""


@pytest.mark.processes  # two xdist workers
def test_tests_sharing_a_module_fixture_run_on_one_worker_which_builds_it_once(
    pytester, tmp_path, monkeypatch
) -> None:
    """What ``make test`` relies on: with pytest 9.2 and pytest-xdist 3.8 the groups were
    silently dropped, and each launch shared by a module's tests ran once per worker."""
    monkeypatch.setenv("BUILDS", str(tmp_path / "builds"))
    support = str(Path(__file__).with_name("support"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [support, os.environ.get("PYTHONPATH")])))  # fmt: skip
    pytester.makepyfile(test_grouped=GROUPED)
    result = pytester.runpytest_subprocess(
        "-p", "tiers", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v"
    )
    result.assert_outcomes(passed=8)
    workers = {line.split("]")[0] for line in result.outlines if "test_shares_the_launch" in line and "PASSED" in line}  # fmt: skip
    assert len(workers) == 1, result.outlines
    assert (tmp_path / "builds").read_text() == "built\n"


@pytest.mark.processes
def test_a_port_someone_else_bound_first_is_picked_again_and_the_waiting_peer_stopped() -> None:
    """The first try's "rank 0" cannot bind; its peer, which would wait for rank 0's store
    until the timeout, is stopped at once, and both start again on another port."""
    tried: list[int] = []
    lost = "import sys; print('RuntimeError: EADDRINUSE: address already in use'); sys.exit(1)"
    waits = "import time; time.sleep(100)"

    def starts(port: int) -> list:
        tried.append(port)
        first = len(tried) == 1
        return [([sys.executable, "-c", lost if first else f"print('host on {port}')"], _env(None), None),
                ([sys.executable, "-c", waits if first else "print('peer')"], _env(None), None)]  # fmt: skip

    outs = on_a_free_port(starts, timeout=90)
    assert len(tried) == 2
    assert outs == [(0, f"host on {tried[1]}\n"), (0, "peer\n")]


@pytest.mark.processes
def test_a_killed_run_whose_phase_port_was_taken_starts_again_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """killed_run.py's phases bind ports picked before the launch: the one taken by another
    process in between fails that phase with EADDRINUSE, and the whole launch is made again,
    from nothing, on ports picked anew."""
    import launch
    from killed_run import assert_resumed_exactly, launch_killed_run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picked: list[int] = []
        real = launch.free_port

        def free_port() -> int:  # the launch's own port, then the phases' (the first: taken)
            picked.append(taken.getsockname()[1] if len(picked) == 1 else real())
            return picked[-1]

        monkeypatch.setattr(launch, "free_port", free_port)
        run = launch_killed_run(SUPPORT / "plain_killed_worker.py", tmp_path, mode="plain")
    assert len(picked) == 8  # two attempts of the launch's port and three phases' ports
    assert_resumed_exactly(run, resumed_from=2, steps=2)


@pytest.mark.processes
def test_a_failure_that_is_not_the_port_is_not_retried() -> None:
    calls = []

    def starts(port: int) -> list:
        calls.append(port)
        return [([sys.executable, "-c", "raise SystemExit('ValueError')"], _env(None), None)]

    ((code, output),) = on_a_free_port(starts, timeout=90)
    assert (code, output, len(calls)) == (1, "ValueError\n", 1)


@pytest.mark.processes
def test_agentless_ranks_stop_the_others_once_one_fails(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            rank = int(os.environ["RANK"])

            def stopped(signum, frame):
                print(f"rank {rank} stopped by {signal.Signals(signum).name}", flush=True)
                sys.exit(1)

            signal.signal(signal.SIGTERM, stopped)
            print(f"rank {rank} of {os.environ['WORLD_SIZE']} in {os.getcwd()}: {sys.argv[1:]}")
            open(f"ready-{rank}", "w").close()
            if rank == 1:  # fails once the others can tell they were stopped
                while not (os.path.exists("ready-0") and os.path.exists("ready-2")):
                    time.sleep(0.01)
                sys.exit(3)
            time.sleep(100)
            """
        )
    )
    code, output = run_ranks(worker, ["a", "b"], nproc=3, env=_env(None), timeout=90, cwd=tmp_path)
    assert code == 1
    for rank in range(3):
        assert f"rank {rank} of 3 in {tmp_path}: ['a', 'b']" in output
    assert "rank 0 stopped by SIGTERM" in output and "rank 2 stopped by SIGTERM" in output


@pytest.mark.processes
def test_agentless_ranks_that_outlive_the_timeout_are_killed(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(AssertionError, match=r"launch hung for 3 s and was killed:\n.*started"):
        run_ranks(worker, [], nproc=2, env=_env(None), timeout=3)


SHARED = """
from ddpckpt.storage import storage_for


def test_patches_the_shared_in_memory_storage(monkeypatch):
    monkeypatch.setattr(storage_for("memory://x"), "delete", lambda location: None)


def test_finds_it_as_its_class_defines_it():
    storage = storage_for("memory://x")
    assert "delete" not in vars(storage), vars(storage)
"""


def test_a_method_patched_on_a_shared_storage_is_its_class_again_in_the_next_test(
    pytester, monkeypatch
) -> None:
    """monkeypatch's undo leaves the bound method it saved on the instance, which shadows
    any later patch of the class (tests/support/shared_storages.py)."""
    # Other installed plugins stay out of the inner runs: pytest-benchmark's, for one, runs
    # git while it adds its options, a subprocess the unit tier refuses.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_inner=SHARED)
    result = pytester.runpytest_inprocess("-p", "shared_storages", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)
    bare = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-p", "no:shared_storages")
    bare.assert_outcomes(passed=1, failed=1)  # without it, the copy stays


def test_long_tests_are_dealt_in_the_first_two_thirds_and_unit_tests_throughout() -> None:
    tiers = ["unit"] * 600 + ["processes"] * 60 + ["long"] * 30  # in collection order
    order = dealing_order(list(range(len(tiers))), tiers)
    assert sorted(order) == list(range(len(tiers)))
    dealt = [tiers[i] for i in order]
    for tier in ("unit", "processes", "long"):  # each tier's own order is kept
        assert [i for i in order if tiers[i] == tier] == [
            i for i, t in enumerate(tiers) if t == tier
        ]
    last_long = max(i for i, t in enumerate(dealt) if t == "long")
    assert last_long < 0.75 * len(dealt)
    thirds = [dealt[k * 230 : (k + 1) * 230] for k in range(3)]
    assert all(150 < third.count("unit") < 250 for third in thirds)  # not all at the end
