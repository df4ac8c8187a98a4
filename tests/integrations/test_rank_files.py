"""Each rank's own state saved beside a framework's checkpoint (one process here; 2 ranks
under Lightning in test_lightning.py): the reference round-trips, every save has its own
token and name, a forged reference is refused before anything is read, and pruning deletes
only the saves older than the one a file was written with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpckpt.errors import CorruptCheckpointError, InexactResumeError
from ddpckpt.integrations._rank_files import load_own, prune_own, save_own


def _state(seed: int) -> dict:
    return {"rng": {"torch": torch.arange(seed, seed + 4)}, "loaders": [{"position": seed}]}


def _saved(root: Path) -> list[str]:
    return sorted(p.name for p in (root / ".ddpckpt-ranks").iterdir())


def test_a_rank_s_state_comes_back_and_a_later_save_under_the_same_name_is_another(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    first = save_own(checkpoint, _state(1))
    assert first["saved"] == f".ddpckpt-ranks/last.ckpt@{first['id']}"
    state, world = load_own(checkpoint, first)
    assert world == 1 and state["loaders"] == [{"position": 1}]
    assert torch.equal(state["rng"]["torch"], torch.arange(1, 5))
    second = save_own(checkpoint, _state(2))  # the same name: its own, the first one kept
    assert second["id"] > first["id"]  # tokens order the saves
    assert load_own(checkpoint, first)[0]["loaders"] == [{"position": 1}]
    assert load_own(checkpoint, second)[0]["loaders"] == [{"position": 2}]


def test_a_reference_whose_state_is_another_save_s_is_refused(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    first, second = save_own(checkpoint, _state(1)), save_own(checkpoint, _state(2))
    forged = {"saved": first["saved"].replace(first["id"], second["id"]), "id": first["id"]}
    with pytest.raises(CorruptCheckpointError, match="not one ddpckpt writes"):
        load_own(checkpoint, forged)
    root = tmp_path / ".ddpckpt-ranks"
    (root / f"last.ckpt@{first['id']}").rename(root / "moved")
    (root / f"last.ckpt@{second['id']}").rename(root / f"last.ckpt@{first['id']}")
    with pytest.raises(InexactResumeError, match="another save"):
        load_own(checkpoint, first)


@pytest.mark.parametrize(
    "reference",
    [
        None,
        [],
        {"saved": "../outside@0123456789abcdef01234567", "id": "0123456789abcdef01234567"},
        {"saved": ".ddpckpt-ranks/../x@0123456789abcdef01234567", "id": "0123456789abcdef01234567"},
        {
            "saved": ".ddpckpt-ranks/a\x00b@0123456789abcdef01234567",
            "id": "0123456789abcdef01234567",
        },
        {"saved": "/a/.ddpckpt-ranks/x@0123456789abcdef01234567", "id": "0123456789abcdef01234567"},
        {"saved": ".ddpckpt-ranks/x@0123", "id": "0123"},
        {"saved": ".ddpckpt-ranks/x@0123456789abcdef01234567", "id": 5},
    ],
)
def test_a_forged_reference_is_refused_before_anything_is_read(tmp_path, reference) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"last\.ckpt"):
        load_own(str(tmp_path / "last.ckpt"), reference)


def test_a_reference_to_state_that_is_gone_says_what_to_do(tmp_path: Path) -> None:
    reference = save_own(str(tmp_path / "a" / "last.ckpt"), _state(1))
    with pytest.raises(InexactResumeError, match=r"is missing \(a checkpoint copied or moved"):
        load_own(str(tmp_path / "b" / "last.ckpt"), reference)


def test_pruning_deletes_only_the_saves_older_than_the_written_one(tmp_path: Path) -> None:
    """A file written with the second of three saves (an asynchronous write that has not
    caught up): the first goes, the second and the third (whose file is still to be
    written) stay; another checkpoint's saves are never touched; a deleted checkpoint's
    all go."""
    last = [save_own(str(tmp_path / "last.ckpt"), _state(s)) for s in (1, 2, 3)]
    other = save_own(str(tmp_path / "epoch=0-step=3.ckpt"), _state(3))
    prune_own(str(tmp_path / "last.ckpt"), older_than=last[1]["id"])
    kept = [f"last.ckpt@{r['id']}" for r in last[1:]] + [f"epoch=0-step=3.ckpt@{other['id']}"]
    assert _saved(tmp_path) == sorted(kept)
    prune_own(str(tmp_path / "epoch=0-step=3.ckpt"), older_than=None)
    prune_own(str(tmp_path / "never-saved.ckpt"), older_than=None)
    assert _saved(tmp_path) == sorted(kept[:2])


def test_a_rollback_s_saves_are_newer_whatever_their_step(tmp_path: Path) -> None:
    """Tokens order saves by time, not step: a run resumed from an earlier step in the same
    directory keeps its own last.ckpt's state (ordering by step deleted it)."""
    old = save_own(str(tmp_path / "last.ckpt"), _state(1000))
    rolled_back = save_own(str(tmp_path / "last.ckpt"), _state(400))
    prune_own(str(tmp_path / "last.ckpt"), older_than=rolled_back["id"])
    assert _saved(tmp_path) == [f"last.ckpt@{rolled_back['id']}"]
    assert load_own(str(tmp_path / "last.ckpt"), rolled_back)[0]["loaders"] == [{"position": 400}]
    assert old["id"] < rolled_back["id"]


def test_a_long_file_name_gets_a_short_distinct_name(tmp_path: Path) -> None:
    names = ["x" * 240 + "-a.ckpt", "x" * 240 + "-b.ckpt"]
    saved = [save_own(str(tmp_path / n), _state(i)) for i, n in enumerate(names)]
    assert all(len(Path(s["saved"]).name.encode()) < 255 for s in saved)
    assert len({Path(s["saved"]).name.split("@")[0] for s in saved}) == 2
    assert load_own(str(tmp_path / names[1]), saved[1])[0]["loaders"] == [{"position": 1}]


def test_tokens_grow_even_when_the_clock_is_set_back(tmp_path: Path, monkeypatch) -> None:
    """A save after the clock went back must not look older than the one before (its state
    would be deleted once the earlier file is written)."""
    import ddpckpt.integrations._rank_files as rank_files

    times = iter([2_000_000_000_000_000_000, 1_000_000_000_000_000_000])
    monkeypatch.setattr(rank_files.time, "time_ns", lambda: next(times))
    first = save_own(str(tmp_path / "last.ckpt"), _state(1))
    second = save_own(str(tmp_path / "last.ckpt"), _state(2))
    assert second["id"] > first["id"]
    prune_own(str(tmp_path / "last.ckpt"), older_than=first["id"])
    assert f"last.ckpt@{second['id']}" in _saved(tmp_path)


def test_pruning_also_deletes_what_interrupted_saves_left(tmp_path: Path) -> None:
    old, new = save_own(str(tmp_path / "last.ckpt"), _state(1)), None
    root = tmp_path / ".ddpckpt-ranks"
    unfinished = root / f"last.ckpt@{'0' * 24}"  # no manifest: a save cut short
    unfinished.mkdir()
    (unfinished / "rank-00000.safetensors").write_bytes(b"x")
    temporary = root / f".last.ckpt@{'0' * 23}1.tmp-ab12"
    temporary.mkdir()
    new = save_own(str(tmp_path / "last.ckpt"), _state(2))
    prune_own(str(tmp_path / "last.ckpt"), older_than=new["id"])
    assert _saved(tmp_path) == [f"last.ckpt@{new['id']}"], old


def test_a_name_with_a_backslash_or_control_character_gets_a_plain_one(tmp_path: Path) -> None:
    for name in ("a\\b.ckpt", "tab\there.ckpt"):
        saved = save_own(str(tmp_path / name), _state(1))
        assert "\\" not in saved["saved"] and "\t" not in saved["saved"]
        assert load_own(str(tmp_path / name), saved)[0]["loaders"] == [{"position": 1}]
        prune_own(str(tmp_path / name), older_than=None)
    assert _saved(tmp_path) == []
