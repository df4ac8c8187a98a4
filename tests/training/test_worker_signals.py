"""The signals tracked loaders' workers ignore: published by preemption, read by workers."""

from __future__ import annotations

import ast
import pickle
import signal
from pathlib import Path

import ddpckpt._training
from ddpckpt._training import worker_signals
from ddpckpt._training.worker_signals import IgnoringPreemptionSignals


def test_published_signals_are_the_union_of_the_live_watches() -> None:
    assert worker_signals.watched_signals() == frozenset()
    worker_signals.publish(1001, [signal.SIGTERM, signal.SIGUSR1])
    worker_signals.publish(1002, [signal.SIGUSR2])
    try:
        assert worker_signals.watched_signals() == {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
        worker_signals.withdraw(1001)
        assert worker_signals.watched_signals() == {signal.SIGUSR2}
    finally:
        worker_signals.withdraw(1001)  # twice: a no-op
        worker_signals.withdraw(1002)
    assert worker_signals.watched_signals() == frozenset()


_called: list[int] = []


def _users_init(worker_id: int) -> None:  # pickled by name, as a spawn worker gets it
    _called.append(worker_id)


def test_the_worker_init_ignores_the_signals_then_calls_the_users_init() -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    worker_signals.publish(1003, [signal.SIGUSR2])
    try:
        spawned = pickle.loads(pickle.dumps(IgnoringPreemptionSignals(_users_init)))
        worker_signals.withdraw(1003)  # the pickled copy keeps what was watched at start
        spawned(4)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN and _called == [4]
    finally:
        worker_signals.withdraw(1003)
        signal.signal(signal.SIGUSR2, previous)


def test_training_imports_nothing_from_run() -> None:
    """The loader's workers learn the signals from here; training never reaches up to run."""
    package = Path(ddpckpt._training.__file__).parent
    upward = []
    for module in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            upward += [f"{module.name}: {n}" for n in names if n.startswith("ddpckpt._run")]
    assert upward == []
