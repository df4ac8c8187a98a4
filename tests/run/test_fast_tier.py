"""The fast tier under torchrun: workers killed and restarted resume from host memory, from
a peer node, or from the durable tier, bit-identical to a run that never stopped; a full
fast tier never stops training; a job restarted with fewer ranks is told so.

Each launch (torchrun --max-restarts on each node) plays several scenarios in turn, so that
the suite pays for the processes' start-up once per restart only.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import ddpckpt
import ddpckpt._io.writing as writing
import ddpckpt._run.checkpointer as checkpointer
from conftest import make_mlp, train_steps
from ddpckpt._format.manifest import read_manifest
from ddpckpt._io.staging import StagingPool
from ddpckpt.storage._location import locate
from launch import _BIN, WORKER, _env, _finish, _start, torchrun_restarting_nodes
from snippets import ROOT, RUNNABLE

pytestmark = pytest.mark.processes
FAST = WORKER.with_name("fast_worker.py")


def resumes(out: Path) -> dict[int, dict[int, dict]]:
    """What each resume restored, by the step it resumed from and by rank."""
    found: dict[int, dict[int, dict]] = {}
    for path in out.glob("resumed-*-rank*.json"):
        step, rank = (int(part) for part in path.stem.removeprefix("resumed-").split("-rank"))
        found.setdefault(step, {})[rank] = json.loads(path.read_text())
    return found


def losses(out: Path, rank: int) -> dict[str, float]:
    by_step: dict[str, float] = {}
    for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = str(record["step"])
        assert by_step.setdefault(step, record["loss"]) == record["loss"], record  # redone: same
    return by_step


def test_restarts_resume_from_memory_or_a_peer_and_lose_at_most_one_step(tmp_path) -> None:
    """4 ranks on 2 nodes, a fast-tier save every step, a durable one every 4 steps:

    * a worker SIGKILLed inside step 7: every rank resumes from its node's memory at step 6,
      the last step completed (the durable tier's newest is 4);
    * node 1 replaced inside step 11 (its fast tier deleted, a worker killed): node 1
      receives step 10 from node 0 and every rank resumes there;
    * both nodes' fast tiers lost inside step 15: the durable tier serves step 12, and a
      warning says why;
    * node 1's fast tier full for the saves of steps 17 and 18: reported, training goes on;

    and the run ends bit-identical to the same job run without a restart (every rank's loss
    at every step, model, optimizer and RNG state)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    out = tmp_path / "out"
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "20", "--crash", "7",
            "--replace", "11", "--lose-both", "15", "--full", "17,18"]  # fmt: skip
    torchrun_restarting_nodes(FAST, "train", out, cwds=nodes, args=args).ok()
    found = resumes(out)
    assert sorted(found) == [0, 6, 10, 12], sorted(found)
    for step in (6, 10):
        for rank, seen in found[step].items():
            assert seen["path"] == f"fast/step-{step:08d}", (step, rank, seen)
    repaired = [
        r
        for r, seen in found[10].items()
        if any("this node had no copy" in m for m in seen["messages"])
    ]
    assert repaired and all(found[10][r]["node"] == 1 for r in repaired), found[10]
    for seen in found[12].values():
        assert seen["path"] == str(tmp_path / "run" / "step-00000012"), seen
    said = [m for seen in found[12].values() for m in seen["messages"]]
    assert any("holds no checkpoint on any node" in m and "step 12" in m for m in said), said
    for rank in range(4):
        final = json.loads((out / f"final-rank{rank}.json").read_text())
        assert final["step"] == 20
        assert losses(out, rank) == final["reference"]["losses"], rank
        assert final["digest"] == final["reference"]["digest"], rank
    errors = [
        m
        for r in range(4)
        for m in json.loads((out / f"final-rank{r}.json").read_text())["messages"]
        if m.startswith("ERROR")
    ]
    for step in (17, 18):
        assert any(
            f"saving step {step} failed" in m and "fast tier" in m and "No space left" in m
            for m in errors
        ), errors
    for node in nodes:
        assert sorted(p.name for p in (node / "fast").glob("step-*")) == ["step-00000020"]


def test_with_one_partner_three_nodes_keep_two_nodes_files_and_survive_one_lost(tmp_path):
    """3 nodes of one rank, ``FastTier(partners=1)``: each node keeps its own rank's file and
    its predecessor's, not all three; a fast save every step, a durable one every 4:

    * a worker SIGKILLed inside step 3: every rank resumes from memory at step 2 (whichever
      node torchrun's rendezvous puts each rank on: a node lacking a rank's file receives a
      copy that keeps it);
    * node 1 replaced inside step 6: it receives step 5 from the node after it, which keeps
      node 1's file, and every rank resumes there;
    * nodes 1 and 2 lost inside step 10: node 1's file was kept by them alone, so no node
      can restore step 9 on every rank: said, and the durable tier serves step 8;

    and the run ends bit-identical to the same job run without a restart."""
    nodes = [tmp_path / f"node{n}" for n in range(3)]
    for node in nodes:
        node.mkdir()
    out = tmp_path / "out"
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "12", "--crash", "3",
            "--replace", "6", "--lose-nodes", "10", "--lost", "1,2", "--partners", "1",
            "--table-ranks", "1"]  # fmt: skip
    torchrun_restarting_nodes(FAST, "train", out, cwds=nodes, nproc=1, args=args).ok()
    found = resumes(out)
    assert sorted(found) == [0, 2, 5, 8], sorted(found)
    for step in (2, 5):
        for rank, seen in found[step].items():
            assert seen["path"] == f"fast/step-{step:08d}", (step, rank, seen)
    said = [m for seen in found[8].values() for m in seen["messages"]]
    assert any("keeps the own files" in m and "FastTier(partners=...)" in m for m in said), said
    for rank in range(3):
        final = json.loads((out / f"final-rank{rank}.json").read_text())
        assert final["step"] == 12
        assert losses(out, rank) == final["reference"]["losses"], rank
        assert final["digest"] == final["reference"]["digest"], rank
    for node in range(3):
        assert len(json.loads((out / f"kept-node{node}.json").read_text())) == 2, node
    # every copy listed its files in one table per rank (format 7), as jobs of more than
    # TABLE_RANKS ranks do: the repair sent the tables first, then the files they list
    # (a node's copy: the two ranks' whose files it keeps)
    durable = read_manifest(locate(str(tmp_path / "run" / "step-00000012")))
    assert sorted(durable.files.tables) == [f"files-0000{g}.json" for g in range(3)]
    for node in nodes:
        assert len(read_manifest(locate(str(node / "fast" / "step-00000012"))).files.tables) == 2, (
            node
        )


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    os.environ.get("DDPCKPT_SCALE_TEST") != "1",
    reason="32 processes, about 5 minutes on 2 cores: `make test-scale` (DDPCKPT_SCALE_TEST=1)",
)
def test_thirty_two_ranks_on_two_nodes_resume_from_memory_and_from_a_peer(tmp_path) -> None:
    """The protocol with more processes than the other tests: 2 simulated nodes of 16 ranks,
    a fast save every step; a worker SIGKILLed inside step 3 (every rank resumes from its
    node's memory at step 2), then node 1 replaced inside step 6 (its 16 ranks receive step
    5 from node 0); the run ends bit-identical to the same job run without a restart."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    out = tmp_path / "out"
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "7", "--crash", "3",
            "--replace", "6"]  # fmt: skip
    torchrun_restarting_nodes(FAST, "train", out, cwds=nodes, nproc=16, args=args,
                              timeout=900).ok()  # fmt: skip
    found = resumes(out)
    assert sorted(found) == [0, 2, 5], sorted(found)
    for step in (2, 5):
        assert sorted(found[step]) == list(range(32)), (step, sorted(found[step]))
        for rank, seen in found[step].items():
            assert seen["path"] == f"fast/step-{step:08d}", (step, rank, seen)
    repaired = [r for r, seen in found[5].items()
                if any("this node had no copy" in m for m in seen["messages"])]  # fmt: skip
    assert repaired and all(found[5][r]["node"] == 1 for r in repaired), found[5]
    for rank in range(32):
        final = json.loads((out / f"final-rank{rank}.json").read_text())
        assert final["step"] == 7
        assert losses(out, rank) == final["reference"]["losses"], rank
        assert final["digest"] == final["reference"]["digest"], rank


def guide_launch(script: Path, out: Path, **env: str) -> subprocess.Popen[str]:
    """Start the fast-tier guide's script with the guide's launch command (its ``bash``
    block), through fast_guide.py, in the script's directory."""
    page = (ROOT / "docs" / "guides" / "fast-tier.md").read_text()
    (line,) = [ln for ln in page.splitlines() if " torchrun " in ln and ln.endswith("train.py")]
    words = shlex.split(line)
    settings = dict(w.split("=", 1) for w in words[: words.index("torchrun")])
    launcher = words[words.index("torchrun") + 1 : -1]
    cmd = [str(_BIN / "torchrun"), *launcher, "--monitor-interval=0.2",
           str(FAST.with_name("fast_guide.py")), str(out), str(script)]  # fmt: skip
    return _start(cmd, _env({**settings, **env}), script.parent)


@pytest.mark.long
def test_the_guides_script_relaunched_after_a_crash_resumes_from_memory(tmp_path) -> None:
    """The guide's script and launch command, the whole job killed once the fast tier held
    step 25 (the durable tier: step 20), then launched again the same way: the new launch
    resumes from the fast tier's step 25, ends with the durable tier at step 29 and frees
    the memory. The guide named the tier by TORCHELASTIC_RUN_ID, new at every launch: the
    relaunch resumed from the durable tier's step 20."""
    (snippet,) = [s for s in RUNNABLE if s.page == "docs/guides/fast-tier.md"]
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(snippet.code)
    out.mkdir()
    job = guide_launch(script, out, FAST_GUIDE_STOP_AT="25")
    fast: set[str] = set()
    try:
        stopped = [out / f"stopped-rank{r}" for r in (0, 1)]
        deadline = time.monotonic() + 180
        while not all(p.exists() for p in stopped) and job.poll() is None:
            assert time.monotonic() < deadline, "the first launch did not reach step 25"
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGKILL)  # torchrun, then its workers (sessions of their own)
        for path in stopped:
            if path.exists():
                os.kill(int(path.read_text()), signal.SIGKILL)
        output = job.communicate()[0]
        assert all(p.exists() for p in stopped), output[-6000:]
        first = [json.loads((out / f"resumed-rank{r}.jsonl").read_text()) for r in (0, 1)]
        fast = {seen["fast"] for seen in first}
        ((code, output),) = _finish([guide_launch(script, out)], timeout=180)
        assert code == 0, output[-6000:]
        seen = [
            json.loads(ln)
            for r in (0, 1)
            for ln in (out / f"resumed-rank{r}.jsonl").read_text().splitlines()
        ]
        fast |= {s["fast"] for s in seen}
        (directory,) = fast
        assert directory.startswith(f"/dev/shm/ddpckpt-{os.getuid()}-"), fast
        relaunched = [s for s in seen if s["step"] is not None]
        assert [s["path"] for s in relaunched] == [f"{directory}/step-00000025"] * 2, seen
        durable = sorted(p.name for p in (tmp_path / "runs" / "exp2").glob("step-*"))
        assert durable[-1] == "step-00000029", durable  # the final save, before the memory went
        assert not os.path.exists(directory)  # freed by the job that ended
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        for directory in fast:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)


def test_one_node_resumes_from_memory_then_with_fewer_ranks_says_so(tmp_path) -> None:
    """2 ranks on one node: a worker SIGKILLed inside step 7 resumes at step 6 from the fast
    tier (the durable tier holds step 4), bit-identical to the uninterrupted run. The run
    ends at step 10, a fast-tier step. Started again on 1 rank, it resumes from the fast
    tier's step 10 (newer than the durable step 8) with a warning that the checkpoint was
    saved by 2 ranks, and one that rank 1's own state is not restored."""
    node = tmp_path / "node0"
    node.mkdir()
    out = tmp_path / "out"
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "10", "--crash", "7"]
    torchrun_restarting_nodes(FAST, "train", out, cwds=[node], args=args, max_restarts=1).ok()
    found = resumes(out)
    assert sorted(found) == [0, 6], sorted(found)
    assert [found[6][r]["path"] for r in (0, 1)] == ["fast/step-00000006"] * 2
    for rank in (0, 1):
        final = json.loads((out / f"final-rank{rank}.json").read_text())
        assert final["step"] == 10
        assert losses(out, rank) == final["reference"]["losses"], rank
        assert final["digest"] == final["reference"]["digest"], rank
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*"))[-1] == "step-00000008"

    fewer = tmp_path / "fewer"
    args = [*args[:5], "12"]
    torchrun_restarting_nodes(FAST, "train", fewer, cwds=[node], nproc=1, args=args).ok()
    (seen,) = resumes(fewer)[10].values()
    assert seen["path"] == "fast/step-00000010", seen
    assert any("saved by 2 ranks and this job has 1" in m for m in seen["messages"]), seen
    said = [m for m in seen["messages"] if "saved with 2 ranks, resumed with 1" in m]
    assert len(said) == 1 and "what rank 1 stored of its own is not restored" in said[0], seen


def test_a_fast_tier_left_by_another_run_is_never_resumed_from(tmp_path, caplog) -> None:
    """One process: a run directory deleted and started again with the same fast-tier
    directory used to resume from the old run's step there, without a word."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(steps: range) -> int | None:
        with ddpckpt.Checkpointer(
            tmp_path / "run", model=model, optimizer=optimizer, every_steps=100,
            fast_tier=tmp_path / "fast",
        ) as ckpt:  # fmt: skip
            info = ckpt.resume()
            for step in steps:
                if ckpt.should_save(step):
                    ckpt.save(step)
        return info and info.step

    assert run(range(1, 4)) is None
    assert run(range(4, 6)) == 3  # its own fast tier
    shutil.rmtree(tmp_path / "run")
    assert run(range(1, 2)) is None
    assert "holds steps 5 of another run" in caplog.text
    assert run(range(2, 3)) == 1


def test_saves_without_resume_mark_the_fast_tier_so_a_restart_resumes_from_it(
    tmp_path, caplog
) -> None:
    """One process: a job that saves without calling resume() (it starts fresh, or loaded
    a checkpoint itself) used to leave its fast-tier steps unmarked, and the restarted
    job deleted them as another run's. Its first save marks the tier as this run's; this
    run's steps newer than it, and another run's, are deleted with a warning."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def checkpointer(run: str = "run") -> ddpckpt.Checkpointer:
        return ddpckpt.Checkpointer(
            tmp_path / run, model=model, optimizer=optimizer, every_steps=100,
            fast_tier=tmp_path / "fast",
        )  # fmt: skip

    def train(steps: range) -> None:
        with checkpointer() as ckpt:
            for step in steps:
                if ckpt.should_save(step):
                    ckpt.save(step)

    def resume() -> int | None:
        with checkpointer() as ckpt:
            info = ckpt.resume()
        return info and info.step

    train(range(1, 4))
    assert resume() == 3
    assert "another run" not in caplog.text

    train(range(1, 2))  # started over without resume(): step 3 would mix branches
    assert "held step(s) 3 of this run, newer than step 1" in caplog.text
    assert resume() == 1

    with checkpointer("other") as ckpt:  # another run, the same fast tier
        assert ckpt.should_save(5)
        ckpt.save(5)
    assert "held step(s) 1 of another run" in caplog.text
    assert resume() is None


def test_a_worker_killed_inside_a_fast_save_resumes_from_a_complete_step(tmp_path) -> None:
    """2 ranks on 2 nodes, a fast-tier save every step, a durable one every 4 steps; a worker
    SIGKILLed between two file-system operations of a fast-tier save (maybe on the thread
    writing it in the background):

    * rank 0 just before the rename that commits node 0's copy of step 6;
    * rank 1 deleting step 8 once node 1's copy of step 9 is committed;
    * rank 0 writing the file of rank 1 that it received for step 11 (node 0's copy; not
      step 10: rank 0 may start that save before rank 1's kill in step 9 stops the job);

    each restart resumes from the newest step committed on some node before the kill (an
    oracle outside the library logs the commits), never from a torn or mixed step, and the
    run ends bit-identical to the same job run without a restart."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    out = tmp_path / "out"
    plans = [
        {"step": 6, "rank": 0, "match": r"rename \.step-00000006\.tmp-\S+ step-00000006", "at": 0},
        {"step": 9, "rank": 1, "match": r"rename step-00000008 \.step-00000008\.tmp-\S+", "at": 0},
        {"step": 11, "rank": 0, "match": r"write rank-00001\.safetensors", "at": 0},
    ]
    args = ["--durable", str(tmp_path / "run"), "--fast", "fast", "--steps", "14",
            "--kill-in-save", json.dumps(plans)]  # fmt: skip
    launch = torchrun_restarting_nodes(
        FAST, "train", out, cwds=nodes, nproc=1, args=args, max_restarts=3
    ).ok()
    assert sorted(p.name for p in out.glob("kill-*")) == ["kill-11", "kill-6", "kill-9"]
    for rank in (0, 1):
        seen = [
            json.loads(line)
            for line in (out / f"resumes-rank{rank}.jsonl").read_text().splitlines()
        ]
        assert len(seen) == 4, (seen, launch.output[-3000:])
        for what in seen:  # the newest step committed on some node before the kill
            step = what["step"]
            assert step == (what["committed"] or 0), what
            durable = str(tmp_path / "run" / f"step-{step:08d}")  # every 4 steps; first on a tie
            expected = durable if step % 4 == 0 else f"fast/step-{step:08d}"
            assert what["path"] == (expected if step else None), what
    for rank in (0, 1):
        final = json.loads((out / f"final-rank{rank}.json").read_text())
        assert final["step"] == 14  # trained after the last resume: DDP's buffers agree
        assert losses(out, rank) == final["reference"]["losses"], rank
        assert final["digest"] == final["reference"]["digest"], rank
    for node in nodes:
        assert sorted(p.name for p in (node / "fast").iterdir() if "step" in p.name) == [
            "step-00000014"
        ]


def snapshot_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [v for state in opt.state.values() for v in state.values()]
    return [v.clone() for v in [*model.state_dict().values(), *moments]]


def holds(path: str, expected: list[torch.Tensor]) -> bool:
    model = make_mlp(seed=9)
    opt = torch.optim.AdamW(model.parameters())
    ddpckpt.load(path, model=model, optimizer=opt)
    return all(torch.equal(a, b) for a, b in zip(snapshot_of(model, opt), expected, strict=True))


def gate_writes(monkeypatch, where: str = "") -> tuple[threading.Event, threading.Event]:
    """The background writes of files whose path contains ``where`` wait for the first
    event returned to be set; the second is set once one waits."""
    gate, waiting = threading.Event(), threading.Event()
    write_file = writing.write_file

    def gated(*args, **kwargs):
        if where in args[0].path:
            waiting.set()
            assert gate.wait(30), "the gate was never opened"
        return write_file(*args, **kwargs)

    monkeypatch.setattr(writing, "write_file", gated)
    return gate, waiting


def test_a_step_both_tiers_save_is_captured_and_copied_once(tmp_path, monkeypatch) -> None:
    """One process, async_save="overlap": at a step saved to both tiers the state used to
    be captured twice and copied twice into host memory. Now once: the fast tier writes
    from the durable tier's copies, and both checkpoints hold the state as of save(),
    while training goes on before either is written."""
    captures, staged = [], []
    capture = checkpointer.capture
    monkeypatch.setattr(checkpointer, "capture", lambda state: captures.append(1) or capture(state))
    stage = StagingPool.stage

    def counting(pool, items, *args, **kwargs):
        staged.append(sum(t.numel() * t.element_size() for _, t in items))
        return stage(pool, items, *args, **kwargs)

    monkeypatch.setattr(StagingPool, "stage", counting)
    gate, _ = gate_writes(monkeypatch)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with ddpckpt.Checkpointer(
        tmp_path / "run", model=model, optimizer=opt, every_steps=2, async_save="overlap",
        fast_tier=tmp_path / "fast",
    ) as ckpt:  # fmt: skip
        ckpt.resume()
        train_steps(model, opt, 1)
        assert ckpt.should_save(1)
        ckpt.save(1)  # the fast tier alone
        gate.set()
        ckpt.wait()
        gate.clear()
        train_steps(model, opt, 1)
        expected = snapshot_of(model, opt)
        assert ckpt.should_save(2)
        del captures[:], staged[:]
        ckpt.save(2)  # both tiers
        assert len(captures) == 1
        assert staged[1] == 0 and staged[0] > 0, staged  # the fast tier copied nothing
        train_steps(model, opt, 2)  # the copies are read after this changed the state
        gate.set()
        ckpt.wait()
    assert holds(str(tmp_path / "run" / "step-00000002"), expected)
    assert holds(str(tmp_path / "fast" / "step-00000002"), expected)


def test_the_durable_tier_copies_again_only_once_the_fast_tier_wrote_its_copies(
    tmp_path, monkeypatch
) -> None:
    """Both tiers save every step: the durable save of step 2 stages into the buffer that
    the fast tier's write of step 1 still reads; it waits for that write, so the fast
    tier's step 1 holds step 1's state, not step 2's."""
    gate, waiting = gate_writes(monkeypatch, str(tmp_path / "fast" / ".step-00000001.tmp"))
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with ddpckpt.Checkpointer(
        tmp_path / "run", model=model, optimizer=opt, every_steps=1, async_save="overlap",
        fast_tier=ddpckpt.FastTier(tmp_path / "fast", keep=2),
    ) as ckpt:  # fmt: skip
        ckpt.resume()
        train_steps(model, opt, 1)
        ckpt.save(1)
        expected = snapshot_of(model, opt)
        assert waiting.wait(30)
        train_steps(model, opt, 1)
        second = threading.Thread(target=ckpt.save, args=(2,))
        second.start()
        second.join(1.0)  # blocked until the fast write is done (or, if not, restaged)
        gate.set()
        second.join(30)
        ckpt.wait()
    assert holds(str(tmp_path / "fast" / "step-00000001"), expected)
    assert holds(str(tmp_path / "run" / "step-00000001"), expected)


def test_a_fast_save_copies_an_embedding_that_renormalises_its_rows_before_save_returns(
    tmp_path,
) -> None:
    """Every fast save is an overlap save: an nn.Embedding(max_norm=...) rewrites the rows
    it looks up in forward, so its weight is copied before save() returns, and the fast
    tier holds the rows as of save()."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(64, 8, max_norm=1.0)
    with torch.no_grad():
        model.weight.mul_(10)  # every row's norm is over max_norm
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddpckpt.Checkpointer(
        tmp_path / "run", model=model, optimizer=opt, every_steps=100,
        fast_tier=tmp_path / "fast",
    ) as ckpt:  # fmt: skip
        ckpt.resume()
        assert ckpt.should_save(1)
        before = model.weight.detach().clone()
        ckpt.save(1)  # the fast tier alone
        model(torch.arange(64))  # renormalises every row, at once
        assert not torch.equal(model.weight, before)
        ckpt.wait()
    saved = ddpckpt.load_state_dict(str(tmp_path / "fast" / "step-00000001"))
    assert torch.equal(saved["weight"], before)
