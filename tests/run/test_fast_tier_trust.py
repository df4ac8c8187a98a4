"""The fast tier's ownership and trust model (issue 41, "never torn, never someone else's").

A fast tier is a directory in a tmpfs other users share (``/dev/shm``) at a predictable
path, next to directories of other runs: one pre-created by another user (or made writable
to them, or a symbolic link) is refused, never read or written; one that is no fast tier
(another run's durable directory, a typo) is refused, never deleted; a damaged marker or
run identity is reported, never a crash; and none of this ever stops training or a resume
from the durable tier. The other user is played by ``setpriv`` (CI runs as root).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ddpckpt
from conftest import make_mlp, train_steps
from ddpckpt._format.runfiles import FAST_TIER_MARKER, RUN_DIR_IDENTITY
from launch import WORKER, torchrun_restarting_nodes

FAST = WORKER.with_name("fast_worker.py")
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
needs_other_user = pytest.mark.skipif(
    SETPRIV is None or os.geteuid() != 0,
    reason="playing another user needs setpriv and root (CI runs as root)",
)


def as_other_user(*command: str) -> None:
    """Run ``command`` as uid/gid 65534 (nobody), with no supplementary groups."""
    assert SETPRIV is not None
    subprocess.run(
        [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        check=True,
        timeout=60,
        capture_output=True,
    )


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may create in, sticky like /dev/shm (tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ddpckpt-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def checkpointer(run: Path, fast: Path | ddpckpt.FastTier, model, opt) -> ddpckpt.Checkpointer:
    return ddpckpt.Checkpointer(run, model=model, optimizer=opt, every_steps=4, fast_tier=fast)


def durable_run(run: Path, step: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A run directory whose durable tier holds ``step`` (saved without a fast tier)."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with ddpckpt.Checkpointer(run, model=model, optimizer=opt, every_steps=step) as ckpt:
        train_steps(model, opt, 1)
        ckpt.save(step)
    return model, opt


def listing(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``path`` (itself included) with its mode, owner and size."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in [".", *dirs, *files]:
            full = os.path.join(root, name)
            info = os.lstat(full)
            found[os.path.relpath(full, path)] = (info.st_mode, info.st_uid, info.st_size)
    return found


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def resume_and_save(run: Path, fast, caplog, saved: int = 4) -> tuple[int | None, str | None]:
    """A job with ``fast`` as its fast tier, resumed from a durable step ``saved``: what it
    resumed from, and what its next fast save returned (never raised)."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with checkpointer(run, fast, model, opt) as ckpt:
        info = ckpt.resume()
        step = saved + 1
        train_steps(model, opt, 1)
        assert ckpt.should_save(step)
        path = ckpt.save(step)  # the fast tier alone
        ckpt.wait()
    return (info.step if info else None), path


# ---------------------------------------------------------------- another user


@pytest.mark.processes
@needs_other_user
@pytest.mark.parametrize("mode", ["755", "700", "777"])
def test_a_fast_tier_another_user_made_is_refused_and_nothing_of_it_is_used(
    tmp_path, shared, caplog, mode
) -> None:
    """Another user pre-creates the job's predictable fast-tier path and plants a newer step
    with correct checksums: the job used to take the directory over (mode 0777) and resume
    from the planted step. Now the directory is refused (an ERROR naming its owner), the
    job resumes from the durable tier, its fast saves fail with an ERROR and training goes
    on, and nothing is written there."""
    run, fast = tmp_path / "run", shared / "fast"
    durable_run(run)
    planted_source = shared / "planted"
    model = make_mlp(seed=9)
    ddpckpt.save(planted_source / "step-00000009", model=model)  # readable by others (0644)
    as_other_user("mkdir", "-m", mode, str(fast))
    as_other_user("cp", "-r", str(planted_source / "step-00000009"), str(fast))
    before = listing(fast) if mode != "700" else None
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    said = errors(caplog)
    assert any(
        f"the fast tier {fast} is refused" in m and "owned by nobody (uid 65534)" in m
        and "resume() goes on with the durable tier" in m
        for m in said
    ), said  # fmt: skip
    assert any("saving step 5 failed" in m and str(fast) in m for m in said), said
    if before is not None:
        assert listing(fast) == before  # nothing written there
    assert os.stat(fast).st_uid == NOBODY and stat.S_IMODE(os.stat(fast).st_mode) == int(mode, 8)


@pytest.mark.processes
@needs_other_user
def test_the_files_the_fast_tier_writes_are_the_users_alone(tmp_path, shared, caplog) -> None:
    """The fast tier's directory was created 0755 and its files 0644: any user of the node
    could read the job's weights. Now the directory is 0700 and every file 0600 (every
    directory 0700), and another user can read nothing of it; the durable tier keeps its
    modes."""
    run, fast = tmp_path / "run", shared / "fast"
    durable_run(run)
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path == str(fast / "step-00000005")
    assert not errors(caplog)
    found = listing(fast)
    assert "step-00000005/manifest.json" in found and FAST_TIER_MARKER in found
    for name, (mode, uid, _) in found.items():
        assert uid == os.geteuid(), name
        expected = 0o700 if stat.S_ISDIR(mode) else 0o600
        assert stat.S_IMODE(mode) == expected, (name, oct(mode))
    with pytest.raises(subprocess.CalledProcessError):
        as_other_user("cat", str(fast / "step-00000005" / "manifest.json"))
    with pytest.raises(subprocess.CalledProcessError):
        as_other_user("ls", str(fast))
    durable = os.stat(run / "step-00000004" / "manifest.json")
    assert stat.S_IMODE(durable.st_mode) == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("kind", ["group-writable", "world-writable"])
def test_a_fast_tier_others_may_write_in_is_refused(tmp_path, caplog, kind) -> None:
    """A directory of this user's that its group or other users may write in (where
    another user could plant a step) is refused; one others may only read is made 0700."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    durable_run(run)
    fast.mkdir()
    mode = 0o770 if kind == "group-writable" else 0o777
    fast.chmod(mode)
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    assert any(f"may write in it (mode {mode:04o})" in m for m in errors(caplog)), errors(caplog)
    assert os.listdir(fast) == [] and stat.S_IMODE(os.stat(fast).st_mode) == mode

    fast.chmod(0o755)
    caplog.clear()
    resumed, path = resume_and_save(run, fast, caplog)
    assert (resumed, path) == (4, str(fast / "step-00000005")), errors(caplog)
    assert stat.S_IMODE(os.stat(fast).st_mode) == 0o700


def test_a_fast_tier_that_is_a_symbolic_link_is_refused_and_nothing_is_written_through_it(
    tmp_path, caplog
) -> None:
    """A fast tier path that is a symbolic link (to a directory another user controls, or
    to a run directory) was followed: now refused, nothing written through it."""
    run, target, fast = tmp_path / "run", tmp_path / "target", tmp_path / "fast"
    durable_run(run)
    target.mkdir(mode=0o700)
    fast.symlink_to(target)
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    assert any("is a symbolic link" in m and "never followed" in m for m in errors(caplog)), errors(
        caplog
    )
    assert os.listdir(target) == [] and fast.is_symlink()


def test_a_fast_tier_through_a_symbolic_link_to_the_run_directory_is_refused_at_once(
    tmp_path,
) -> None:
    """The nesting check compared absolute paths: a link to the run directory passed."""
    run = tmp_path / "run"
    durable_run(run)
    (tmp_path / "link").symlink_to(run)
    for fast in (tmp_path / "link", tmp_path / "link" / "fast"):
        with pytest.raises(ValueError, match="symbolic links resolved"):
            ddpckpt.Checkpointer(run, model=make_mlp(), fast_tier=fast)
    assert sorted(os.listdir(run)) == ["latest", "run.json", "step-00000004"]


# ---------------------------------------------------------------- not a fast tier


def test_a_fast_tier_pointed_at_another_runs_directory_deletes_nothing(tmp_path, caplog) -> None:
    """fast_tier= naming another run's durable directory (swapped paths, a typo) used to
    delete all its checkpoints with a WARNING at the first resume(). Now refused: every
    file is still there, and this job resumes from its own durable tier."""
    run, other = tmp_path / "run", tmp_path / "other"
    durable_run(run)
    durable_run(other, step=8)
    before = listing(other)
    resumed, path = resume_and_save(run, other, caplog)
    assert resumed == 4 and path is None
    assert any(
        "is no fast tier" in m and "checkpoints of a run" in m and "step-00000008" in m
        for m in errors(caplog)
    ), errors(caplog)
    after = listing(other)
    assert {k: v for k, v in after.items() if k != "."} == {
        k: v for k, v in before.items() if k != "."
    }
    assert ddpckpt.latest(other) == str(other / "step-00000008")


def test_a_fast_tier_pointed_at_a_run_directory_with_a_fast_tier_deletes_nothing(
    tmp_path, caplog
) -> None:
    """A run directory that has a fast tier holds its identity file: refused, whatever else
    it holds (the same for a directory that holds only that file)."""
    run, other = tmp_path / "run", tmp_path / "other"
    durable_run(run)
    other.mkdir()
    (other / RUN_DIR_IDENTITY).write_text(f"{other}#0123456789abcdef0123456789abcdef")
    resumed, path = resume_and_save(run, other, caplog)
    assert resumed == 4 and path is None
    assert any("is a durable run directory" in m for m in errors(caplog)), errors(caplog)
    assert os.listdir(other) == [RUN_DIR_IDENTITY]


def test_a_fast_tier_pointed_at_other_files_deletes_nothing(tmp_path, caplog) -> None:
    """A directory of other files (a home directory, a typo) is no fast tier: refused."""
    run, other = tmp_path / "run", tmp_path / "notes"
    durable_run(run)
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    (other / "step-5").mkdir()
    resumed, path = resume_and_save(run, other, caplog)
    assert resumed == 4 and path is None
    assert any("files of another program" in m for m in errors(caplog)), errors(caplog)
    assert sorted(os.listdir(other)) == ["step-5", "todo.txt"]


def test_another_runs_marked_fast_tier_is_still_taken_over_with_a_warning(tmp_path, caplog) -> None:
    """A valid marker naming another run (this run directory deleted and made again, or
    another job's tier) is the one case where steps are deleted: with a WARNING, as before."""
    first, second, fast = tmp_path / "first", tmp_path / "second", tmp_path / "fast"
    durable_run(first)
    resume_and_save(first, fast, caplog)
    durable_run(second)
    caplog.clear()
    resumed, path = resume_and_save(second, fast, caplog)
    assert (resumed, path) == (4, str(fast / "step-00000005"))
    assert "holds steps 5 of another run" in caplog.text
    assert not errors(caplog)
    marker = json.loads((fast / FAST_TIER_MARKER).read_text())
    assert marker["format"] == 1 and marker["kind"] == "ddpckpt-fast-tier"
    assert marker["run"] == (second / RUN_DIR_IDENTITY).read_text()


def test_a_fast_tier_the_previous_release_marked_is_read(tmp_path, caplog) -> None:
    """The previous release's marker holds the bare run identity: this run's is resumed
    from (and marked anew in format 1); another run's is refused, nothing deleted."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    durable_run(run)
    resume_and_save(run, fast, caplog)
    identity = (run / RUN_DIR_IDENTITY).read_text()
    (fast / FAST_TIER_MARKER).write_text(identity)
    caplog.clear()
    model = make_mlp()
    with checkpointer(run, fast, model, torch.optim.AdamW(model.parameters())) as ckpt:
        assert ckpt.resume().step == 5
    assert not errors(caplog)
    assert json.loads((fast / FAST_TIER_MARKER).read_text())["run"] == identity

    (fast / FAST_TIER_MARKER).write_text("/elsewhere/run#feedfacefeedfacefeedfacefeedface")
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    assert any("earlier release of ddpckpt for another run" in m for m in errors(caplog))
    assert (fast / "step-00000005").is_dir()


# ---------------------------------------------------------------- damaged files


def damage(path: Path, how: str) -> None:
    path.unlink(missing_ok=True)
    if how == "not-utf8":
        path.write_bytes(b"\xff\xfe")
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "sparse-8GiB":
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    elif how == "bad-json":
        path.write_text('{"format": 1, "kind": "ddpckpt-fast-tier", "run": 7}')
    elif how == "future-format":
        path.write_text('{"format": 2, "kind": "ddpckpt-fast-tier", "run": "x#y"}')


HOW = ["not-utf8", "fifo", "sparse-8GiB", "bad-json", "future-format"]


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_marker_is_an_error_and_training_goes_on(tmp_path, caplog, how) -> None:
    """A damaged marker raised UnicodeDecodeError (or NotRegularFileError, MemoryError) from
    resume() and from every save. Now: resume() resumes from the durable tier with an
    ERROR, fast saves fail with an ERROR, training goes on, and the fast tier's steps are
    not deleted."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    durable_run(run)
    resume_and_save(run, fast, caplog)
    damage(fast / FAST_TIER_MARKER, how)
    caplog.clear()
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    said = errors(caplog)
    assert any("its marker is damaged" in m and FAST_TIER_MARKER in m for m in said), said
    assert any("saving step 5 failed" in m for m in said), said
    assert (fast / "step-00000005" / "manifest.json").is_file()


def test_a_marker_damaged_while_the_job_runs_fails_its_fast_saves_only(tmp_path, caplog) -> None:
    """A job that did not resume sets the tier up at its first fast save: a damaged marker
    then used to raise out of save(). Now that save is an ERROR, the one after the next tries
    again and succeeds once the directory is usable."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    fast.mkdir(mode=0o700)
    damage(fast / FAST_TIER_MARKER, "not-utf8")
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with checkpointer(run, fast, model, opt) as ckpt:
        assert ckpt.should_save(1)
        assert ckpt.save(1) is None
        assert any("saving step 1 failed" in m for m in errors(caplog)), errors(caplog)
        (fast / FAST_TIER_MARKER).unlink()
        assert ckpt.should_save(2)
        assert ckpt.save(2) is None  # skipped: tried again at the fast save after the next
        assert ckpt.should_save(3)
        assert ckpt.save(3) == str(fast / "step-00000003")


@pytest.mark.parametrize("how", ["not-utf8", "fifo", "sparse-8GiB"])
def test_a_damaged_run_identity_is_an_error_and_the_run_goes_on(tmp_path, caplog, how) -> None:
    """The run directory's identity file (a copied run directory's, say) used to be read
    unbounded and decoded blindly. Now reported, never replaced: resume() resumes from the
    durable tier, fast saves fail with an ERROR saying what to do, training goes on."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    durable_run(run)
    damage(run / RUN_DIR_IDENTITY, how)
    resumed, path = resume_and_save(run, fast, caplog)
    assert resumed == 4 and path is None
    said = errors(caplog)
    assert any(RUN_DIR_IDENTITY in m and f"delete {run / RUN_DIR_IDENTITY}" in m for m in said), (
        said
    )
    assert any("saving step 5 failed" in m for m in said), said
    assert os.path.lexists(run / RUN_DIR_IDENTITY)


@pytest.mark.processes
def test_another_jobs_live_lock_on_the_fast_tier_never_stops_training(tmp_path, caplog) -> None:
    """Another live job holding the fast tier's lock raised CheckpointLockedError out of
    resume() and save(). Now an ERROR: resumed from the durable tier, training goes on."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    durable_run(run)
    resume_and_save(run, fast, caplog)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = {"host": platform.node(), "pid": holder.pid, "job": None, "since": time.time()}
        (fast / ".lock").write_text(json.dumps(lock))
        caplog.clear()
        resumed, path = resume_and_save(run, fast, caplog, saved=4)
    finally:
        holder.kill()
        holder.wait(30)
    assert resumed == 4 and path is None
    said = errors(caplog)
    assert any("in use by another job" in m for m in said), said
    assert (fast / "step-00000005").is_dir()


def test_fast_saves_without_overlap_stage_before_save_returns(tmp_path) -> None:
    """FastTier(overlap=False): the fast tier's saves use async_save=True staging."""
    fast = ddpckpt.FastTier(tmp_path / "fast", overlap=False)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with checkpointer(tmp_path / "run", fast, model, opt) as ckpt:
        assert ckpt._fast is not None
        assert ckpt._fast.saves.options.asynchronous.overlap is False
        assert ckpt.should_save(1)
        assert ckpt.save(1) == str(tmp_path / "fast" / "step-00000001")
    with checkpointer(tmp_path / "run2", tmp_path / "fast2", model, opt) as ckpt:
        assert ckpt._fast is not None and ckpt._fast.saves.options.asynchronous.overlap


# ---------------------------------------------------------------- several ranks


@pytest.mark.long
def test_one_nodes_damaged_marker_is_an_error_on_every_rank_and_training_goes_on(
    tmp_path,
) -> None:
    """2 nodes of 1 rank: node 1's fast tier has a damaged marker (non-UTF-8 bytes). It was
    a RankFailureError from resume() on every rank. Now every rank resumes from the durable
    tier, the ERROR is printed once (by rank 0), fast saves fail with an ERROR, and the job
    trains to its end; node 1's marker is left as it was."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        (node / "fast").mkdir(parents=True, mode=0o700)
    (nodes[1] / "fast" / FAST_TIER_MARKER).write_bytes(b"\xff\xfe")
    out = tmp_path / "out"
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "3"]
    torchrun_restarting_nodes(
        FAST, "trust", out, cwds=nodes, nproc=1, args=args, max_restarts=0
    ).ok()
    for rank in (0, 1):
        seen = json.loads((out / f"trust-rank{rank}.json").read_text())
        assert seen["resumed"] is None and seen["step"] == 3, seen
        assert seen["saved"] == [None, None, None], seen
    said = json.loads((out / "trust-rank0.json").read_text())["messages"]
    assert any(m.startswith("ERROR") and "its marker is damaged" in m for m in said), said
    assert any(m.startswith("ERROR") and "saving step 3 failed" in m for m in said), said
    assert (nodes[1] / "fast" / FAST_TIER_MARKER).read_bytes() == b"\xff\xfe"
    assert not list((nodes[0] / "fast").glob("step-*"))


def test_a_refused_fast_tier_is_tried_again_ever_more_rarely(tmp_path, caplog) -> None:
    """A tier refused for good (here: others may write in it) would print an ERROR at every
    step: after n set-ups failed in a row, the next 2**n - 1 fast saves are skipped, as the
    WARNING says, and the durable tier saves as scheduled."""
    run, fast = tmp_path / "run", tmp_path / "fast"
    fast.mkdir()
    fast.chmod(0o777)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.WARNING, logger="ddpckpt"), ddpckpt.Checkpointer(
        run, model=model, optimizer=opt, every_steps=4, fast_tier=fast
    ) as ckpt:  # fmt: skip
        ckpt.resume()
        caplog.clear()
        for step in range(1, 12):
            train_steps(model, opt, 1)
            if ckpt.should_save(step):
                ckpt.save(step)
    tried = [r.getMessage() for r in caplog.records if "saving step" in r.getMessage()]
    assert [m.split("saving step ")[1].split(" ")[0] for m in tried] == ["1", "3", "7"]
    assert "tried again at the fast save after the next 7" in caplog.text
    assert ckpt.steps() == [4, 8] and os.listdir(fast) == []
