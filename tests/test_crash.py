"""Crash consistency: kill the trainer anywhere in a save, damage files, fill or freeze
the disk; resume() must find the newest checkpoint committed before the fault, and no
checkpoint retention should keep may be lost.

Kill points are spread over every phase of a save (tensor data, manifest, the commit
rename, the `latest` pointer, deleting old checkpoints, directory syncs). The summary is
printed into the test output.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from crash_worker import corrupt, read_oracle
from forked import run_ranks
from launch import WORKER, _env

CRASH_WORKER = WORKER.with_name("crash_worker.py")
KEEP = 2
SEED = int(os.environ.get("DDPCKPT_CRASH_SEED", "20261120"))
PHASES = ("data", "manifest", "commit", "latest", "delete", "fsync", "other")


def server(*args: str, timeout: float = 600) -> None:
    done = subprocess.run(
        [sys.executable, str(CRASH_WORKER), *args], check=False, timeout=timeout,
        env=_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]


def judge(result: dict) -> str:
    """'ok', or why the trial failed."""
    if "skipped" in result:
        return "skipped"
    found, oracle = result["found"], result["oracle"]
    if not isinstance(found, dict) or "error" in found or "crash" in found:
        return f"resume failed: {found}"
    committed = sorted(set(oracle["committed"]))
    must_survive = set(committed[-result.get("keep", KEEP) :])  # what retention kept
    if result["action"] in ("truncate", "flip"):
        must_survive.discard(committed[-1])  # the newest was damaged on purpose
        committed = committed[:-1]
    expected = committed[-1] if committed else None
    if found["step"] != expected:
        return f"resumed step {found['step']}, expected {expected}"
    if expected is not None and found["digest"] != oracle["digests"][str(expected)]:
        return f"state of step {expected} differs from what was saved"
    lost = sorted(s for s in must_survive if not found["verified"].get(str(s)))
    if lost:
        return f"lost or damaged checkpoints {lost}"
    if found["leftovers"]:
        return f"temporaries left after resume: {found['leftovers']}"
    return "ok"


def report(title: str, results: list[dict], capsys) -> list[str]:
    outcomes = Counter((r["action"], r.get("phase", "-"), judge(r)) for r in results)
    lines = [f"{title}: {len(results)} trials (seed {SEED})"]
    lines += [
        f"  {action:9} {phase:9} {verdict}: {n}"
        for (action, phase, verdict), n in sorted(outcomes.items())
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    return [
        f"{r['action']}@{r.get('phase')}#{r.get('at')}: {judge(r)}"
        for r in results
        if judge(r) not in ("ok", "skipped")
    ]


def plan_trials(events: list, rng: random.Random) -> list[dict]:
    by_phase: dict[str, list[int]] = {}
    for index, (phase, _) in enumerate(events):
        by_phase.setdefault(phase, []).append(index)
    specs = []
    for phase in PHASES:  # at least 7 kills in each phase that has events, 56+ in all
        indices = by_phase.get(phase, [])
        for at in rng.sample(indices, min(len(indices), 8)):
            specs.append({"action": "kill", "phase": phase, "at": at})
    writes = [i for i, (phase, what) in enumerate(events) if what.startswith(("create", "write"))]
    specs += [{"action": "enospc", "phase": events[i][0], "at": i} for i in rng.sample(writes, 4)]
    changes = [
        i for i, (_, what) in enumerate(events) if what.startswith(("create", "mkdir", "rename"))
    ]
    specs += [{"action": "erofs", "phase": events[i][0], "at": i} for i in rng.sample(changes, 3)]
    specs += [
        {"action": kind, "seed": rng.randrange(1 << 30)} for kind in ["truncate"] * 4 + ["flip"] * 5
    ]
    specs.append({"action": "readonly"})
    return specs


def plan_overwrite_trials(events: list, window: list[int], rng: random.Random) -> list[dict]:
    """Faults in the save that replaces step-N by two renames (no RENAME_EXCHANGE): a
    SIGKILL, and apart a one-off EIO, before each operation from its manifest on (the
    commit's renames and syncs, deleting the replaced copy, `latest`; of several writes or
    unlinks in a row the first), and one of each while the data is written."""
    first, last = window
    commit = next(i for i in range(first, last) if events[i][0] == "manifest")
    points = [rng.choice(range(first, commit))]
    for i in range(commit, last):
        kind, previous = events[i][1].split()[0], events[i - 1][1].split()[0]
        if not (kind in ("write", "unlink") and kind == previous):
            points.append(i)
    return [
        {"action": action, "at": i, "scenario": "overwrite", "keep": 1,
         "phase": f"overwrite/{events[i][0]}"}
        for action in ("kill", "eio")
        for i in points
    ]  # fmt: skip


@pytest.mark.long
def test_crash_consistency_single_process(tmp_path, capsys) -> None:
    """Also on a file system without RENAME_EXCHANGE: the run keeps one checkpoint and saves
    a step twice, the second save replacing the first in two renames."""
    server("calibrate", str(tmp_path / "calibration"), str(tmp_path / "events.json"))
    calibration = json.loads((tmp_path / "events.json").read_text())
    events = calibration["save"]["events"]
    assert {phase for phase, _ in events} >= {
        "data",
        "manifest",
        "commit",
        "latest",
        "delete",
        "fsync",
    }
    rng = random.Random(SEED)
    specs = plan_trials(events, rng)
    kills = sum(s["action"] == "kill" for s in specs)
    assert kills >= 50
    overwrite = calibration["overwrite"]
    replacing = [what for _, what in overwrite["events"][slice(*overwrite["window"])]]
    assert any(what.endswith(".previous") for what in replacing)  # no exchange: two renames
    specs += plan_overwrite_trials(overwrite["events"], overwrite["window"], rng)
    (tmp_path / "spec.json").write_text(json.dumps(specs))
    server(
        "trials",
        str(tmp_path / "trials"),
        str(tmp_path / "spec.json"),
        str(tmp_path / "results.json"),
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(specs)
    failures = report("crash suite, one process", results, capsys)
    assert not failures, "\n".join(failures)


def two_ranks(mode: str, *args: str, timeout: float = 120) -> tuple[int, str]:
    """``crash_worker.py MODE ARGS`` on 2 ranks, stopped as torchrun stops them (forked.py)."""
    return run_ranks(
        CRASH_WORKER, [mode, *args], nproc=2, env=_env({"OMP_NUM_THREADS": "1"}), timeout=timeout
    )


@pytest.mark.long
@pytest.mark.timeout(900)  # about twenty launches of 2 ranks, each bounded on its own
def test_crash_consistency_on_two_ranks(tmp_path, capsys) -> None:
    code, out = two_ranks("train", str(tmp_path / "calibration"), str(tmp_path / "cal-oracle"))
    assert code == 0, out[-4000:]
    events = {r: json.loads((tmp_path / f"cal-oracle.events.rank{r}").read_text()) for r in (0, 1)}
    rng = random.Random(SEED)
    specs = []
    for rank, phases in (
        # rank 0's kills while deleting or syncing are the one-process suite's (8 each)
        (0, ("data", "manifest", "commit", "latest")),
        (1, ("data", "fsync")),
    ):
        for phase in phases:
            indices = [i for i, (p, _) in enumerate(events[rank]) if p == phase]
            if indices:
                specs.append(
                    {
                        "action": "kill",
                        "phase": f"{phase}@rank{rank}",
                        "at": rng.choice(indices),
                        "rank": rank,
                    }
                )
    writes = [
        i for i, (p, what) in enumerate(events[1]) if p == "data" and what.startswith("write")
    ]
    specs.append({"action": "enospc", "phase": "data@rank1", "at": rng.choice(writes), "rank": 1})
    specs.append({"action": "flip", "seed": rng.randrange(1 << 30)})
    # no RENAME_EXCHANGE: rank 0 dies between the two renames replacing step 1 (second
    # commit rename onto it); the restarted job puts it back on every rank
    specs.append(
        {"action": "kill", "phase": "overwrite/commit@rank0", "rank": 0, "at": 1, "keep": 1,
         "scenario": "overwrite", "match": r"rename \.step-00000001\.tmp-\S+ step-00000001"}
    )  # fmt: skip
    results = []
    for i, spec in enumerate(specs):
        run, oracle = tmp_path / f"t{i}" / "run", tmp_path / f"t{i}" / "oracle"
        run.parent.mkdir()
        if spec["action"] == "flip":
            two_ranks("train", str(run), str(oracle))
            spec["note"] = corrupt(str(run), "flip", random.Random(spec["seed"]))
        else:
            two_ranks("train", str(run), str(oracle), json.dumps(spec))
        code, out = two_ranks("resume", str(run), str(tmp_path / f"t{i}" / "found"))
        found = (
            [json.loads((tmp_path / f"t{i}" / f"found.rank{r}").read_text()) for r in (0, 1)]
            if code == 0
            else [{"error": out[-2000:]}]
        )
        if len(found) == 2 and found[0] != found[1]:
            found = [{"error": f"ranks resumed differently: {found}"}]
        results.append({**spec, "oracle": read_oracle(f"{oracle}.rank0"), "found": found[0]})
    failures = report("crash suite, 2 ranks", results, capsys)
    assert len(results) >= 8
    assert results[-1]["oracle"]["committed"] == [1]  # died replacing step 1, as planned
    assert not failures, "\n".join(failures)
