"""Lightning's ``ExactResume`` callback (public as
:class:`ddpckpt.integrations.lightning.ExactResume`): what a Lightning checkpoint lacks for an
exact mid-epoch resume, each rank's random streams and train DataLoader position, saved by
each rank beside the checkpoint (:mod:`ddpckpt.integrations._rank_files`)."""

from __future__ import annotations

from ddpckpt.integrations._require import require

require("lightning", "PyTorch Lightning", "lightning")

import os  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from typing import Any, Protocol, cast  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.utilities.data import _set_sampler_epoch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from ddpckpt._log import current_rank, get_logger  # noqa: E402
from ddpckpt._training.loader import track_loader, tracked_loader  # noqa: E402
from ddpckpt.errors import (  # noqa: E402
    CorruptCheckpointError,
    InexactResumeError,
    StateMismatchError,
)
from ddpckpt.events import SaveEvent, add_listener  # noqa: E402
from ddpckpt.integrations._rank_files import (  # noqa: E402
    SIDECARS,
    load_own,
    prune_own,
    save_own,
    token_of,
)
from ddpckpt.integrations._ranks import (  # noqa: E402
    capture_streams,
    continued_streams,
    gather,
    own_streams,
    restore_streams,
)

_log = get_logger("ddpckpt.integrations.lightning")


class _Tracked(Protocol):
    """A train DataLoader after :func:`track_loader`, whose class it swapped for one that
    saves and restores its position (no static type knows that class)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ExactResume(Callback):
    """What a Lightning checkpoint lacks for an exact resume, saved in it: ``callbacks=[ExactResume()]``.

    At every checkpoint it stores, for every rank, the random streams (Python, numpy, torch,
    CUDA) and the position of each train DataLoader: the batches training consumed in the
    current epoch, the random states the sampler's order and the loader workers' seed were
    drawn from. Resuming from it (``trainer.fit(model, ckpt_path=...)``), every rank
    continues after the last batch it trained on, without loading the skipped samples,
    with the next batch and the random numbers an uninterrupted run would have used.

    What it changes in a run: the train loaders are tracked by ddpckpt (``len()`` stays
    the whole epoch); validation inside ``fit`` runs on a copy of the random streams (as
    Lightning's sanity check does), so where validation happens does not change training's
    randomness; at each checkpoint every rank saves its own state, about 21 kB, in a ddpckpt
    checkpoint beside Lightning's (under ``.ddpckpt-ranks/`` in its directory: keep the two
    together when you copy a checkpoint), and Lightning's checkpoint keeps a reference to it,
    so no rank's cost grows with the number of ranks; once a file is written its older
    saves' states are deleted, and those of a checkpoint Lightning deletes with it (the
    collective calls are bounded by ``timeout``, default ``$DDPCKPT_TIMEOUT`` or 600 s).
    ``validate``, ``test`` and ``predict`` from a checkpoint need none of it. A checkpoint
    saved other than through ``Trainer.save_checkpoint`` in ``fit`` (after ``fit``, or a
    ``dump_checkpoint`` of your own) gathers every rank's state at rank 0 into it instead,
    as releases before 2026-11-28 did; both resume.
    With ``log_checkpoints`` every committed checkpoint's cost goes to the Trainer's loggers
    as ``checkpoint/stall_s``, ``checkpoint/durable_s``, ``checkpoint/size_bytes`` and
    ``checkpoint/verified``, at the checkpoint's step.

    Limits: map-style datasets only (Lightning reads one batch ahead from a loader without
    a length); random augmentation inside loader workers repeats exactly only if it depends
    on the sample, not on which worker ran it (:class:`ddpckpt.data.SeededDataset`).
    Resuming from a checkpoint saved without this callback is possible but not exact (a
    warning says so).
    """

    def __init__(self, *, log_checkpoints: bool = True, timeout: float | None = None) -> None:
        self.log_checkpoints = log_checkpoints
        self.timeout = timeout
        self._loaders: list[DataLoader] = []
        self._pending: dict[str, Any] | None = None  # this rank's loaded state, applied once
        self._training_streams: dict[str, Any] | None = None  # during validation
        self._events: list[SaveEvent] = []
        self._undo: list[Callable[[], None]] = []
        self._batches_per_epoch: int | None = None  # Lightning's limit, when it has one
        self._resumed = False  # the streams were restored for the first pass after a resume
        self._in_fit_run = False  # inside the fit loop's run: the loops' progress is restored
        self._load_states: Callable[[], None] = lambda: None  # Lightning's, set up in setup()
        self._built: dict[str, Any] | None = None  # the streams as the train loaders were built
        self._saving: str | None = None  # inside Trainer.save_checkpoint: the path it writes
        self._loading: str | None = None  # the checkpoint being restored (on_load_checkpoint)
        self._fitting = True  # whether it is restored to fit (not validate, test, predict)
        self._token: str | None = None  # the token of the save under way
        self._io_called = False  # whether that save went through the CheckpointIO

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for undo in self._undo:  # left by a fit that raised (Lightning skips teardown then)
            undo()
        self._undo = []
        if stage != "fit":
            return
        fit_loop = trainer.fit_loop
        val_loop = fit_loop.epoch_loop.val_loop
        if not callable(getattr(fit_loop, "_load_combined_loader_states", None)):
            raise RuntimeError(
                f"ExactResume does not know this Lightning ({pl.__version__}): its fit loop "
                "has no _load_combined_loader_states; ddpckpt was tested with Lightning 2.6"
            )
        self._load_states = fit_loop._load_combined_loader_states
        reset, run, run_validation = fit_loop.reset, fit_loop.run, val_loop.run
        setup_data = fit_loop.setup_data
        # Lightning's loop methods, patched on these instances (undone at teardown)
        fit_loop.setup_data = (  # type: ignore[method-assign]
            lambda: self._set_up_data(fit_loop, setup_data)
        )
        fit_loop._load_combined_loader_states = (  # type: ignore[method-assign]
            lambda: self._before_pass(trainer)
        )
        fit_loop.reset = lambda: self._after_pass_began(reset)  # type: ignore[method-assign]
        fit_loop.run = lambda: self._fit_run(fit_loop, run)  # type: ignore[method-assign]
        val_loop.run = lambda: self._isolated(run_validation)  # type: ignore[method-assign]
        strategy = trainer.strategy
        save, remove = trainer.save_checkpoint, strategy.remove_checkpoint

        def saving(
            filepath: Any, weights_only: bool | None = None, storage_options: Any = None
        ) -> None:
            self._saving, self._token, self._io_called = os.fspath(filepath), None, False
            self._hook_io(strategy)  # the IO of this save (another callback may have set it)
            try:
                save(filepath, weights_only=weights_only, storage_options=storage_options)
            finally:
                self._saving = None
            if self._token is not None and not self._io_called and current_rank() == 0:
                # the strategy wrote the file itself (FSDP's sharded, DeepSpeed), before returning
                prune_own(os.fspath(filepath), older_than=self._token)

        def removing(filepath: Any) -> None:
            try:
                remove(filepath)
            finally:
                if trainer.is_global_zero:
                    prune_own(os.fspath(filepath), older_than=None)

        self._undo = [
            lambda: vars(fit_loop).pop("_load_combined_loader_states", None),
            lambda: vars(fit_loop).pop("reset", None),
            lambda: vars(fit_loop).pop("run", None),
            lambda: vars(fit_loop).pop("setup_data", None),
            lambda: vars(val_loop).pop("run", None),
            _patch(trainer, "save_checkpoint", saving),
            _patch(strategy, "remove_checkpoint", removing),
        ]
        if self.log_checkpoints:
            self._undo.append(add_listener(self._events.append))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._report(trainer)
        for undo in self._undo:
            undo()
        self._undo = []

    def _hook_io(self, strategy: Any) -> None:
        """Hook the strategy's CheckpointIO, once per IO object: the outermost's call says
        the file goes through it; once the innermost (the one that writes the file,
        synchronously; in ``AsyncCheckpointIO``'s thread) has written it, the states of
        that file's older saves are deleted."""
        outer = strategy.checkpoint_io
        inner = _innermost(outer)
        for io in {id(outer): outer, id(inner): inner}.values():
            if getattr(io.save_checkpoint, "ddpckpt_exact_resume", None) is self:
                continue
            write = io.save_checkpoint

            def hooked(
                checkpoint: dict[str, Any], path: Any, storage_options: Any = None,
                *, write: Callable[..., None] = write, writes: bool = io is inner,
            ) -> None:  # fmt: skip
                self._io_called = True
                write(checkpoint, path, storage_options=storage_options)
                if writes:
                    token = token_of(checkpoint.get("callbacks", {}).get(self.state_key))
                    if token is not None:  # the file holds this save: its older ones can go
                        prune_own(os.fspath(path), older_than=token)

            hooked.ddpckpt_exact_resume = self  # type: ignore[attr-defined]
            self._undo.append(_patch(io, "save_checkpoint", hooked))

    def _set_up_data(self, fit_loop: Any, setup_data: Callable[[], None]) -> None:
        """Lightning's train data set-up. When it builds the loaders (the first time, or a
        ``reload_dataloaders_every_n_epochs`` reload), the random streams as the build began
        are kept for the checkpoint, and a resumed run builds them from the saved ones
        (until the saved position is applied): a ``train_dataloader()`` that draws from
        them (random data, a random split) builds what the saved run trained on."""
        if fit_loop._combined_loader is not None and not fit_loop._should_reload_train_dl:
            setup_data()  # nothing to build
            return
        saved = self._pending.get("built") if self._pending is not None else None
        if saved is not None:
            restore_streams(saved, "ExactResume")
        self._built = capture_streams()
        setup_data()

    def _fit_run(self, fit_loop: Any, run: Callable[[], None]) -> None:
        """The fit loop's run, inside which the saved position is applied. Train loaders set
        up before the loops' progress was restored (a ``configure_optimizers`` that reads
        ``trainer.estimated_stepping_batches`` sets them up during ``strategy.setup``, and
        Lightning does not set them up again) get it here: the same loaders, at the restored
        epoch, iterated anew (``train_dataloader()`` is not called again: it may draw from
        the random streams, as a dataset built there does)."""
        self._in_fit_run = True
        try:
            early = fit_loop._combined_loader is not None and fit_loop._data_fetcher is not None
            if self._pending is not None and early:
                self._load_states()
                self._place_loaders(fit_loop)
                fit_loop._data_fetcher.setup(fit_loop._combined_loader)
                iter(fit_loop._data_fetcher)  # as setup_data does: a new pass, positioned
            run()
        finally:
            self._in_fit_run = False

    def _before_pass(self, trainer: pl.Trainer) -> None:
        """In the fit loop's data set-up, before the first ``iter()`` of new train loaders."""
        combined = trainer.fit_loop._combined_loader
        self._loaders = []
        for loader in combined.flattened if combined is not None else []:
            if not isinstance(loader, DataLoader):
                _log.warning(
                    "ExactResume: the train iterable %s is not a torch DataLoader; its "
                    "position is not saved, so a resume inside an epoch is not exact",
                    type(loader).__qualname__,
                )
                continue
            if isinstance(loader.dataset, IterableDataset):
                raise InexactResumeError(
                    "ExactResume: the train DataLoader reads the IterableDataset "
                    f"{type(loader.dataset).__qualname__}, which Lightning reads one batch ahead "
                    "of training, so its position is not what training consumed; use a "
                    "map-style dataset (with __len__ and __getitem__)"
                )
            track_loader(loader)
            # Lightning counts against len(); a registered wrapper's loader is what is tracked
            tracked_loader(loader)._ddpckpt_stream.whole_pass_len = True  # type: ignore[attr-defined]
            self._loaders.append(loader)
        self._load_states()  # Lightning's own (rank 0's) loader states, when it restarts an epoch
        self._place_loaders(trainer.fit_loop)

    def _place_loaders(self, fit_loop: Any) -> None:
        """Set the train loaders' sampler epoch (Lightning does it after the next ``iter()``;
        workers need it now) and, in the fit loop's run after a resume, the saved position
        and random streams."""
        epoch = fit_loop.epoch_progress.current.processed
        for loader in self._loaders:
            _set_sampler_epoch(tracked_loader(loader), epoch)
        if self._pending is None or not self._in_fit_run:  # not yet: see _fit_run
            return
        pending, self._pending = self._pending, None
        if len(pending["loaders"]) != len(self._loaders):
            raise StateMismatchError(
                f"ExactResume: the checkpoint holds the positions of {len(pending['loaders'])} "
                f"train DataLoader(s), this run has {len(self._loaders)}: train on the same loaders"
            )
        for loader, state in zip(self._loaders, pending["loaders"], strict=True):
            cast(_Tracked, loader).load_state_dict(state)  # class swapped by track_loader
        restore_streams(pending["rng"], "ExactResume")  # what a new pass draws from, as saved
        self._resumed = True

    def _after_pass_began(self, reset: Callable[[], None]) -> None:
        """Right after the first ``iter()`` of a resumed run: the random streams as they are
        now are those of the saved run; what Lightning and the user's hooks draw from here
        to the first batch (a ``val_dataloader()`` building its data, ``on_train_start``)
        the saved run drew before its checkpoint. They are set back right before the first
        batch is taken."""
        if self._resumed and self._loaders:
            self._resumed = False
            streams = capture_streams()
            first = tracked_loader(self._loaders[0])
            first._ddpckpt_before_next = lambda: restore_streams(streams, "ExactResume")
        reset()

    def _isolated(self, run_validation: Callable[[], Any]) -> Any:
        """Validation on a copy of the random streams: training's continue as if it had not run."""
        streams = capture_streams()
        self._training_streams = streams
        try:
            return run_validation()
        finally:
            self._training_streams = None
            restore_streams(streams, "ExactResume")

    # ------------------------------------------------------------------ state

    @property
    def state_key(self) -> str:
        return "ddpckpt.ExactResume"

    def state_dict(self) -> dict[str, Any]:
        """Every rank's streams and loader positions, saved by each rank beside the
        checkpoint ``Trainer.save_checkpoint`` writes (a reference to them), else gathered
        at rank 0; collective (Lightning calls it on every rank when it saves a
        checkpoint), the result meaningful on global rank 0."""
        mine = {
            "rng": self._training_streams or capture_streams(),
            "loaders": [self._position(loader) for loader in self._loaders],
            **({"built": self._built} if self._built is not None else {}),
        }
        if self._saving is not None:
            reference = save_own(self._saving, mine, timeout=self.timeout)
            self._token = reference["id"]
            return reference
        ranks = gather("ddpckpt.integrations.lightning", mine, self.timeout)
        return {"ranks": ranks or []}

    def _position(self, loader: DataLoader) -> dict[str, Any]:
        state = cast(_Tracked, loader).state_dict()  # class swapped by track_loader
        limit = self._batches_per_epoch
        if state["started"] and limit is not None and state["position"] >= limit:
            state["finished"] = True  # Lightning stops at its limit without asking for more
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's streams and loader positions, applied when the fit loop runs;
        collective for a checkpoint whose ranks saved their own state (every rank restores
        the callbacks)."""
        rank = current_rank()
        if not self._fitting:
            return  # validate, test, predict: nothing to continue (the state may not be here)
        if "saved" in state_dict:
            checkpoint = self._loading
            if checkpoint is None:
                raise InexactResumeError(
                    "ExactResume: Lightning restores a checkpoint without saying its path "
                    "(trainer.ckpt_path), so the ranks' own state saved beside it cannot be "
                    "found; resume with trainer.fit(..., ckpt_path=...)"
                )
            mine, world = load_own(checkpoint, state_dict, timeout=self.timeout)
            if not isinstance(mine, dict) or not isinstance(mine.get("loaders"), list):
                raise CorruptCheckpointError(f"{checkpoint}: ExactResume's state of rank {rank} "
                                             "is not one it saves")  # fmt: skip
            self._pending = {
                "rng": continued_streams(mine.get("rng"), world, "ExactResume"),
                "loaders": mine["loaders"],
                "built": mine.get("built") if rank < world else None,
            }
            return
        ranks = state_dict.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise StateMismatchError(
                f"ExactResume: the checkpoint's state for it is not ExactResume's (keys "
                f"{sorted(state_dict)})"
            )
        self._pending = {
            "rng": own_streams(ranks, "ExactResume"),
            "loaders": ranks[min(rank, len(ranks) - 1)]["loaders"],
            "built": ranks[rank].get("built") if rank < len(ranks) else None,
        }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = trainer.num_training_batches
        self._batches_per_epoch = None if batches == float("inf") else int(batches)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        path = trainer.ckpt_path
        self._loading = None if path is None else os.fspath(path)
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        if self.state_key not in checkpoint.get("callbacks", {}):
            _log.warning(
                "ExactResume: the checkpoint was saved without ExactResume, so it holds no "
                "random streams and no DataLoader position: this resume is not exact",
            )

    # ------------------------------------------------------------------ trackers

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        """Send the checkpoints committed since the last call to the loggers (on the training
        thread: an asynchronous save commits on another)."""
        while self._events:
            event = self._events.pop(0)  # atomic: a writer thread may append meanwhile
            if f"{SIDECARS}" in event.path.replace("\\", "/").split("/"):
                continue  # the ranks' own state saved beside a checkpoint: part of it
            metrics = {
                "checkpoint/stall_s": event.stall_seconds,
                "checkpoint/durable_s": event.durable_seconds,
                "checkpoint/size_bytes": float(event.nbytes),
                "checkpoint/verified": float(event.verified),
            }
            step = event.step if event.step is not None else trainer.global_step
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)


def _innermost(io: Any) -> Any:
    """The checkpoint IO that writes the file: Lightning's ``AsyncCheckpointIO`` (a wrapper)
    calls it in its thread once the save's turn comes."""
    while isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is not None:
        io = io.checkpoint_io
    return io


def _patch(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set the instance attribute ``obj.name``; returns what puts back what the instance
    had (if the attribute is still ``value``: a later hook's is left alone)."""
    had, previous = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if vars(obj).get(name) is value:
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)

    return undo
