"""save/load in one process: the whole training state, restored exactly; clear failures."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import random
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpckpt
from conftest import TiedLM, make_mlp, train_steps
from ddpckpt import CheckpointNotFoundError, CorruptCheckpointError, PartiallyRestoredError
from ddpckpt.errors import StateMismatchError
from ddpckpt.storage import storage_for
from io_helpers import Counter, assert_state_equal, flip_byte


@pytest.fixture
def ckpt_dir(ckpt_root) -> str:
    """Where each test saves: on disk, then in memory (``ckpt_root``)."""
    return os.fspath(ckpt_root / "ckpt")


def training_state(seed: int = 0):
    model = make_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    ema = torch.optim.swa_utils.AveragedModel(model)
    return model, opt, sched, scaler, ema, Counter()


def step(model, opt, sched, scaler, ema, counter) -> float:
    opt.zero_grad()
    loss = model(torch.randn(6, 4)).pow(2).mean() * (1 + random.random()) * float(np.random.rand())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    ema.update_parameters(model)
    counter.seen += 6
    counter.history.append(int(torch.randint(0, 100, ())))
    return float(loss.detach())


def test_resumed_training_is_bit_identical(ckpt_dir) -> None:
    objs = training_state()
    for _ in range(4):
        step(*objs)
    model, opt, sched, scaler, ema, counter = objs
    ddpckpt.save(
        ckpt_dir, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
        extra={"ema": ema, "data": counter, "best": 0.5, "tag": ("a", 1)}, step=4, epoch=1,
        metrics={"loss": torch.tensor(0.25)},
    )  # fmt: skip
    expected = [step(*objs) for _ in range(3)]

    fresh = training_state(seed=1)
    fresh_model, fresh_opt, fresh_sched, fresh_scaler, fresh_ema, fresh_counter = fresh
    values = {"best": None, "tag": None}
    info = ddpckpt.load(
        ckpt_dir, model=fresh_model, optimizer=fresh_opt, scheduler=fresh_sched,
        scaler=fresh_scaler, extra={"ema": fresh_ema, "data": fresh_counter, **values},
    )  # fmt: skip
    assert (info.step, info.epoch, info.metrics) == (4, 1, {"loss": 0.25})
    assert info.extra == {"best": 0.5, "tag": ("a", 1)}
    assert [step(*fresh) for _ in range(3)] == expected
    assert_state_equal(fresh_model.state_dict(), model.state_dict())
    assert_state_equal(fresh_opt.state_dict(), opt.state_dict())
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_scaler.state_dict() == scaler.state_dict()
    assert_state_equal(fresh_ema.state_dict(), ema.state_dict())
    assert fresh_counter.state_dict() == counter.state_dict()


def test_plain_extra_values_are_written_back(ckpt_dir) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, model=model, extra={"epoch_seen": 3, "t": torch.arange(3)})
    extra = {"epoch_seen": 0, "t": None}
    ddpckpt.load(ckpt_dir, model=model, extra=extra)
    assert extra["epoch_seen"] == 3 and torch.equal(extra["t"], torch.arange(3))


@pytest.mark.parametrize("target", ["plain", "DDP", "compile", "DDP(compile)"])
def test_checkpoint_from_wrapped_model_loads_into_any_wrapping(
    process_group, ckpt_dir, target
) -> None:
    source = make_mlp(seed=3)
    ddpckpt.save(ckpt_dir, model=DDP(torch.compile(source, backend="eager")))
    model = make_mlp(seed=4)
    wrap = {"plain": lambda m: m, "DDP": DDP, "compile": lambda m: torch.compile(m, backend="eager"),
            "DDP(compile)": lambda m: DDP(torch.compile(m, backend="eager"))}[target]  # fmt: skip
    ddpckpt.load(ckpt_dir, model=wrap(model))
    assert_state_equal(model.state_dict(), source.state_dict())


def test_strict_mismatch_lists_every_difference_and_changes_nothing(ckpt_dir) -> None:
    ddpckpt.save(ckpt_dir, model=make_mlp())
    other = nn.Sequential(nn.Linear(4, 9), nn.BatchNorm1d(9), nn.ReLU())
    other.add_module("extra", nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatchError) as caught:
        ddpckpt.load(ckpt_dir, model=other)
    message = str(caught.value)
    assert "missing from the checkpoint (2): extra.weight, extra.bias" in message
    assert "unexpected in the checkpoint (2): 3.weight, 3.bias" in message
    assert "0.weight: checkpoint [8, 4], model [9, 4]" in message
    assert_state_equal(other.state_dict(), before)


def test_non_strict_loads_what_matches_and_warns(ckpt_dir, caplog) -> None:
    source = make_mlp(seed=5)
    ddpckpt.save(ckpt_dir, model=source)
    target = make_mlp(seed=6)
    target.add_module("head", nn.Linear(3, 1))
    with caplog.at_level(logging.WARNING, logger="ddpckpt"):
        ddpckpt.load(ckpt_dir, model=target, strict=False)
    assert "head.weight" in caplog.text and "strict=False" in caplog.text
    assert torch.equal(target[0].weight, source[0].weight)


def test_tied_weights_survive_and_stay_tied(ckpt_dir) -> None:
    source = TiedLM()
    with torch.no_grad():
        source.embed.weight.mul_(3)
    ddpckpt.save(ckpt_dir, model=source)
    target = TiedLM()
    ddpckpt.load(ckpt_dir, model=target)
    assert target.head.weight is target.embed.weight
    assert torch.equal(target.embed.weight, source.embed.weight)
    weights = ddpckpt.load_state_dict(ckpt_dir)
    assert weights["head.weight"] is weights["embed.weight"]


class TwoLayers(nn.Module):
    def __init__(self, reverse: bool) -> None:
        super().__init__()
        names = ["b", "a"] if reverse else ["a", "b"]
        for name in names:  # definition order decides parameters() order
            self.add_module(name, nn.Linear(3, 3))

    def forward(self, x):
        return self.b(self.a(x))


def test_optimizer_state_follows_parameter_names_not_positions(ckpt_dir) -> None:
    source = TwoLayers(reverse=False)
    opt = torch.optim.Adam(source.parameters(), lr=0.1)
    train_steps_on(source, opt)
    ddpckpt.save(ckpt_dir, model=source, optimizer=opt)
    target = TwoLayers(reverse=True)
    target_opt = torch.optim.Adam(target.parameters(), lr=0.1)
    ddpckpt.load(ckpt_dir, model=target, optimizer=target_opt)
    for name in ("a.weight", "b.weight"):
        src = opt.state[dict(source.named_parameters())[name]]["exp_avg"]
        dst = target_opt.state[dict(target.named_parameters())[name]]["exp_avg"]
        assert torch.equal(src, dst), name
    # torch's own positional load would have swapped them:
    naive = torch.optim.Adam(target.parameters(), lr=0.1)
    naive.load_state_dict(opt.state_dict())
    assert not torch.equal(
        naive.state[target.a.weight]["exp_avg"], opt.state[source.a.weight]["exp_avg"]
    )


def train_steps_on(model, opt) -> None:
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()


def test_optimizer_name_and_shape_mismatches_are_errors(ckpt_dir) -> None:
    source = TwoLayers(reverse=False)
    opt = torch.optim.Adam(source.parameters())
    train_steps_on(source, opt)
    ddpckpt.save(ckpt_dir, model=source, optimizer=opt)
    target = nn.Sequential()
    target.add_module("a", nn.Linear(3, 3))
    target.add_module("c", nn.Linear(3, 3))
    with pytest.raises(
        StateMismatchError,
        match=r"(?s)optimizer.*missing from the checkpoint \(2\): c.weight, c.bias.*unexpected in the checkpoint \(2\): b.weight, b.bias",
    ):
        ddpckpt.load(
            ckpt_dir, model=target, optimizer=torch.optim.Adam(target.parameters()), strict=False
        )
    with pytest.raises(StateMismatchError, match="not parameters of the model"):
        ddpckpt.load(ckpt_dir, model=source, optimizer=torch.optim.Adam(target.parameters()))
    two_groups = torch.optim.Adam(
        [{"params": source.a.parameters()}, {"params": source.b.parameters()}]
    )
    with pytest.raises(StateMismatchError, match="1 param group"):
        ddpckpt.load(ckpt_dir, model=source, optimizer=two_groups)


OPTIMIZERS = {
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True),
    "AdamW-foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "AdamW-fused": lambda p: torch.optim.AdamW(p, fused=True),
    "AdamW-tensor-lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01)),
    "RMSprop": lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p),
    "NAdam": lambda p: torch.optim.NAdam(p, decoupled_weight_decay=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_roundtrip_with_hyperparameter_types(ckpt_dir, name) -> None:
    model = make_mlp()
    opt = OPTIMIZERS[name](model.parameters())
    train_steps(model, opt)
    opt.param_groups[0]["note"] = ("tuple", 1)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    expected = copy.deepcopy(opt.state_dict())
    train_steps(model, opt)  # the uninterrupted run goes on...
    target = make_mlp(seed=1)
    target_opt = OPTIMIZERS[name](target.parameters())
    ddpckpt.load(ckpt_dir, model=target, optimizer=target_opt)  # ...the resumed one catches up
    got = target_opt.state_dict()
    assert_state_equal(got["state"], expected["state"])
    for g_exp, g_got in zip(expected["param_groups"], got["param_groups"], strict=True):
        assert g_got.keys() == g_exp.keys()
        for key in g_exp:
            assert type(g_got[key]) is type(g_exp[key]), key
            if isinstance(g_exp[key], torch.Tensor):
                assert torch.equal(g_got[key], g_exp[key])
            else:
                assert g_got[key] == g_exp[key], key
    train_steps(target, target_opt)
    assert_state_equal(target.state_dict(), model.state_dict())


def test_restored_optimizer_state_is_private_memory(ckpt_dir) -> None:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    target = make_mlp(1)
    target_opt = torch.optim.Adam(target.parameters())
    ddpckpt.load(ckpt_dir, model=target, optimizer=target_opt)
    storage_for(ckpt_dir).delete_tree(ckpt_dir)  # the state must not depend on the files
    train_steps(target, target_opt)
    for state in target_opt.state.values():
        state["exp_avg"].add_(1)  # writable, resizable ordinary tensors
        assert state["exp_avg"].untyped_storage().resizable()


def test_grad_scaler_state_is_exact(ckpt_dir) -> None:
    model = make_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    ddpckpt.save(ckpt_dir, model=model, scaler=scaler)
    target = torch.amp.GradScaler("cpu")
    ddpckpt.load(ckpt_dir, model=make_mlp(), scaler=target)
    assert target.state_dict() == scaler.state_dict()
    assert target.state_dict()["_growth_tracker"] == 3


def test_rng_streams_continue_exactly(ckpt_dir) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, model=model)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ddpckpt.load(ckpt_dir, model=model)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_rng_can_be_left_alone(ckpt_dir) -> None:
    model = make_mlp()
    ddpckpt.save(ckpt_dir, model=model, rng=False)
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    ddpckpt.load(ckpt_dir, model=model, rng=False)
    assert torch.equal(torch.rand(2), expected)


def test_objects_not_passed_are_left_alone(ckpt_dir) -> None:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt, extra={"n": 1})
    evaluation = make_mlp(seed=7)
    ddpckpt.load(ckpt_dir, model=evaluation)  # a model alone, for evaluation
    assert torch.equal(evaluation[0].weight, model[0].weight)


def test_a_resume_reads_into_the_optimizers_own_tensors(ckpt_dir) -> None:
    """The resume case: the optimizer has state (it stepped since the save), so its tensors
    take the checkpoint's values in place; a fresh one gets new tensors."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    saved = copy.deepcopy(opt.state_dict())
    train_steps(model, opt)  # the live state now differs from the checkpoint
    live = {(p, k): v for p, s in opt.state.items() for k, v in s.items()}
    ddpckpt.load(ckpt_dir, model=model, optimizer=opt)
    assert all(opt.state[p][k] is v for (p, k), v in live.items())
    for index, values in saved["state"].items():
        assert_state_equal(opt.state_dict()["state"][index], values)


def test_a_load_that_fails_after_writing_is_partly_restored_and_saving_waits_for_a_good_load(
    ckpt_root,
) -> None:
    """A byte flipped in the optimizer's file, read after the model's: the load used to raise
    CorruptCheckpointError, as for a checkpoint that could not be read at all, so
    ``except CorruptCheckpointError: start fresh`` trained on the damaged checkpoint's
    weights and a half-restored optimizer (and saved them)."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    good, damaged = str(ckpt_root / "step-1"), str(ckpt_root / "step-2")
    ddpckpt.save(good, model=model, optimizer=opt, step=1)
    expected = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train_steps(model, opt)
    ddpckpt.save(damaged, model=model, optimizer=opt, step=2)
    saved_2 = copy.deepcopy(opt.state_dict())
    train_steps(model, opt)  # the live state now differs from both
    state_file = os.path.join(damaged, "state-00000.safetensors")
    flip_byte(state_file, storage_for(state_file).size(state_file) - 3)  # the last tensor read
    with pytest.raises(PartiallyRestoredError) as raised:
        ddpckpt.load(damaged, model=model, optimizer=opt)
    error = raised.value
    assert not isinstance(error, CorruptCheckpointError)  # never taken for "nothing loaded"
    assert isinstance(error.__cause__, CorruptCheckpointError)
    message = str(error)
    assert "checksum mismatch" in message and "exp_avg_sq" in message and state_file in message
    assert "partly restored from this checkpoint" in message and damaged in message
    assert "Load a checkpoint into them" in message
    first = opt.param_groups[0]["params"][0]
    assert torch.equal(opt.state[first]["exp_avg"], saved_2["state"][0]["exp_avg"])  # in place

    # Saving them is refused, by save() and by a Checkpointer, before anything is written.
    with pytest.raises(
        PartiallyRestoredError, match=f"refusing to save model 'model', .*{damaged}"
    ):
        ddpckpt.save(ckpt_root / "step-3", model=model, optimizer=opt, step=3)
    with pytest.raises(PartiallyRestoredError, match="refusing to save"):
        ddpckpt.save(ckpt_root / "weights", model=model)  # the model alone too
    run = ddpckpt.Checkpointer(ckpt_root / "run", model=model, optimizer=opt)
    with run as ckpt, pytest.raises(PartiallyRestoredError, match="refusing to save"):
        ckpt.save(3)
    assert not storage_for(str(ckpt_root)).exists(str(ckpt_root / "step-3"))
    assert not storage_for(str(ckpt_root)).exists(str(ckpt_root / "weights"))

    # A failed load into them that wrote nothing leaves the mark; a good load clears it.
    with pytest.raises(CheckpointNotFoundError):
        ddpckpt.load(ckpt_root / "nothing", model=model, optimizer=opt)
    with pytest.raises(PartiallyRestoredError):
        ddpckpt.save(ckpt_root / "step-3", model=model, optimizer=opt, step=3)
    ddpckpt.load(good, model=model, optimizer=opt)
    assert_state_equal(model.state_dict(), expected[0])
    assert_state_equal(opt.state_dict(), expected[1])
    ddpckpt.save(ckpt_root / "step-3", model=model, optimizer=opt, step=3)


def test_objects_of_other_loads_are_not_marked_and_the_inner_module_is(ckpt_dir) -> None:
    """The mark is by identity: a model built afresh saves, the module inside a wrapper of a
    partly restored one does not; an object that is unhashable or has no weak reference
    (an ``extra`` entry) is marked all the same."""

    class Unhashable(Counter):
        __hash__ = None  # type: ignore[assignment]

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Unhashable) and self.seen == other.seen

    class Slotted:
        __slots__ = ("n",)

        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    model, opt = make_mlp(), None
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    extra = {"data": Unhashable(), "slotted": Slotted()}
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt, extra=extra)
    state_file = os.path.join(ckpt_dir, "state-00000.safetensors")
    flip_byte(state_file, storage_for(state_file).size(state_file) - 3)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(PartiallyRestoredError):
        ddpckpt.load(ckpt_dir, model=compiled, optimizer=opt, extra=extra)
    with pytest.raises(PartiallyRestoredError, match="refusing to save model 'model'"):
        ddpckpt.save(ckpt_dir + "-inner", model=model)  # the module inside torch.compile
    for name in extra:
        with pytest.raises(PartiallyRestoredError, match=f"extra\\[{name!r}\\]"):
            ddpckpt.save(ckpt_dir + "-x", model=make_mlp(), extra={name: extra[name]})
    ddpckpt.save(ckpt_dir + "-fresh", model=make_mlp())


def test_a_load_that_fails_before_writing_raises_what_it_is_and_marks_nothing(ckpt_root) -> None:
    """A manifest whose metrics refer to a tensor: found before any object is written (it
    used to be found once the objects were restored, the last thing a load does)."""
    from hostile import edit_manifest

    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    path = ckpt_root / "ckpt"
    ddpckpt.save(path, model=model, optimizer=opt, metrics={"loss": 0.5})
    edit_manifest(path, lambda doc: doc["metrics"].update(loss={"$tensor": "model/0.weight"}))
    fresh = make_mlp(seed=1)
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(CorruptCheckpointError, match="metrics refer to a tensor") as raised:
        ddpckpt.load(path, model=fresh)
    assert not isinstance(raised.value, PartiallyRestoredError)
    assert_state_equal(fresh.state_dict(), before)  # untouched
    ddpckpt.save(ckpt_root / "other", model=fresh)  # not marked


def test_load_waits_for_a_checkpointers_overlap_save_still_copying(ckpt_root, monkeypatch) -> None:
    """A rollback (ddpckpt.load) while a Checkpointer's overlap save was still copying the
    parameters: load() waited for the default saver only, so the save copied a mix of the
    state at save() and the loaded values."""
    import ddpckpt._io.staging as staging

    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt)
    rollback = str(ckpt_root / "rollback")
    ddpckpt.save(rollback, model=model, optimizer=opt)  # what a loss spike rolls back to
    train_steps(model, opt)
    at_save = copy.deepcopy(model.state_dict())
    real_copy = staging._copy
    release = threading.Event()

    def held_copy(pairs):
        if pairs and threading.current_thread().name == "ddpckpt-snapshot":
            assert release.wait(30)
        real_copy(pairs)

    monkeypatch.setattr(staging, "_copy", held_copy)
    with ddpckpt.Checkpointer(
        ckpt_root / "run", model=model, optimizer=opt, async_save="overlap"
    ) as ckpt:
        ckpt.save(1)  # returns with the parameters' copies held back
        opener = threading.Timer(0.5, release.set)
        opener.start()
        try:
            ddpckpt.load(rollback, model=model, optimizer=opt)  # must wait for the copies
        finally:
            release.set()
            opener.join()
        ckpt.wait()
    saved = ddpckpt.load_state_dict(ckpt_root / "run" / "step-00000001")
    for key, value in at_save.items():
        assert torch.equal(saved[key], value), key


@pytest.mark.disk_only("the peak resident memory of reading files, not of an in-memory store")
def test_a_resume_holds_the_state_once_at_its_peak(ckpt_dir) -> None:
    """Loading into a model and optimizer that already hold state (a resume) adds at its
    peak far less than the state's size: nothing is read into second tensors or mapped.
    It added the optimizer state (new tensors beside the live ones) and the mapped model
    files before."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))  # 16 MiB of weights
    opt = torch.optim.AdamW(model.parameters())
    one_step(model, opt, torch.randn(2, 1024))
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    expected = copy.deepcopy(opt.state_dict()["state"])
    one_step(model, opt, torch.randn(2, 1024))
    extra = peak_extra_resident(lambda: ddpckpt.load(ckpt_dir, model=model, optimizer=opt))
    assert extra < 0.2 * state_bytes, f"{extra / 2**20:.0f} MiB for {state_bytes / 2**20:.0f}"
    for index, values in expected.items():
        assert_state_equal(opt.state_dict()["state"][index], values)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    opt.zero_grad()
    model(batch).sum().backward()
    opt.step()


def peak_extra_resident(call) -> int:
    """The most resident memory ``call`` added over what the process held before (Linux:
    the high-water mark, reset first)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status_kib("VmRSS")
    call()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def test_a_checkpoint_deleted_while_it_is_loaded_is_not_found_not_corrupt(
    ckpt_root, monkeypatch
) -> None:
    """An evaluator's latest() + load() on a live run: the writer's retention deletes the
    checkpoint after latest() chose it. The load used to raise CorruptCheckpointError ("rank
    0's file is missing"), telling the user their checkpoint was damaged."""
    path = str(ckpt_root / "step-3")
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(path, model=model, optimizer=opt, step=3)
    store = storage_for(path)
    real_open = type(store).open

    def open_after_retention(self, location: str):
        if location.startswith(path) and not location.endswith("manifest.json"):
            self.delete_tree(path)
        return real_open(self, location)

    monkeypatch.setattr(type(store), "open", open_after_retention)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being loaded"):
        ddpckpt.load(path, model=make_mlp(seed=1), optimizer=opt)


def test_a_checkpoint_saved_again_while_it_is_loaded_is_not_called_corrupt(
    ckpt_root, monkeypatch
) -> None:
    """A Checkpointer saving one step twice (every-N and epoch end) replaces it atomically;
    a reader between the two saw the new files against the old manifest, and load() said
    "checksum mismatch ... the file is corrupt"."""
    path = str(ckpt_root / "step-3")
    ddpckpt.save(path, model=make_mlp(seed=0), step=3)
    store = storage_for(path)
    real_open = type(store).open
    replaced = []

    def open_after_a_new_save(self, location: str):
        if not replaced and location.startswith(path) and not location.endswith(".json"):
            replaced.append(location)
            ddpckpt.save(path, model=make_mlp(seed=1), step=3, overwrite=True)
        return real_open(self, location)

    monkeypatch.setattr(type(store), "open", open_after_a_new_save)
    with pytest.raises(CheckpointNotFoundError, match=r"replaced .* while it was being loaded"):
        ddpckpt.load(path, model=make_mlp(seed=2))
    assert replaced


def test_loading_never_unpickles(ckpt_dir, monkeypatch) -> None:
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    train_steps(model, opt)
    ddpckpt.save(ckpt_dir, model=model, optimizer=opt, extra={"ema": Counter()})

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    target = make_mlp()
    ddpckpt.load(
        ckpt_dir,
        model=target,
        optimizer=torch.optim.AdamW(target.parameters()),
        extra={"ema": Counter()},
    )
    ddpckpt.load_state_dict(ckpt_dir)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_models_roundtrip(ckpt_dir, dtype) -> None:
    model = make_mlp().to(dtype)
    model.register_buffer("scale8", torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn))
    ddpckpt.save(ckpt_dir, model=model)
    target = make_mlp(seed=3).to(dtype)
    target.register_buffer("scale8", torch.zeros(2, dtype=torch.float8_e4m3fn))
    ddpckpt.load(ckpt_dir, model=target)
    assert_state_equal(target.state_dict(), model.state_dict())


def test_user_journey_compiled_ddp_to_plain_cpu_export_and_import(process_group, tmp_path) -> None:
    """Issue 2's journey: save DDP(compile(model)) + AdamW + scheduler + GradScaler, load into a
    plain CPU model, export for inference, import an old torch.save checkpoint."""
    model = make_mlp(seed=11)
    wrapped = DDP(torch.compile(model, backend="eager"))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    scaler = torch.amp.GradScaler("cpu")
    train_steps(wrapped, opt, scheduler=sched)
    path = ddpckpt.save(
        tmp_path / "run", model=wrapped, optimizer=opt, scheduler=sched, scaler=scaler, step=3
    )

    plain = make_mlp(seed=12)
    plain_opt = torch.optim.AdamW(plain.parameters())
    plain_sched = torch.optim.lr_scheduler.OneCycleLR(plain_opt, max_lr=1e-2, total_steps=10)
    ddpckpt.load(
        path,
        model=plain,
        optimizer=plain_opt,
        scheduler=plain_sched,
        scaler=torch.amp.GradScaler("cpu"),
    )
    assert_state_equal(plain.state_dict(), model.state_dict())
    assert plain_sched.get_last_lr() == sched.get_last_lr()

    from ddpckpt._cli.export import export

    weights = torch.load(export(path, os.fspath(tmp_path / "model.pt")), weights_only=True)
    assert_state_equal(weights, model.state_dict())

    from ddpckpt._convert.legacy import import_checkpoint

    torch.save(
        {"state_dict": wrapped.state_dict(), "optimizer": opt.state_dict(), "epoch": 1},
        tmp_path / "old.pth",
    )
    imported, _ = import_checkpoint(tmp_path / "old.pth", tmp_path / "imported")
    fresh = make_mlp(seed=13)
    ddpckpt.load(imported, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert_state_equal(fresh.state_dict(), model.state_dict())


@pytest.mark.long
def test_a_load_partial_on_one_rank_is_partial_on_every_rank(tmp_path) -> None:
    """Rank 1's copy of the optimizer's file is damaged, rank 0's is sound (memory:// is per
    process): rank 0 restores everything, rank 1 part of it. Both raise
    PartiallyRestoredError and refuse to save, and load_latest restores step 1 exactly on
    both (the job's state must never be step 2 on one rank and a mix on the other)."""
    from pathlib import Path

    from launch import forked_ranks

    worker = Path(__file__).resolve().parents[1] / "support" / "partial_worker.py"
    launch = forked_ranks("partial", tmp_path / "out", worker=worker, timeout=180).ok()
    for rank in (0, 1):
        seen = launch.result(rank)
        assert seen["load"].startswith("PartiallyRestoredError from CorruptCheckpointError")
        assert "checksum mismatch" in seen["load"] and "(on rank 1)" in seen["load"], seen
        assert seen["save"].startswith("PartiallyRestoredError"), seen["save"]
        assert "refusing to save" in seen["save"]
        assert seen["latest_step"] == 1 and seen["exact"] is True
        assert seen["save_after"] == "ok"
    assert launch.result(0)["load"] == launch.result(1)["load"]
