"""A SIGKILLed and resumed DDP run is bit-identical to one that never stopped, at 2, 3 and 4
ranks and in every DDP set-up, and a resume on fewer ranks sees every sample of the epoch
exactly once.

From 3 ranks on, exactness needs DDP's gradient buckets laid out as in the uninterrupted run
(ddpckpt._state.ddp_buckets): with 2 ranks the layout changes no sum, so those tests run at 4.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from forked import run_ranks
from launch import ONE_NODE, RUN_SCRIPT, WORKER, _env, _finish, _start, forked_ranks

pytestmark = [pytest.mark.processes, pytest.mark.long]
EXACT = WORKER.with_name("exact_worker.py")


def launch(nproc: int, *args: str, expect_ok: bool = True) -> None:
    """``exact_worker.py ARGS`` on ``nproc`` ranks, stopped as torchrun stops them (forked.py)."""
    code, out = run_ranks(EXACT, args, nproc=nproc, env=_env({"OMP_NUM_THREADS": "1"}), timeout=240)
    if expect_ok:
        assert code == 0, out[-5000:]


def losses(out: Path, rank: int) -> dict[int, dict]:
    by_step: dict[int, list[dict]] = {}
    for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record)
    for records in by_step.values():  # steps redone after the crash gave the same losses
        assert all(r == records[0] for r in records), records
    return {step: records[0] for step, records in by_step.items()}


STEPS, EVERY = 12, 5  # 3 optimizer steps (6 micro-batches per rank) make an epoch
# Killed inside the batch loop at step 6 (newest checkpoint: step 5, mid-epoch 1); then right
# after epoch 1's end-of-loop save (restart at the next epoch); then right after epoch 2's
# save that stores the finished epoch (restart at that epoch, whose loop yields nothing).
KILLS = [["--kill-at=6"], ["--kill-after-epoch=1"], ["--kill-after-epoch=2", "--restart=same"], []]


def compare(straight: Path, resumed: Path, nproc: int = 2) -> None:
    for rank in range(nproc):
        a, b = losses(straight, rank), losses(resumed, rank)
        assert sorted(a) == list(range(1, STEPS + 1)) and a == b, rank
        final_a = json.loads((straight / f"final-rank{rank}.json").read_text())
        final_b = json.loads((resumed / f"final-rank{rank}.json").read_text())
        assert final_a == final_b, rank


def killed_and_resumed(tmp_path: Path, *options: str, nproc: int = 2) -> None:
    straight, resumed = tmp_path / "A", tmp_path / "B"
    straight.mkdir()
    resumed.mkdir()
    common = [f"--steps={STEPS}", f"--every={EVERY}", *options]
    launch(nproc, "train", str(straight / "run"), str(straight), *common)
    for kill in KILLS:
        launch(nproc, "train", str(resumed / "run"), str(resumed), *common, *kill,
               expect_ok=not kill)  # fmt: skip
        assert bool(kill) != (resumed / "final-rank0.json").exists()  # it really died
    compare(straight, resumed, nproc)


@pytest.mark.parametrize(("loader", "nproc"), [("plain", 4), ("persistent", 2)])
def test_killed_mid_epoch_and_after_epoch_end_saves_resumes_bit_identical(
    tmp_path, loader, nproc
) -> None:
    """A plain DataLoader (2 workers) saved as the loader, and one with persistent workers."""
    killed_and_resumed(tmp_path, f"--loader={loader}", nproc=nproc)


CONFIGS = WORKER.with_name("configs_worker.py")
AT_THREE = "plain,accumulation,bucket_view"  # at 4 ranks: every set-up of configs_worker.py


def test_every_ddp_set_up_resumes_bit_identical_at_four_and_three_ranks(tmp_path) -> None:
    """Plain DDP and Checkpointer.resume(), find_unused_parameters, static_graph,
    torch.compile(DDP(model)), no_sync() accumulation saved inside a window,
    gradient_as_bucket_view with zero_grad(set_to_none=False), a communication hook and a load
    into the trained objects, each resumed in-process (a new DDP starts from the bucket layout a
    restarted process starts from). 3 ranks add what a power of two hides: DDP divides a
    gradient by the world size in place or multiplies it by the reciprocal, and only 1/3
    rounds. The 3-rank job also loads the 4-rank checkpoint: the layout follows it by name."""
    four = tmp_path / "four"
    runs = {
        4: forked_ranks("configs", four / "out", nproc=4, worker=CONFIGS, timeout=240,
                        args=["--ckpt", str(four / "ckpt")]).ok().results,
        3: forked_ranks("configs", tmp_path / "three", nproc=3, worker=CONFIGS, timeout=240,
                        args=["--ckpt", str(tmp_path / "ckpt3"), f"--only={AT_THREE}",
                              f"--resized-from={four / 'ckpt'}"]).ok().results,
    }  # fmt: skip
    for world, results in runs.items():
        assert sorted(results) == list(range(world))
        for rank, result in results.items():
            resized = result.pop("resized", None)
            assert {setup: r["exact"] for setup, r in result.items()} == dict.fromkeys(
                result, True
            ), (world, rank, result)
            assert all(r["warnings"] == [] for r in result.values()), (world, rank, result)
            if resized is not None:
                assert resized["saved"]["state"] == "rebuilt", resized
                assert resized["restored"] == resized["saved"] == resized["kept"], resized
                assert not any("bucket" in w for w in resized["warnings"]), resized


def test_multistep_schedule_across_its_milestone_resumes_bit_identical(tmp_path) -> None:
    killed_and_resumed(tmp_path, "--loader=plain", "--schedule=multistep")


def test_resuming_four_ranks_on_two_or_three_sees_each_sample_once(tmp_path) -> None:
    launch(4, "coverage", str(tmp_path / "run"), str(tmp_path), "--batches=3")
    first = [
        i for r in range(4) for i in json.loads((tmp_path / f"seen-4-rank{r}.json").read_text())
    ]
    assert len(first) == 4 * 3 * 2
    for world in (2, 3):
        launch(world, "coverage", str(tmp_path / "run"), str(tmp_path))
        rest = [
            i
            for r in range(world)
            for i in json.loads((tmp_path / f"seen-{world}-rank{r}.json").read_text())
        ]
        counts = Counter(first + rest)
        assert sorted(counts) == list(range(48)) and set(counts.values()) == {1}, world


EXAMPLE = Path(__file__).parents[1] / "examples" / "train_ddp.py"


def run_example(out: Path, kill_when: Callable[[Path], bool] | None = None) -> int:
    """Run the example on 2 ranks; SIGKILL the whole job once ``kill_when(checkpoints)``."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2",
           *ONE_NODE, "--max-restarts=0",
           str(RUN_SCRIPT), str(EXAMPLE), f"--out={out}", "--epochs=3"]  # fmt: skip
    proc = _start(cmd, _env({"OMP_NUM_THREADS": "1"}), None)
    deadline = time.monotonic() + 240
    while kill_when is not None and proc.poll() is None and time.monotonic() < deadline:
        if (out / "checkpoints").is_dir() and kill_when(out / "checkpoints"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    ((code, output),) = _finish([proc], 240)
    assert kill_when is not None or code == 0, output[-5000:]
    return code


def committed(checkpoints: Path) -> bool:
    return any(p.name.startswith("step-") for p in checkpoints.iterdir())


def saving(checkpoints: Path) -> bool:
    return any(".tmp" in p.name for p in checkpoints.iterdir())


def test_the_example_survives_sigkill_and_ends_as_an_uninterrupted_run(tmp_path) -> None:
    run_example(tmp_path / "straight")
    resumed = tmp_path / "killed"
    assert run_example(resumed, kill_when=committed) != 0  # killed after its first checkpoint
    run_example(resumed, kill_when=saving)  # killed while a save is being written, if caught
    # What a kill during a save leaves behind, in case the kill above came at another moment.
    (resumed / "checkpoints" / ".step-00000041.tmp-1a2b3c").mkdir()
    run_example(resumed)
    straight = json.loads((tmp_path / "straight" / "final-weights.json").read_text())
    assert json.loads((resumed / "final-weights.json").read_text()) == straight
