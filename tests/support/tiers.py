"""The test suite's three tiers, by cost, and the check that keeps each test in its own.

- **unit** (no marker): one process; no subprocess, fork or server process (an in-process
  store on loopback is fine). ``make test-fast``.
- **processes**: starts processes (torchrun, forked ranks, the CLI, DataLoader workers) or
  uses a server (the S3 server on loopback: its fixture, or the ``s3`` parameter of a
  stored-root fixture, marks the test).
- **long**: a minute or more each: the crash suite, the install, check-resume end to end,
  the demo, the documentation build.

A test that starts a process without the ``processes`` or ``long`` marker fails with a message
that says which marker to add; a test that uses the S3 server is marked ``processes`` by its
fixture. ``make test`` (CI) runs every tier; tests that share a module-scoped fixture are
grouped onto one worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import pytest

MARKERS = {
    "processes": "starts processes (torchrun, forked ranks, the CLI, loader workers) or a server",
    "long": "a minute or more: crash suite, install, check-resume end to end, demo, docs build",
}
# Fixtures that start a server for the test, so the test is in the process tier; and the
# parametrized fixtures whose "s3" parameter starts that server (conftest.py's stored roots,
# tests/storage/test_base.py's store).
_SERVER_FIXTURES = {"s3_endpoint"}
_SERVER_PARAMS = {"ckpt_root": "s3", "run_root": "s3", "store": "s3"}


class TierError(AssertionError):
    """A unit-tier test started a process."""


def pytest_configure(config: pytest.Config) -> None:
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        _group_by_module_fixture(item)
        if _uses_a_server(item):
            item.add_marker(pytest.mark.processes)
    if hasattr(config, "workerinput"):  # pytest-xdist's worker: the order it deals in
        items[:] = dealing_order(items, [_tier(item) for item in items])


T = TypeVar("T")
# Rough seconds of a test of each tier, for the dealing order only.
_COST = {"long": 8.0, "processes": 2.0, "unit": 0.1}


def _tier(item: pytest.Item) -> str:
    return next((name for name in ("long", "processes") if item.get_closest_marker(name)), "unit")


def dealing_order(items: list[T], tiers: list[str]) -> list[T]:
    """The order pytest-xdist deals the tests in (after the groups of several tests, which it
    deals first; without it, tests run in their modules' order, each module's fixtures built
    once): each tier's tests in their own order, spread over the run by their rough
    cost. The long tier takes the first two thirds, so that a worker free at the end finds
    short tests, not a long one that keeps the run going while the other workers idle; the
    unit tier's tests, many of which wait on a timeout with the CPU idle, run beside the
    process tests, which use more than one core, instead of after them."""
    spread = {"long": 0.65, "processes": 1.0, "unit": 1.0}
    totals = {tier: sum(_COST[t] for t in tiers if t == tier) for tier in spread}
    done = dict.fromkeys(spread, 0.0)
    keys = []
    for tier in tiers:
        keys.append(spread[tier] * (done[tier] + _COST[tier] / 2) / totals[tier])
        done[tier] += _COST[tier]
    order = sorted(range(len(items)), key=keys.__getitem__)  # stable: ties keep their order
    return [items[i] for i in order]


def _check_grouped(item: pytest.Item) -> None:
    """Fail a grouped test that pytest-xdist did not group: dealt to several workers, a group's
    tests build its module-scoped fixture (a launch of a minute) once per worker, and again
    after every other module's test in between; the Ray tests would start two clusters at
    once."""
    if not item.config.getoption("loadgroup", False):  # set on xdist's workers only
        return
    names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
    if names and not item.nodeid.endswith("@" + "_".join(names)):
        pytest.fail(
            f"pytest-xdist did not group this test (xdist_group {names}): this pytest and "
            "pytest-xdist do not work together with --dist loadgroup "
            "(pytest-dev/pytest-xdist#1386); install the versions pyproject.toml names",
            pytrace=False,
        )


def _uses_a_server(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    if _SERVER_FIXTURES & fixtures:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(_SERVER_PARAMS.get(name) == value for name, value in params.items())


def _group_by_module_fixture(item: pytest.Item) -> None:
    """Tests that share a module-scoped fixture (a checkpoint saved by a launch, a built site)
    run on one worker (``--dist loadgroup``), which builds it once; the others are dealt one
    by one to whichever worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None or item.get_closest_marker("xdist_group"):
        return
    shared = sorted(
        name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope == "module"
    )
    if shared:
        item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{shared[0]}"))


def _refuse(what: str, nodeid: str) -> Callable[..., NoReturn]:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise TierError(
            f"{nodeid} {what} but is in the unit tier: mark it "
            "@pytest.mark.processes (or long, if it takes a minute or more); see tests/support/tiers.py"
        )

    return refuse


@contextlib.contextmanager
def _no_process(item: pytest.Item) -> Iterator[None]:
    """While a unit-tier test is set up, runs and is torn down (module-scoped fixtures it
    builds included), every way to start a process raises :class:`TierError`."""
    if any(item.get_closest_marker(name) for name in MARKERS):
        yield
        return
    nodeid = item.nodeid
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse("starts a subprocess", nodeid))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            patch.setattr(os, name, _refuse(f"starts a process (os.{name})", nodeid))
        patch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("spawns a process", nodeid))
        patch.setattr(
            multiprocessing.process.BaseProcess, "start", _refuse("starts a process", nodeid)
        )
        yield


def _unit_phase(item: pytest.Item) -> Iterator[None]:
    with _no_process(item):
        return (yield)


# The call and the teardown; the set-up (module-scoped fixtures built for the test included)
# first checks that the test's group was kept.
pytest_runtest_call = pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(_unit_phase)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _check_grouped(item)
    with _no_process(item):
        return (yield)
