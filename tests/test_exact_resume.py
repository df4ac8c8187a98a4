"""Issue 5's acceptance: a SIGKILLed and resumed DDP run is bit-identical to one that never
stopped, and a resume on fewer ranks sees every sample of the epoch exactly once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from launch import WORKER, _env, _finish, _start, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
EXACT = WORKER.with_name("exact_worker.py")


def launch(nproc: int, *args: str, expect_ok: bool = True) -> None:
    cmd = [str(Path(__import__("sys").executable).parent / "torchrun"), f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
           str(EXACT), *args]  # fmt: skip
    ((code, out),) = _finish([_start(cmd, _env({"OMP_NUM_THREADS": "1"}), None)], 240)
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


@pytest.mark.parametrize(("every", "where"), [(6, "mid-epoch"), (8, "epoch boundary")])
def test_killed_and_resumed_run_is_bit_identical(tmp_path, every, where) -> None:
    steps = 2 * every  # 4 optimizer steps (8 micro-batches per rank) make an epoch
    straight, resumed = tmp_path / "A", tmp_path / "B"
    straight.mkdir()
    resumed.mkdir()
    launch(2, "train", str(straight / "run"), str(straight), f"--steps={steps}", f"--every={every}")
    launch(2, "train", str(resumed / "run"), str(resumed), f"--steps={steps}", f"--every={every}",
           f"--kill-at={every + 2}", expect_ok=False)  # fmt: skip
    assert not (resumed / "final-rank0.json").exists()  # it really died
    launch(2, "train", str(resumed / "run"), str(resumed), f"--steps={steps}", f"--every={every}")
    for rank in (0, 1):
        a, b = losses(straight, rank), losses(resumed, rank)
        assert sorted(a) == list(range(1, steps + 1)) and a == b, where
        final_a = json.loads((straight / f"final-rank{rank}.json").read_text())
        final_b = json.loads((resumed / f"final-rank{rank}.json").read_text())
        assert final_a == final_b, where


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
