"""The preemption signals: options, the grace period, handlers that chain and come off."""

from __future__ import annotations

import signal

import pytest

from ddpckpt._run.signals import Preemption, SignalHandlers, grace_period, signal_name


@pytest.fixture
def sigusr2():
    """SIGUSR2 as the test found it, restored afterwards."""
    before = signal.getsignal(signal.SIGUSR2)
    yield signal.SIGUSR2
    signal.signal(signal.SIGUSR2, before)


def test_preemption_options() -> None:
    assert Preemption.of(False) is None and Preemption.of(None) is None
    assert Preemption.of(True) == Preemption()
    custom = Preemption(signals=["SIGUSR2", int(signal.SIGTERM)], grace_seconds=5)
    assert Preemption.of(custom) is custom
    assert custom.signal_numbers() == [signal.SIGUSR2, signal.SIGTERM]
    with pytest.raises(TypeError, match="preemption must be"):
        Preemption.of("yes")
    with pytest.raises(ValueError, match="SIGSTOP cannot be caught"):
        Preemption(signals=["SIGSTOP"]).signal_numbers()
    assert signal_name(signal.SIGTERM) == "SIGTERM" and signal_name(999) == "signal 999"


def test_handlers_record_chain_and_put_back_what_was_there(sigusr2) -> None:
    seen: list[tuple[str, int]] = []
    app = lambda signum, frame: seen.append(("app", signum))  # noqa: E731
    signal.signal(sigusr2, app)
    first = SignalHandlers([sigusr2], lambda signum: seen.append(("first", signum)))
    second = SignalHandlers([sigusr2], lambda signum: seen.append(("second", signum)))
    assert first.installed and second.installed
    signal.raise_signal(sigusr2)
    assert seen == [("second", sigusr2), ("first", sigusr2), ("app", sigusr2)]
    first.remove()  # not on top: stays chained, records nothing more
    seen.clear()
    signal.raise_signal(sigusr2)
    assert seen == [("second", sigusr2), ("app", sigusr2)]
    assert second.remove()[sigusr2] is app  # the removed one in between is skipped


def test_grace_period_comes_from_the_argument_then_the_environment(monkeypatch) -> None:
    for name in ("DDPCKPT_GRACE_SECONDS", "TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert grace_period()[0] == 30.0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    assert grace_period() == (90.0, "torchrun's shutdown timeout")
    monkeypatch.setenv("DDPCKPT_GRACE_SECONDS", "12.5")
    assert grace_period() == (12.5, "DDPCKPT_GRACE_SECONDS")
    assert grace_period(4) == (4.0, "grace_seconds")
    monkeypatch.setenv("DDPCKPT_GRACE_SECONDS", "soon")
    with pytest.raises(ValueError, match="DDPCKPT_GRACE_SECONDS"):
        grace_period()
