"""ddpckpt.integrations.lightning against the real Lightning: a DDP run SIGKILLed inside an
epoch resumes bit for bit; the CheckpointIO on its own; a missing Lightning."""

from __future__ import annotations

import pickle
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpckpt
from killed_run import assert_resumed_exactly, launch_killed_run
from launch import WORKER

# Lightning is imported by the tests that run, not at collection (every xdist worker collects).
pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="no lightning extra")
SCRIPT = WORKER.with_name("lightning_worker.py")


@pytest.fixture(autouse=True)
def _signal_handlers() -> Any:
    """Lightning's Trainer installs signal handlers it removes only in a teardown a failing
    fit may skip: put the process's back, so that one failure stays one failure."""
    import signal

    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for number, handler in kept.items():
        signal.signal(number, handler)


@pytest.fixture
def io() -> Any:
    from ddpckpt.integrations.lightning import DdpckptCheckpointIO

    return DdpckptCheckpointIO()


@pytest.mark.long
def test_a_run_killed_inside_an_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    run = launch_killed_run(SCRIPT, tmp_path)
    assert_resumed_exactly(run, resumed_from=9, steps=7)  # inside the second epoch of 8 steps
    steps = [step for step, metrics in run.result(0)["logged"]]
    assert steps == [12, 12, 15, 15]  # the checkpoints after the resume, and last.ckpt
    for _, metrics in run.result(0)["logged"]:
        assert metrics["checkpoint/size_bytes"] > 0 and metrics["checkpoint/verified"] == 1.0
    last = tmp_path / "checkpoints-ddpckpt" / "last.ckpt"
    assert (last / "manifest.json").is_file()
    ddpckpt.verify(str(last))


@pytest.mark.long
@pytest.mark.parametrize("mode", ["onecycle", "reload"])
def test_loaders_set_up_early_or_again_resume_bit_for_bit(tmp_path: Path, mode: str) -> None:
    """onecycle: Lightning's documented OneCycleLR(total_steps=self.trainer.
    estimated_stepping_batches) sets the train loaders up during strategy.setup, before the
    loops are restored: the saved position was applied at epoch 0 and none of the steps
    after the resume matched. reload: reload_dataloaders_every_n_epochs=1 builds them anew
    at every epoch, from the random streams of that moment (the targets are drawn there):
    the resumed run built them from other streams."""
    run = launch_killed_run(SCRIPT, tmp_path, mode=mode)
    assert_resumed_exactly(run, resumed_from=9, steps=7)


def test_the_checkpoint_io_round_trips_lightnings_dict(tmp_path: Path, io: Any) -> None:
    from lightning.pytorch.utilities.parsing import AttributeDict

    checkpoint = {
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": AttributeDict(lr=0.1, layers=[4, 2]),
        "epoch": 1,
        "global_step": 9,
    }
    path = tmp_path / "epoch=1-step=9.ckpt"
    io.save_checkpoint(checkpoint, path)
    io.save_checkpoint({**checkpoint, "global_step": 10}, path)  # last.ckpt: saved again
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["global_step"] == 10
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": [4, 2]}
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    assert ddpckpt.latest(tmp_path) == str(path)
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # gone already: nothing to do


def test_a_file_that_is_not_a_checkpoint_is_not_removed(tmp_path: Path, io: Any, caplog) -> None:
    path = tmp_path / "old.ckpt"
    path.write_bytes(b"a torch.save file")
    io.remove_checkpoint(path)
    assert path.exists()
    assert "not a ddpckpt checkpoint" in caplog.text


def test_it_composes_with_lightnings_async_checkpoint_io(tmp_path: Path, io: Any) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    wrapped = AsyncCheckpointIO(io)
    weights = torch.ones(3)
    wrapped.save_checkpoint({"state_dict": {"w": weights}, "global_step": 1}, tmp_path / "a.ckpt")
    weights.add_(1)  # training goes on while the save runs: the checkpoint keeps the old value
    wrapped.teardown()  # waits for the save
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(3))


# ---------------------------------------------------------------- load_from_checkpoint


def _classifier_classes() -> tuple[type, type, type]:
    """A module that saves its hyperparameters, the same with one parameter more, and a data
    module that saves its hyperparameters and a state."""
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Classifier(pl.LightningModule):
        def __init__(self, width: int = 8, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
            self.loaded_step: int | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.cross_entropy(self.net(inputs), targets)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.loaded_step = checkpoint["global_step"]

    class Wider(Classifier):
        def __init__(self, width: int = 8, lr: float = 0.1) -> None:
            super().__init__(width, lr)
            self.extra = nn.Linear(2, 2)

    class Data(pl.LightningDataModule):
        def __init__(self, batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.batches = 0

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(0)
            data = TensorDataset(
                torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,))
            )
            self.batches = len(data) // self.hparams.batch_size
            return DataLoader(data, batch_size=self.hparams.batch_size)

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches = state_dict["batches"]

    return Classifier, Wider, Data


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A Classifier(width=6) trained 4 steps (batches of 4) with DdpckptCheckpointIO, and
    its last.ckpt."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddpckpt.integrations.lightning import DdpckptCheckpointIO

    classifier, _, data = _classifier_classes()
    out = tmp_path_factory.mktemp("lightning-trained")
    model = classifier(width=6)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        plugins=[DdpckptCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)],
    )
    trainer.fit(model, datamodule=data(batch_size=4))
    last = out / "checkpoints" / "last.ckpt"
    assert (last / "manifest.json").is_file()  # a ddpckpt checkpoint directory
    return model, last


def test_load_from_checkpoint_rebuilds_the_trained_module(trained: tuple[Any, Path]) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    model, last = trained
    loaded = load_from_checkpoint(type(model), last)
    assert type(loaded) is type(model)
    assert dict(loaded.hparams) == {"width": 6, "lr": 0.1}  # from save_hyperparameters()
    assert loaded.loaded_step == 4  # its on_load_checkpoint hook ran
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # bit for bit
        assert tensor.device == torch.device("cpu")
    assert load_from_checkpoint(type(model), str(last), map_location="cpu").hparams.width == 6


def test_load_from_checkpoint_keyword_arguments_override_the_hyperparameters(
    trained: tuple[Any, Path],
) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    model, last = trained
    loaded = load_from_checkpoint(type(model), last, lr=0.5)
    assert loaded.hparams.lr == 0.5 and loaded.hparams.width == 6
    assert torch.equal(loaded.net[0].weight, model.net[0].weight)


def test_load_from_checkpoint_hparams_file_overrides_as_lightning(
    trained: tuple[Any, Path], tmp_path: Path
) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    model, last = trained
    (tmp_path / "hparams.yaml").write_text("width: 6\nlr: 0.25\n")
    assert (
        load_from_checkpoint(type(model), last, hparams_file=tmp_path / "hparams.yaml").hparams.lr
        == 0.25
    )


def test_load_from_checkpoint_strict_as_lightning(trained: tuple[Any, Path]) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    model, last = trained
    _, wider, _ = _classifier_classes()
    with pytest.raises(RuntimeError, match="Missing key"):
        load_from_checkpoint(wider, last)  # strict by default: extra.weight is not saved
    with pytest.warns(UserWarning, match=r"not in the checkpoint: \['extra.weight'"):
        loaded = load_from_checkpoint(wider, last, strict=False)
    assert torch.equal(loaded.net[2].bias, model.net[2].bias)


def test_load_from_checkpoint_rebuilds_a_data_module(trained: tuple[Any, Path]) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    *_, data = _classifier_classes()
    loaded = load_from_checkpoint(data, trained[1])
    assert dict(loaded.hparams) == {"batch_size": 4} and loaded.batches == 4
    assert load_from_checkpoint(data, trained[1], batch_size=2).hparams.batch_size == 2


def test_load_from_checkpoint_refuses_a_torch_save_file_unread(tmp_path: Path) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    classifier, *_ = _classifier_classes()
    path = tmp_path / "last.ckpt"
    marker = tmp_path / "unpickled"
    path.write_bytes(pickle.dumps(_TouchOnUnpickle(str(marker))))  # code, were it unpickled
    with pytest.raises(ddpckpt.CheckpointNotFoundError) as caught:
        load_from_checkpoint(classifier, path)
    assert f"Classifier.load_from_checkpoint({str(path)!r})" in str(caught.value)
    assert "torch.save" in str(caught.value)
    assert not marker.exists()


class _TouchOnUnpickle:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize(
    ("key", "named", "trusted", "refusal"),
    [
        ("hyper_parameters", "ddpckpt_hostile_instantiator.build", True, "not in Lightning's allowlist"),
        ("hparams", "ddpckpt_hostile_instantiator.build", True, "not in Lightning's allowlist"),
        ("hyper_parameters", "lightning.pytorch.cli.instantiate_module", False, "trust_instantiator=True"),
        ("hyper_parameters", "ddpckpt_hostile_instantiator.build", False, "trust_instantiator=True"),
    ],
)  # fmt: skip
def test_load_from_checkpoint_refuses_an_instantiator_unless_trusted_and_allowed(
    tmp_path: Path, io: Any, monkeypatch: pytest.MonkeyPatch, key: str, named: str,
    trusted: bool, refusal: str,
) -> None:  # fmt: skip
    import lightning.pytorch as pl

    from ddpckpt.integrations.lightning import load_from_checkpoint

    classifier, *_ = _classifier_classes()
    marker = tmp_path / "imported"
    (tmp_path / "ddpckpt_hostile_instantiator.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\ndef build(cls, kwargs): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "hostile.ckpt"
    hostile = {
        "_instantiator": named,
        "_class_path": "ddpckpt_hostile_instantiator.build",
        "width": 6,
    }
    io.save_checkpoint(
        {
            "pytorch-lightning_version": pl.__version__,
            "state_dict": classifier(width=6).state_dict(),
            key: hostile,
        },
        path,
    )
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=refusal):
        load_from_checkpoint(classifier, path, trust_instantiator=trusted)
    assert not marker.exists()
    assert "ddpckpt_hostile_instantiator" not in sys.modules


@pytest.mark.parametrize(
    ("saved", "refusal"),
    [
        ({"state_dict": {"w": torch.ones(1)}}, "pytorch-lightning_version"),
        ({"pytorch-lightning_version": "1.9.0", "state_dict": {"w": torch.ones(1)}},
         "Lightning 1.9.0 wrote it, older than"),
        ({"pytorch-lightning_version": "2.6.6", "state_dict": {"w": [1.0]}}, "state_dict' of tensors"),
    ],
)  # fmt: skip
def test_load_from_checkpoint_refuses_a_dict_that_is_not_lightnings(
    tmp_path: Path, io: Any, saved: dict, refusal: str
) -> None:
    from ddpckpt.integrations.lightning import load_from_checkpoint

    classifier, *_ = _classifier_classes()
    io.save_checkpoint(saved, tmp_path / "a.ckpt")
    with pytest.raises(ddpckpt.CorruptCheckpointError, match=refusal):
        load_from_checkpoint(classifier, tmp_path / "a.ckpt")


# ---------------------------------------------------------------- ExactResume's own state


def _exact_trainer(
    out: Path, steps: int, io: str, callbacks: tuple = (), **checkpointing: Any
) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from ddpckpt.integrations.lightning import DdpckptCheckpointIO, ExactResume

    plugins = {"ddpckpt-io": [DdpckptCheckpointIO()], "lightning-io": [],
               "async-io": [AsyncCheckpointIO(DdpckptCheckpointIO())]}[io]  # fmt: skip
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out, plugins=plugins,
        callbacks=[ExactResume(), *callbacks,
                   ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=1,
                                   **checkpointing)],
    )  # fmt: skip


def _read(path: Path, io: str) -> dict[str, Any]:
    return torch.load(path, weights_only=True) if io == "lightning-io" else ddpckpt.load_dict(path)


def _saved_states(checkpoints: Path) -> list[str]:
    """The checkpoint each saved state belongs to (its name without the token)."""
    return sorted(p.name.split("@")[0] for p in (checkpoints / ".ddpckpt-ranks").iterdir())


IOS = ["ddpckpt-io", "lightning-io", "async-io"]


@pytest.mark.parametrize("io", IOS)
def test_each_rank_s_state_lives_beside_the_checkpoint_and_goes_with_it(
    tmp_path: Path, io: str
) -> None:
    """The checkpoint keeps a reference, not every rank's state; once a file is written the
    states of its older saves go (last.ckpt, saved at every step), and those of a checkpoint
    Lightning deletes (top-k); a resume reads the state back, and says plainly when it is
    missing or another save's."""
    from ddpckpt.errors import InexactResumeError

    classifier, _, data = _classifier_classes()
    out = tmp_path / "run"
    # Lightning's AsyncCheckpointIO deletes a top-k file at once, and may write it after:
    # with it, every checkpoint is kept
    top_k = -1 if io == "async-io" else 1
    trainer = _exact_trainer(out, 4, io, save_top_k=top_k, monitor="step", mode="max",
                             save_last=True)  # fmt: skip
    trainer.fit(classifier(), datamodule=data(batch_size=4))
    checkpoints = out / "checkpoints"
    kept = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    steps = range(1, 5) if io == "async-io" else [4]
    assert kept == [*(f"epoch=0-step={s}.ckpt" for s in steps), "last.ckpt"]
    assert _saved_states(checkpoints) == kept  # one each: last.ckpt's older ones went
    last = checkpoints / "last.ckpt"
    reference = _read(last, io)["callbacks"]["ddpckpt.ExactResume"]
    assert sorted(reference) == ["id", "saved"], reference  # no rank's state in it
    assert reference["saved"] == f".ddpckpt-ranks/last.ckpt@{reference['id']}"

    resumed = _exact_trainer(tmp_path / "again", 6, io, save_top_k=top_k)
    resumed.fit(classifier(), datamodule=data(batch_size=4), ckpt_path=last)
    assert resumed.global_step == 6

    # evaluating a checkpoint needs none of it (the file alone, copied elsewhere)
    alone = tmp_path / "evaluate" / "last.ckpt"
    alone.parent.mkdir()
    (shutil.copytree if last.is_dir() else shutil.copy)(last, alone)

    class Evaluated(classifier):  # type: ignore[misc, valid-type]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("loss", self.training_step(batch, batch_idx))

    loader = data(batch_size=4).train_dataloader()
    _exact_trainer(tmp_path / "evaluate", 0, io).validate(
        Evaluated(), dataloaders=loader, ckpt_path=alone, verbose=False
    )

    with pytest.raises(InexactResumeError, match=r"is missing \(a checkpoint copied or moved"):
        _exact_trainer(tmp_path / "fourth", 6, io, save_top_k=top_k).fit(
            classifier(), datamodule=data(batch_size=4), ckpt_path=alone
        )


def test_a_save_called_with_keywords_inside_fit_still_saves_every_rank_s_state(
    tmp_path: Path,
) -> None:
    import lightning.pytorch as pl

    class Keywords(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(filepath=tmp_path / "mine.ckpt", weights_only=False)

    classifier, _, data = _classifier_classes()
    trainer = _exact_trainer(tmp_path / "run", 3, "lightning-io", callbacks=(Keywords(),))
    trainer.fit(classifier(), datamodule=data(batch_size=4))
    reference = _read(tmp_path / "mine.ckpt", "lightning-io")["callbacks"]["ddpckpt.ExactResume"]
    assert reference["saved"].startswith(".ddpckpt-ranks/mine.ckpt@")
    resumed = _exact_trainer(tmp_path / "again", 4, "lightning-io")
    resumed.fit(classifier(), datamodule=data(batch_size=4), ckpt_path=tmp_path / "mine.ckpt")
    assert resumed.global_step == 4


def test_a_state_gathered_by_an_earlier_release_still_resumes(tmp_path: Path) -> None:
    """A checkpoint dumped outside Trainer.save_checkpoint holds every rank's state, as
    every checkpoint did before 2026-11-28: it resumes."""
    classifier, _, data = _classifier_classes()
    trainer = _exact_trainer(tmp_path / "run", 2, "lightning-io")
    trainer.fit(classifier(), datamodule=data(batch_size=4))
    dumped = trainer._checkpoint_connector.dump_checkpoint()
    state = dumped["callbacks"]["ddpckpt.ExactResume"]
    assert list(state) == ["ranks"] and len(state["ranks"]) == 1
    torch.save(dumped, tmp_path / "old.ckpt")
    resumed = _exact_trainer(tmp_path / "again", 4, "lightning-io")
    resumed.fit(classifier(), datamodule=data(batch_size=4), ckpt_path=tmp_path / "old.ckpt")
    assert resumed.global_step == 4


def test_a_strategy_that_writes_the_file_itself_still_has_older_states_deleted(
    tmp_path: Path,
) -> None:
    """FSDP's sharded and DeepSpeed's checkpoints bypass the CheckpointIO: the states of a
    file's older saves go once the strategy has returned (they piled up without limit)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from ddpckpt.integrations.lightning import ExactResume

    class WritesItself(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint: Any, filepath: Any, storage_options: Any = None):
            torch.save(checkpoint, filepath)

    import lightning.pytorch as pl

    classifier, _, data = _classifier_classes()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        strategy=WritesItself(device=torch.device("cpu")),
        callbacks=[ExactResume(), ModelCheckpoint(dirpath=tmp_path / "checkpoints",
                                                  every_n_train_steps=1, save_top_k=0,
                                                  save_last=True)],
    )  # fmt: skip
    trainer.fit(classifier(), datamodule=data(batch_size=4))
    assert _saved_states(tmp_path / "checkpoints") == ["last.ckpt"]
    resumed = _exact_trainer(tmp_path / "again", 6, "lightning-io")
    resumed.fit(classifier(), datamodule=data(batch_size=4),
                ckpt_path=tmp_path / "checkpoints" / "last.ckpt")  # fmt: skip
    assert resumed.global_step == 6


def test_a_registered_wrapper_of_the_train_loader_resumes_at_its_next_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A train loader wrapped as Ray Train's ``prepare_data_loader`` wraps it (a registered
    wrapper): ExactResume looked for the tracking on the wrapper, which has none (an
    AttributeError at the first fit), instead of on the loader it wraps."""
    from torch.utils.data import DataLoader

    from ddpckpt._training import loader as loader_module

    class Prefetching(DataLoader):  # shaped as Ray's: the loader in _dataloader, none held
        def __init__(self, base: DataLoader) -> None:
            super().__init__(base.dataset, batch_size=base.batch_size)
            self._dataloader, self.next_batch = base, None

        def __iter__(self) -> Any:
            yield from self._dataloader

    monkeypatch.setitem(loader_module._WRAPPERS, Prefetching, ("_dataloader", "next_batch"))
    classifier, _, data = _classifier_classes()
    seen: list[list[float]] = []

    class Recording(classifier):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[0][:, 0].tolist())
            return super().training_step(batch, batch_idx)

    class Wrapped(data):  # type: ignore[misc, valid-type]
        def train_dataloader(self) -> DataLoader:
            base = super().train_dataloader()
            return Prefetching(DataLoader(base.dataset, batch_size=2, shuffle=True))

    def fit(out: Path, steps: int, ckpt_path: Path | None = None) -> list[list[float]]:
        seen.clear()
        torch.manual_seed(0)
        _exact_trainer(out, steps, "lightning-io", save_last=True).fit(
            Recording(), datamodule=Wrapped(), ckpt_path=ckpt_path
        )
        return list(seen)

    uninterrupted = fit(tmp_path / "straight", 6)
    fit(tmp_path / "run", 3)
    resumed = fit(tmp_path / "again", 6, ckpt_path=tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert len(uninterrupted) == 6 and resumed == uninterrupted[3:]
