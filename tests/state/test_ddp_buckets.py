"""DDP's gradient bucket layout, recorded at save and restored at load (one-rank gloo group).

One rank shows the mechanics (what is recorded in each phase of DDP, the reducer a load
builds); that it makes resumes bit-identical needs 3 ranks or more and is shown under
torchrun in tests/test_exact_resume.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
import ddpckpt._state.ddp_buckets as ddp_buckets
from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.sections import DDPBuckets, ModelSection
from ddpckpt._state.ddp_buckets import record_buckets, restore_buckets
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate

# Parameters in the order DDP indexes them; their gradients become ready in reverse.
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
READY = [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def steps(wrapped: nn.Module, count: int, set_to_none: bool = True) -> None:
    for _ in range(count):
        wrapped(torch.randn(3, 4)).square().mean().backward()
        for p in wrapped.parameters():
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()


def live_buckets(ddp: DDP) -> list[list[str]]:
    """The reducer's buckets, read from the buckets themselves."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [
        [names[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def test_what_is_recorded_follows_ddp_through_its_first_steps(process_group) -> None:
    assert record_buckets(model()) == DDPBuckets("none")
    ddp = DDP(model())
    assert record_buckets(ddp) == DDPBuckets("initial")
    steps(ddp, 1)  # reduced once; DDP rebuilds its buckets at the next forward
    assert record_buckets(ddp) == DDPBuckets("unsettled")
    steps(ddp, 1)  # rebuilt, and not yet in DDP's logging data: read from the buckets
    assert record_buckets(ddp) == DDPBuckets("rebuilt", READY) and live_buckets(ddp) == READY
    steps(ddp, 1)
    assert record_buckets(ddp) == DDPBuckets("rebuilt", READY)


def test_static_graph_rebuilds_a_step_later_and_find_unused_never(process_group) -> None:
    static = DDP(model(), static_graph=True)
    steps(static, 2)
    assert record_buckets(static) == DDPBuckets("unsettled")
    steps(static, 1)
    assert record_buckets(static) == DDPBuckets("rebuilt", READY)
    unused = DDP(model(), find_unused_parameters=True)
    steps(unused, 3)
    assert record_buckets(unused) == DDPBuckets("initial")


@pytest.mark.parametrize("wrap", ["DDP(compile)", "compile(DDP)"])
def test_buckets_name_parameters_without_wrapper_prefixes(process_group, wrap) -> None:
    compile_ = lambda m: torch.compile(m, backend="eager")  # noqa: E731
    wrapped = DDP(compile_(model())) if wrap == "DDP(compile)" else compile_(DDP(model()))
    steps(wrapped, 3)
    assert record_buckets(wrapped) == DDPBuckets("rebuilt", READY)


def test_a_fresh_ddp_gets_the_recorded_layout_with_its_setup_and_keeps_it(
    process_group, caplog
) -> None:
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DDP(model(), static_graph=True)
    ddp.register_comm_hook(None, hook)
    original = ddp.reducer
    restore_buckets(ddp, DDPBuckets("rebuilt", READY), "ckpt", "the model")
    assert ddp.reducer is not original and live_buckets(ddp) == READY
    reference = DDP(model(), static_graph=True)
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        for wrapped in (ddp, reference):
            torch.manual_seed(1)
            steps(wrapped, 4)  # static graph's first iteration, the rebuild, and after
        assert record_buckets(ddp) == DDPBuckets("rebuilt", READY)  # rebuilt the same way
    for mine, theirs in zip(ddp.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert calls == [0] * 4 and not caplog.text  # the communication hook was carried over


def test_a_restored_layout_that_ddp_rebuilds_otherwise_is_warned_about(
    process_group, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(ddp_buckets, "_world_size", lambda ddp: 3)
    ddp = DDP(model())
    split = [["4.bias", "4.weight"], ["2.bias", "2.weight", "0.bias", "0.weight"]]
    restore_buckets(ddp, DDPBuckets("rebuilt", split), "ckpt", "the model")
    assert live_buckets(ddp) == split
    steps(ddp, 3)  # DDP rebuilds it from the gradients' order, into one bucket
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert record_buckets(ddp) == DDPBuckets("rebuilt", READY)
    assert "laid out its gradient buckets differently after the resume" in caplog.text


def test_a_recorded_initial_layout_resets_a_trained_ddp_and_leaves_a_fresh_one(
    process_group,
) -> None:
    fresh = DDP(model())
    reducer = fresh.reducer
    restore_buckets(fresh, DDPBuckets("initial"), "ckpt", "the model")
    assert fresh.reducer is reducer
    trained = DDP(model())
    steps(trained, 3)
    restore_buckets(trained, DDPBuckets("initial"), "ckpt", "the model")
    assert record_buckets(trained) == DDPBuckets("initial")
    assert live_buckets(trained) == [NAMES]  # DDP's construction-time layout


def test_gradients_that_were_bucket_views_become_zero_views_again(process_group, ckpt_dir) -> None:
    ddp = DDP(model(), gradient_as_bucket_view=True)
    steps(ddp, 3, set_to_none=False)
    assert record_buckets(ddp).grad_views
    ddpckpt.save(ckpt_dir, model=ddp)
    fresh = DDP(model(), gradient_as_bucket_view=True)
    ddpckpt.load(ckpt_dir, model=fresh)
    assert all(p.grad is not None and p.grad._is_view() for p in fresh.parameters())
    assert all(not p.grad.any() for p in fresh.parameters())
    views = DDP(model(), gradient_as_bucket_view=True)
    steps(views, 3)  # set_to_none: the gradients are new tensors at every step
    assert not record_buckets(views).grad_views


def test_accumulated_gradients_load_into_the_gradients_in_place(process_group, ckpt_dir) -> None:
    ddp = DDP(model(), gradient_as_bucket_view=True)
    accumulation = ddpckpt.GradientAccumulation(ddp, steps=2)
    steps(ddp, 3, set_to_none=False)
    with accumulation.context():
        ddp(torch.randn(3, 4)).sum().backward()
    accumulation.step()  # in the middle of a window
    ddpckpt.save(ckpt_dir, model=ddp, extra={"accumulation": accumulation})
    fresh = DDP(model(), gradient_as_bucket_view=True)
    again = ddpckpt.GradientAccumulation(fresh, steps=2)
    ddpckpt.load(ckpt_dir, model=fresh, extra={"accumulation": again})
    for mine, saved in zip(fresh.parameters(), ddp.parameters(), strict=True):
        assert mine.grad._is_view() and torch.equal(mine.grad, saved.grad)


def test_checkpoints_record_the_layout_and_read_without_it(process_group, ckpt_dir) -> None:
    ddp = DDP(model())
    steps(ddp, 3)
    ddpckpt.save(ckpt_dir, model=ddp)
    doc = read_manifest(locate(ckpt_dir)).state["model"]
    assert doc["ddp_buckets"] == {"state": "rebuilt", "buckets": READY}
    del doc["ddp_buckets"]
    assert ModelSection.from_json(doc, "ckpt").ddp_buckets == DDPBuckets("unrecorded")
    assert "ddp_buckets" not in ModelSection.from_json(doc, "ckpt").to_json()
    for bad in ({"state": "shuffled"}, {"state": "rebuilt", "buckets": [[0, 1]]}):
        with pytest.raises(CorruptCheckpointError, match="ckpt"):
            ModelSection.from_json({**doc, "ddp_buckets": bad}, "ckpt")


@pytest.mark.parametrize(
    ("saved", "setup", "why"),
    [
        (DDPBuckets("unrecorded"), None, "does not record it"),
        (DDPBuckets("unsettled"), None, "saved in DDP's first steps"),
        (DDPBuckets("rebuilt", [["0.weight"]]), None, "do not fit the model's parameters"),
        (DDPBuckets("rebuilt", READY), "builtin hook", "a built-in communication hook"),
        (DDPBuckets("rebuilt", READY), "other torch", "builds DDP's reducer differently"),
    ],
)
def test_what_cannot_be_restored_is_said_from_three_ranks_on(
    process_group, monkeypatch, caplog, saved, setup, why
) -> None:
    ddp = DDP(model())
    if setup == "builtin hook":
        ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.ALLREDUCE)
    if setup == "other torch":  # a DDP that never asks for a bucket assignment: a name it
        # never reads (a real one, such as _DEFAULT_FIRST_BUCKET_BYTES, is read by torch 2.11)
        monkeypatch.setattr(torch.distributed, "_ddpckpt_never_read", None, raising=False)
        monkeypatch.setattr(ddp_buckets, "_ASSIGNMENT", "_ddpckpt_never_read")
    for world, warned in ((2, False), (3, True)):
        monkeypatch.setattr(ddp_buckets, "_world_size", lambda ddp, world=world: world)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddpckpt"):
            restore_buckets(ddp, saved, "ckpt/step-9", "the model")
        assert (why in caplog.text) is warned, caplog.text
    assert (
        "ckpt/step-9: DDP's gradient bucket layout of the model cannot be restored" in caplog.text
    )
    assert "from 3 ranks on" in caplog.text


def test_buckets_that_no_longer_match_the_module_are_not_recorded_and_said_so(
    process_group, caplog
) -> None:
    ddp = DDP(model())
    steps(ddp, 3)
    ddp.module[0].bias.requires_grad_(False)  # frozen after wrapping: DDP still reduces it
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        assert record_buckets(ddp) == DDPBuckets("none")
        assert record_buckets(ddp) == DDPBuckets("none")
    assert caplog.text.count("do not hold the parameters of the module it wraps") == 1
