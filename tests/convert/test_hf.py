"""Importing a Hugging Face Trainer checkpoint-N and an Accelerate save_state directory, made
by the real packages: the import resumes as the framework's own resume does (weights,
moments, schedule, every process's random streams), runs none of their pickles, and names
what it leaves out."""

from __future__ import annotations

import os
import random
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch

import ddpckpt
from ddpckpt._convert.hf import read_safetensors
from ddpckpt._convert.legacy import import_checkpoint
from ddpckpt._format.codec import decode
from ddpckpt._format.manifest import read_manifest
from ddpckpt._format.rankparts import rank_part
from ddpckpt.errors import CorruptCheckpointError
from ddpckpt.storage._location import locate
from io_helpers import Counter

needs_transformers = pytest.mark.skipif(
    find_spec("transformers") is None, reason="no transformers extra"
)
needs_accelerate = pytest.mark.skipif(find_spec("accelerate") is None, reason="no accelerate")


# ------------------------------------------------------------------ the Trainer


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 8) % 32
        return {"input_ids": ids, "labels": ids}


def _trainer(cls, directory: Path, stop_at: int | None = None):
    """A tiny GPT-2 (dropout on: the random streams matter) for 6 steps on CPU, saved every
    2 steps, stopped after ``stop_at`` as a killed job would be."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = stop_at is not None and state.global_step >= stop_at

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                       n_head=2))  # fmt: skip
    args = TrainingArguments(
        output_dir=str(directory), per_device_train_batch_size=2, max_steps=6,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, warmup_steps=1,
    )  # fmt: skip
    return cls(model=model, args=args, train_dataset=_Tokens(), callbacks=[Stop()])


def _losses(trainer, after: int) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > after]


@needs_transformers
def test_a_trainer_checkpoint_resumes_under_ddpckpt_as_under_the_trainers_own_resume(
    tmp_path: Path,
) -> None:
    from transformers import Trainer

    from ddpckpt.integrations.transformers import DdpckptTrainer

    _trainer(Trainer, tmp_path / "hf", stop_at=4).train()
    source = tmp_path / "hf" / "checkpoint-4"
    own = _trainer(Trainer, tmp_path / "hf")
    own.train(resume_from_checkpoint=str(source))

    imported = import_checkpoint(source, tmp_path / "ddp" / "checkpoint-4")
    assert imported[1] == [
        "generation_config.json (written for from_pretrained, not needed to resume; it stays "
        "in the source)",
        "training_args.bin (the Trainer's TrainingArguments, a pickle of its classes; the "
        "resumed run takes the arguments its script gives)",
    ]
    ours = _trainer(DdpckptTrainer, tmp_path / "ddp")
    ours.train(resume_from_checkpoint=True)

    assert ours.state.global_step == own.state.global_step == 6
    assert _losses(ours, 4) == _losses(own, 4) and len(_losses(own, 4)) == 2
    for (name, a), (_, b) in zip(ours.model.named_parameters(), own.model.named_parameters(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    for a, b in zip(ours.optimizer.state.values(), own.optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert ours.lr_scheduler.state_dict() == own.lr_scheduler.state_dict()


def _save_rng(path: Path, seed: int) -> dict:
    """A Trainer's rng_state file of a process seeded with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "cpu": torch.random.get_rng_state()}  # fmt: skip
    torch.save(state, path)
    return state


@needs_transformers
def test_each_processs_random_streams_become_that_ranks_own(tmp_path: Path) -> None:
    source = tmp_path / "checkpoint-4"
    _trainer(
        __import__("transformers").Trainer, tmp_path / "hf", stop_at=2
    ).train()  # one process's checkpoint-2
    shutil.copytree(tmp_path / "hf" / "checkpoint-2", source)
    os.remove(source / "rng_state.pth")
    saved = [_save_rng(source / f"rng_state_{rank}.pth", seed=rank + 10) for rank in range(3)]

    path, _ = import_checkpoint(source, tmp_path / "out")
    manifest = read_manifest(locate(path))
    assert manifest.world_size == 3
    for rank in range(3):
        state = rank_part(manifest, locate(path), rank)
        tensors = read_safetensors(os.path.join(path, f"rank-{rank:05d}.safetensors"))
        run = decode(state["extra"]["run"], lambda name, r=rank, t=tensors: t[f"rank{r}/{name}"])
        streams = run["rng"]
        assert streams["python"] == saved[rank]["python"]
        assert torch.equal(streams["torch"], saved[rank]["cpu"])
        key = streams["numpy"]["state"]["key"].numpy().astype(np.uint32)
        assert np.array_equal(key, saved[rank]["numpy"][1])


# ------------------------------------------------------------------ Accelerate


def _accelerated(seed: int = 0):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4)
    accelerator = Accelerator(cpu=True)
    counter = Counter()  # registered for checkpointing, as Accelerate's docs show
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    return accelerator, model, optimizer, scheduler, loader, counter


def _steps(accelerator, model, optimizer, scheduler, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@needs_accelerate
@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod."])
def test_an_accelerate_save_state_resumes_under_ddpckpt_as_under_accelerates_load_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, prefix: str
) -> None:
    """``prefix``: Accelerate saves a DDP or compiled model with its wrapper's prefix."""
    from safetensors.torch import load_file, save_file

    from ddpckpt.integrations.accelerate import load_state

    accelerator, model, optimizer, scheduler, _, counter = _accelerated()
    _steps(accelerator, model, optimizer, scheduler, 3)
    counter.seen = 3
    accelerator.save_state(str(tmp_path / "state"))
    shutil.copytree(tmp_path / "state", tmp_path / "own")  # for Accelerate's own load
    weights = tmp_path / "state" / "model.safetensors"
    save_file({prefix + k: v for k, v in load_file(weights).items()}, weights)

    accelerator, model, optimizer, scheduler, _, counter = _accelerated(seed=1)
    accelerator.load_state(str(tmp_path / "own"))
    own = (
        _steps(accelerator, model, optimizer, scheduler, 2),
        [p.detach().clone() for p in model.parameters()],
    )

    path, left_out = import_checkpoint(tmp_path / "state", tmp_path / "imported")
    assert left_out == []
    accelerator, model, optimizer, scheduler, _, counter = _accelerated(seed=2)
    load_state(accelerator, path)
    assert counter.seen == 3
    ours = (
        _steps(accelerator, model, optimizer, scheduler, 2),
        [p.detach().clone() for p in model.parameters()],
    )

    assert ours[0] == own[0]  # dropout draws from the restored stream
    assert all(torch.equal(a, b) for a, b in zip(ours[1], own[1], strict=True))
    warned = [r.getMessage() for r in caplog.records if "DataLoader" in r.getMessage()]
    assert warned == [
        f"{path} holds no DataLoader position (it was imported, from a format that saves "
        "none, such as Accelerate's save_state): the prepared DataLoaders start from their "
        "beginning; skip the batches already trained with accelerator.skip_first_batches, as "
        "with Accelerate's own load_state"
    ]


def _two_models(seed: int):
    """Two models, each with its optimizer and scheduler, as a GAN's script prepares them."""
    from accelerate import Accelerator

    torch.manual_seed(seed)
    models = [torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh())]
    optimizers = [torch.optim.AdamW(models[0].parameters(), lr=1e-2),
                  torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.9)]  # fmt: skip
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(*models, *optimizers, *schedulers)
    return accelerator, prepared[:2], prepared[2:4], prepared[4:]


def _two_model_steps(accelerator, models, optimizers, schedulers, n: int) -> list[float]:
    losses = []
    for step in range(n):
        inputs = torch.Generator().manual_seed(step)
        loss = models[1](models[0](torch.randn(2, 4, generator=inputs))).pow(2).mean()
        accelerator.backward(loss)
        for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@needs_accelerate
def test_a_save_state_of_two_models_resumes_each_under_ddpckpt_as_under_accelerate(
    tmp_path: Path,
) -> None:
    """model_1.safetensors, optimizer_1.bin, scheduler_1.bin: named model0/model1 ... as
    ddpckpt's Accelerate integration names several prepared objects."""
    from ddpckpt.integrations.accelerate import load_state

    objects = _two_models(0)
    _two_model_steps(*objects, 3)
    objects[0].save_state(str(tmp_path / "state"))
    assert (tmp_path / "state" / "model_1.safetensors").exists()

    objects = _two_models(1)
    objects[0].load_state(str(tmp_path / "state"))
    own = _two_model_steps(*objects, 2), [p.clone() for m in objects[1] for p in m.parameters()]

    path, left_out = import_checkpoint(tmp_path / "state", tmp_path / "imported")
    assert left_out == []
    objects = _two_models(2)
    load_state(objects[0], path)
    ours = _two_model_steps(*objects, 2), [p.clone() for m in objects[1] for p in m.parameters()]
    assert ours[0] == own[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], own[1], strict=True))

    (tmp_path / "state" / "optimizer.bin").unlink()  # optimizer_1.bin without the first
    with pytest.raises(CorruptCheckpointError, match=r"optimizer_1.bin without every optimizer"):
        import_checkpoint(tmp_path / "state", tmp_path / "again")


# ------------------------------------------------------------------ nothing of theirs runs


def _trainer_directory(tmp_path: Path, weights: bool = True) -> Path:
    """A ``checkpoint-2`` of the Trainer's layout at its smallest: its state and, unless
    not ``weights``, a model; the test adds the file it is about."""
    directory = tmp_path / "checkpoint-2"
    directory.mkdir()
    (directory / "trainer_state.json").write_text('{"global_step": 2}')
    if weights:
        torch.save({"w": torch.ones(2)}, directory / "pytorch_model.bin")
    return directory


def test_a_random_stream_file_naming_a_function_is_refused_before_it_runs(tmp_path: Path) -> None:
    directory = _trainer_directory(tmp_path)
    torch.save({"python": os.getcwd, "cpu": torch.get_rng_state()}, directory / "rng_state.pth")
    with pytest.raises(
        ddpckpt.errors.UnsafeCheckpointError, match=r"rng_state\.pth.*posix\.getcwd"
    ):
        import_checkpoint(directory, tmp_path / "out")


class _HugeArray:
    """Pickles as numpy's array rebuild asked for a terabyte (numpy allocates the shape)."""

    def __reduce__(self):
        return (np._core.multiarray._reconstruct, (np.ndarray, (1 << 40,), b"b"))


def test_an_array_declared_huge_in_a_random_stream_file_is_refused(tmp_path: Path) -> None:
    directory = _trainer_directory(tmp_path)
    torch.save({"python": random.getstate(), "numpy": ("MT19937", _HugeArray(), 0, 0, 0.0),
                "cpu": torch.get_rng_state()}, directory / "rng_state.pth")  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match=r"rng_state\.pth: refused: .*rebuilt as"):
        import_checkpoint(directory, tmp_path / "out")


class _CallsArray:
    """Pickles as a direct call of numpy.ndarray (a 10 KB file asking for 80 MB of objects)."""

    def __reduce__(self):
        return (np.ndarray, ((10**7,), "O"))


@pytest.mark.parametrize(
    "numpy_state",
    [
        ("MT19937", _CallsArray(), 0, 0, 0.0),
        ("MT19937", np.array([1, "x"], dtype=object), 0, 0, 0.0),
        ("MT19937", np.zeros(3, dtype=[("a", "u4"), ("b", "O")]), 0, 0, 0.0),
    ],
    ids=["ndarray-called", "object-array", "structured-array"],
)
def test_a_random_stream_file_using_numpy_beyond_arrays_of_numbers_is_refused(
    tmp_path: Path, numpy_state: tuple
) -> None:
    directory = _trainer_directory(tmp_path)
    torch.save({"python": random.getstate(), "numpy": numpy_state,
                "cpu": torch.get_rng_state()}, directory / "rng_state.pth")  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match=r"rng_state\.pth: refused: .*numpy"):
        import_checkpoint(directory, tmp_path / "out")


def test_a_random_stream_file_in_torchs_old_format_is_refused(tmp_path: Path) -> None:
    directory = _trainer_directory(tmp_path)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "cpu": torch.get_rng_state()}, directory / "rng_state.pth",
               _use_new_zipfile_serialization=False)  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match=r"rng_state\.pth: not in torch's zip"):
        import_checkpoint(directory, tmp_path / "out")


def test_a_file_of_the_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    directory = _trainer_directory(tmp_path, weights=False)
    torch.save({"w": torch.ones(2)}, tmp_path / "elsewhere.bin")
    os.symlink(tmp_path / "elsewhere.bin", directory / "pytorch_model.bin")
    with pytest.raises(CorruptCheckpointError, match=r"pytorch_model\.bin: a symbolic link"):
        import_checkpoint(directory, tmp_path / "out")


@needs_transformers
@pytest.mark.processes
def test_a_two_process_trainer_checkpoint_gives_each_rank_its_own_streams_back(
    tmp_path: Path,
) -> None:
    """Each process's dropout masks after the resume come from its own saved stream: the
    losses of both ranks (their own batches and masks) and the weights are those of the
    Trainer's own resume."""
    from launch import forked_ranks

    worker = Path(__file__).parents[1] / "support" / "hf_import_worker.py"
    run = ["--dir", str(tmp_path)]
    forked_ranks("train", tmp_path / "train", args=run, worker=worker, timeout=240).ok()
    import_checkpoint(tmp_path / "hf" / "checkpoint-4", tmp_path / "ddp" / "checkpoint-4")
    own = forked_ranks("own", tmp_path / "own", args=run, worker=worker, timeout=240).ok()
    ours = forked_ranks("ours", tmp_path / "ours", args=run, worker=worker, timeout=240).ok()
    assert own.result(0)["losses"] != own.result(1)["losses"]
    assert len(own.result(0)["losses"]) == 4
    for rank in (0, 1):
        assert ours.result(rank) == own.result(rank), rank


def test_a_directory_without_an_optimizer_file_imports_with_a_warning_saying_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = _trainer_directory(tmp_path)
    torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()},
               directory / "rng_state.pth")  # fmt: skip
    import_checkpoint(directory, tmp_path / "out")
    assert any(
        "holds no optimizer.pt" in r.getMessage() and "has no optimizer state" in r.getMessage()
        for r in caplog.records
    )


def test_random_streams_without_numpy_installed_say_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch does not require numpy; a plain install of ddpckpt may lack it."""
    directory = _trainer_directory(tmp_path)
    torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()},
               directory / "rng_state.pth")  # fmt: skip
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"install numpy .*ddpckpt\[numpy\]"):
        import_checkpoint(directory, tmp_path / "out")


def test_a_source_that_does_not_exist_is_named_as_missing(tmp_path: Path) -> None:
    with pytest.raises(ddpckpt.CheckpointNotFoundError, match="checkpoint-9: no such file"):
        import_checkpoint(tmp_path / "checkpoint-9", tmp_path / "out")
