"""A resume on fewer ranks than saved the checkpoint is inexact, and says so once: the state
the ranks that are gone kept of their own is dropped, and the global batch changes
(ddpckpt._io.world_change)."""

from __future__ import annotations

import logging

import ddpckpt
from conftest import make_mlp
from ddpckpt import Checkpointer
from hostile import edit_manifest


def saved_by(run, world_size: int, **objects) -> None:
    """Checkpoint step 3 of ``run``, made to look saved by ``world_size`` ranks."""
    with Checkpointer(run, **objects) as ckpt:
        ckpt.save(3)

    def edit(doc) -> None:
        doc["world_size"] = world_size

    edit_manifest(run / "step-00000003", edit)


def shrink_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "resumed with" in r.getMessage()
    ]


def test_resuming_on_fewer_ranks_says_what_is_not_restored(tmp_path, caplog) -> None:
    run = tmp_path / "exp1"
    saved_by(run, 2, model=make_mlp())
    ckpt = Checkpointer(run, model=make_mlp())
    with caplog.at_level(logging.WARNING, logger="ddpckpt"), ckpt:
        assert ckpt.resume().world_size == 2
    (message,) = shrink_warnings(caplog)
    assert message == (
        f"{run}/step-00000003: saved with 2 ranks, resumed with 1: what rank 1 stored of "
        "its own is not restored (its RNG streams), and with the same batch size per rank "
        "the global batch (world size x batch size) changes by a factor of 1/2. Training "
        "goes on from this checkpoint, but not exactly as the saved run would have; resume "
        "with 2 ranks to continue it exactly"
    )


def test_the_same_world_size_says_nothing(tmp_path, caplog) -> None:
    run = tmp_path / "exp1"
    saved_by(run, 1, model=make_mlp())
    ckpt = Checkpointer(run, model=make_mlp())
    with caplog.at_level(logging.WARNING, logger="ddpckpt"), ckpt:
        ckpt.resume()
    assert shrink_warnings(caplog) == []


def test_every_kind_of_state_of_the_ranks_gone_is_named() -> None:
    from ddpckpt._io.world_change import shrink_notice

    keys = ["extra", "extra/loader", "model_buffers", "own", "rng"]
    message = shrink_notice("run/step-00000009", 8, 2, keys)
    assert message is not None and message.startswith(
        "run/step-00000009: saved with 8 ranks, resumed with 2: what ranks 2-7 stored of "
        "their own is not restored (their RNG streams, their state of extra['loader'], "
        "their buffers kept per rank (broadcast_buffers=False), their own values of the "
        "state that differed between ranks), and with the same batch size per rank the "
        "global batch (world size x batch size) changes by a factor of 2/8. "
    ), message
    bare = shrink_notice("run/step-00000009", 3, 2, [])
    assert bare is not None and "what rank 2 stored of its own" not in bare
    assert bare.startswith(
        "run/step-00000009: saved with 3 ranks, resumed with 2: rank 2 stored no state of its "
        "own, but with the same batch size per rank the global batch"
    ), bare
    assert shrink_notice("run/step-00000009", 2, 2, ["rng"]) is None
    assert shrink_notice("run/step-00000009", 1, 4, ["rng"]) is None  # each new rank says it


def test_a_plain_load_or_load_latest_on_fewer_ranks_says_so_too(tmp_path, caplog) -> None:
    """A loop of ddpckpt.load_latest (or load) resumed on fewer ranks said nothing."""
    run = tmp_path / "exp1"
    saved_by(run, 2, model=make_mlp())
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert ddpckpt.load_latest(run, model=make_mlp()).world_size == 2
        assert ddpckpt.load(run / "step-00000003", model=make_mlp()).world_size == 2
    said = shrink_warnings(caplog)
    assert len(said) == 2 and all(
        m.startswith(f"{run}/step-00000003: saved with 2 ranks, resumed with 1: ") for m in said
    )


def test_a_read_only_checkpointer_says_nothing_of_it(tmp_path, caplog) -> None:
    run = tmp_path / "exp1"
    saved_by(run, 2, model=make_mlp())
    reader = Checkpointer(run, model=make_mlp(), read_only=True)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"), reader:
        assert reader.resume().world_size == 2
    assert shrink_warnings(caplog) == []
