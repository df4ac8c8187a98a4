"""benchmarks/scale.py runs the library's own functions: it must keep importing them, and
its repair column is the real fan-out's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale


def test_one_row_of_the_scale_simulation() -> None:
    row = scale.measure("hsdp", 64, layers=1, exact_resume_per_rank=100)
    assert row["tensors"] > 0 and row["held_bytes"] < 200
    assert row["exact_resume_bytes"] < 200  # a reference: every rank's state, 6,400, before


def test_what_a_rank_reads_of_exact_resume_s_state_stays_small_at_16384_ranks() -> None:
    # the manifest of the ranks' own state, one file table and its own state (21 kB)
    small, large = scale.exact_resume(256, 21_000), scale.exact_resume(16384, 21_000)
    assert large["exact_resume_read"] < 100_000, large
    assert large["exact_resume_bytes"] == small["exact_resume_bytes"]


def test_a_repair_of_every_node_but_one_takes_log_rounds() -> None:
    # 2,048 nodes of 8 ranks, 2,047 replaced: 11 rounds (one after another: 2,047)
    assert scale.repair(16384) == (11, 11)
    assert scale.repair(16) == (1, 1) and scale.repair(8) == (0, 0)


def test_the_file_lists_a_rank_reads_stay_small_at_16384_ranks() -> None:
    # the manifest's list (files of whole tensors, one entry per table) and one table of
    # 128 ranks' files; format 6 listed every file: about 6.4 MB
    listed, table = scale.file_lists(16384, 16383)
    assert listed < 32_000 and table < 64_000, (listed, table)
    assert scale.file_lists(64, 63) == (scale.file_lists(64, 63)[0], 0)  # no tables


def test_replicated_layouts_records_do_not_grow_with_the_ranks() -> None:
    # DDP and ZeRO-1: every tensor stored whole once, so the manifest's records are the
    # same at 16 and 1,024 ranks; the files holding them at most one per tensor
    for kind in ("ddp", "zero1"):
        small = scale.measure(kind, 16, layers=1, exact_resume_per_rank=100, model="70b")
        large = scale.measure(kind, 1024, layers=1, exact_resume_per_rank=100, model="70b")
        assert small["manifest_bytes"] == large["manifest_bytes"], kind
        assert large["tables_read"] == 1 and large["files_bytes"] < 40 * small["tensors"] * 30
