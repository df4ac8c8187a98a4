"""The Checkpointer's options: flat keyword arguments in, typed groups out, checked once."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import signal

import pytest
import torch

from conftest import make_mlp
from ddpckpt import Checkpointer, FastTier, Preemption
from ddpckpt._run.options import Arguments, auto_directory, resolve
from ddpckpt.policies import EverySteps, KeepAll, KeepAnyOf, KeepBest, KeepLast, Never


def test_flat_arguments_land_in_their_groups(tmp_path) -> None:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(
        tmp_path / "run",
        model=model,
        optimizer=optimizer,
        every_steps=5,
        keep_last=2,
        keep_best=1,
        monitor="loss",
        mode="max",
        on_error="raise",
        retries=4,
        retry_backoff=0.5,
        async_save="overlap",
        sharing="shared",
        timeout=30.0,
        lock_stale_after=60.0,
    )
    options = ckpt.options
    assert options.schedule.policy == EverySteps(5) and options.schedule.preemption is None
    assert isinstance(options.keeping.retention, KeepAnyOf) and options.keeping.mode == "max"
    assert (options.failures.on_error, options.failures.retries) == ("raise", 4)
    assert options.failures.retry_backoff == 0.5
    assert options.asynchronous.enabled and options.asynchronous.overlap
    assert options.storage.sharing == "shared" and options.storage.timeout == 30.0
    assert options.storage.lock_stale_after == 60.0 and not options.storage.read_only
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.keeping = options.keeping  # read-only
    ckpt.close()


def test_the_checkpointers_option_keywords_are_exactly_the_arguments_record() -> None:
    """One list of the option keywords and their defaults: ``Arguments``. Beside them the
    Checkpointer takes only where it saves, what it saves (the state or its shorthand),
    how to reach the storage, and a deprecated spelling."""
    own = {"directory", "state", "model", "optimizer", "scheduler", "scaler", "extra"}
    own |= {"rng", "storage_options", "storage"}
    parameters = inspect.signature(Checkpointer).parameters
    keywords = {n: p.default for n, p in parameters.items() if n not in own}
    assert keywords == {f.name: f.default for f in dataclasses.fields(Arguments)}
    assert all(parameters[n].kind is inspect.Parameter.KEYWORD_ONLY for n in keywords)


def test_defaults_and_policy_objects_are_kept() -> None:
    defaults = resolve()
    assert isinstance(defaults.schedule.policy, Never)
    assert defaults.keeping.retention == KeepLast(3) and defaults.keeping.mode == "min"
    assert not defaults.asynchronous.enabled and defaults.failures.on_error == "warn"
    policy, retention = EverySteps(7), KeepBest(2, "loss", "min")
    given = resolve(
        Arguments(save_policy=policy, retention=retention, keep_last=None, preemption=True)
    )
    assert given.schedule.policy is policy and given.keeping.retention is retention
    assert given.schedule.preemption == Preemption()
    assert resolve(Arguments(keep_last=None)).keeping.retention == KeepAll()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"on_error": "ignore"}, "on_error"),
        ({"retries": -1}, "retries"),
        ({"retries": 1.5}, "retries"),
        ({"retry_backoff": -1}, "retry_backoff"),
        ({"mode": "lowest"}, "mode"),
        ({"monitor": "loss"}, "monitor= only matters with keep_best"),
        ({"keep_best": 2}, "keep_best needs monitor"),
        ({"async_save": "yes"}, "async_save"),
        ({"async_save": "overlap"}, "needs optimizer"),
        ({"read_only": True, "preemption": True}, "read_only"),
        ({"preemption": Preemption(signals=[signal.SIGKILL])}, "SIGKILL cannot be caught"),
        ({"preemption": Preemption(grace_seconds=0)}, "positive"),
        ({"sharing": "nfs"}, "sharing must be one of"),
        ({"timeout": -1}, "timeout must be a positive"),
        ({"timeout": "30"}, "timeout must be a positive"),
        ({"lock_stale_after": 0}, "lock_stale_after must be a positive"),
        ({"lock_stale_after": "600"}, "lock_stale_after must be a positive"),
        ({"every_seconds": "60"}, "every_seconds must be a positive"),
        ({"retry_backoff": "1"}, "retry_backoff must be a non-negative"),
        ({"save_policy": EverySteps(3), "every_steps": 5}, "save_policy= replaces every_steps="),
        ({"retention": KeepAll(), "keep_best": 1, "monitor": "loss"}, "replaces keep_best="),
        ({"fast_tier": "s3://bucket/fast"}, "fast_tier must be a directory on each node"),
        ({"fast_tier": "/dev/shm/job", "read_only": True}, "a read_only Checkpointer cannot"),
        ({"fast_tier": FastTier("/dev/shm/job", every_steps=0)}, "every_steps"),
        ({"fast_tier": FastTier("/dev/shm/job", keep=1.5)}, "keep"),
        ({"fast_tier": FastTier("/dev/shm/job", overlap="no")}, "overlap"),
    ],
)
def test_bad_options_are_refused_before_anything_is_touched(
    tmp_path, arguments: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path / "run", model=make_mlp(), **arguments)
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # no handler left installed


@pytest.mark.parametrize(("name", "value"), [("save_policy", 5), ("retention", "all")])
def test_policies_of_the_wrong_type_are_refused_before_the_first_save(tmp_path, name, value):
    with pytest.raises(TypeError, match=f"{name} must be a ddpckpt.policies"):
        Checkpointer(tmp_path / "run", model=make_mlp(), **{name: value})


@pytest.mark.parametrize("inside", ["run/fast", "."])
def test_a_fast_tier_holding_or_held_by_the_run_directory_is_refused(tmp_path, inside) -> None:
    with pytest.raises(ValueError, match="must not hold one another"):
        Checkpointer(tmp_path / "run", model=make_mlp(), fast_tier=tmp_path / inside)
    with pytest.raises(TypeError, match="fast_tier must be a directory, 'auto' or a ddpckpt"):
        Checkpointer(tmp_path / "run", model=make_mlp(), fast_tier=5)
    assert not (tmp_path / "run").exists()


def test_a_fast_tier_nesting_with_the_run_directory_through_a_link_is_refused(tmp_path) -> None:
    """The nesting check compared absolute paths: a fast tier under a link to the run
    directory, or a run directory reached through a link to the fast tier, passed."""
    (tmp_path / "run").mkdir()
    (tmp_path / "to-run").symlink_to(tmp_path / "run")
    (tmp_path / "fast").mkdir()
    (tmp_path / "to-fast").symlink_to(tmp_path / "fast")
    for run, fast in (("run", "to-run/fast"), ("to-fast/run", "fast"), ("to-run", "run")):
        with pytest.raises(ValueError, match="symbolic links resolved"):
            Checkpointer(tmp_path / run, model=make_mlp(), fast_tier=tmp_path / fast)
    assert os.listdir(tmp_path / "run") == [] and os.listdir(tmp_path / "fast") == []


def test_fast_tier_overlap_is_an_option_true_by_default() -> None:
    assert FastTier("/dev/shm/job").overlap is True
    assert FastTier("/dev/shm/job", overlap=False).overlap is False


def test_an_auto_fast_tier_is_named_by_the_run_directory_and_the_user(tmp_path) -> None:
    """``fast_tier="auto"``: one directory under /dev/shm per user and run directory, the
    same for every Checkpointer (every launch) of that run directory, named once set up."""
    assert FastTier.of("auto") == FastTier() and FastTier().directory is None
    model = make_mlp()
    named: list[str] = []
    try:
        for run in ("a", "a", "b"):
            with Checkpointer(tmp_path / run, model=model, fast_tier="auto") as ckpt:
                assert ckpt.fast_tier_directory is None  # not named before the set-up
                ckpt.resume()
                named.append(str(ckpt.fast_tier_directory))
        identity = (tmp_path / "a" / "fast-tier-owner").read_text()
        assert named[0] == named[1] == auto_directory(identity) != named[2], named
        assert all(n.startswith(f"/dev/shm/ddpckpt-{os.getuid()}-") for n in named), named
        assert os.stat(named[0]).st_mode & 0o777 == 0o700
    finally:
        for directory in set(named):
            shutil.rmtree(directory, ignore_errors=True)
    assert auto_directory(identity, uid=1000) != auto_directory(identity, uid=1001)
    assert auto_directory(identity, uid=1000).startswith("/dev/shm/ddpckpt-1000-")
