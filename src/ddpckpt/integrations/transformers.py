"""The Hugging Face ``Trainer`` with ddpckpt's checkpoints: swap ``Trainer`` for
:class:`DdpckptTrainer`, keep the script; :func:`export_pretrained` writes a
``from_pretrained`` directory (a complete script: the Transformers page of the
documentation).

Each ``output_dir/checkpoint-<step>`` is one ddpckpt checkpoint, written by every process
(each a share): the model, the optimizer, the scheduler, the GradScaler, the
``TrainerState``, each process's random streams and running loss, the model's config. No
pickle (the Trainer's own writes ``optimizer.pt``, ``scheduler.pt``, ``rng_state_*.pth``
and ``training_args.bin`` with ``torch.save``), every byte checksummed, committed
atomically: a checkpoint killed midway never appears, so ``resume_from_checkpoint=True``
never picks a torn one. A ``trainer_state.json`` is written next to the files after the
commit, for tools that read it; the state inside the checkpoint is the one loaded.

A resume restores every process's random streams where the Trainer's own resume does
(after the resumed epoch's first batches are fetched), the running loss the next log
averages, and leaves the data order to the Trainer (accelerate's seedable sampler: each
epoch's order from the seed and the epoch; the batches already trained are skipped by
index, never loaded). Each committed checkpoint is logged with ``Trainer.log``
(``checkpoint/stall_s``, ``checkpoint/durable_s``, ``checkpoint/size_bytes``,
``checkpoint/verified``): it reaches ``state.log_history`` and every reporting callback.
"""

from __future__ import annotations

from ddpckpt.integrations._require import require
from ddpckpt.storage._location import locate

require("transformers", "Hugging Face transformers", "transformers")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from typing import Any, cast  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerState  # noqa: E402
from transformers.trainer_utils import (  # noqa: E402
    PREFIX_CHECKPOINT_DIR,
    TrainOutput,
    compare_trainer_and_checkpoint_args,
)

import ddpckpt  # noqa: E402
from ddpckpt._coord.comm import Comm  # noqa: E402
from ddpckpt._coord.topology import storage_domains  # noqa: E402
from ddpckpt._log import get_logger  # noqa: E402
from ddpckpt.events import SaveEvent, add_listener  # noqa: E402
from ddpckpt.integrations._hf_checkpoints import (  # noqa: E402
    _checkpoints,
    _is_checkpoint,
    _saved_value,
    _state_json,
    _write_trainer_state,
)
from ddpckpt.integrations._hf_export import export_pretrained  # noqa: E402
from ddpckpt.integrations._hf_records import trainer_state_from_json  # noqa: E402
from ddpckpt.integrations._ranks import capture_streams, restore_streams  # noqa: E402

__all__ = ["DdpckptTrainer", "export_pretrained"]
export_pretrained.__module__ = __name__  # public here (its code: _hf_export.py)

_log = get_logger(__name__)


class _PerRankRun:
    """This process's random streams and running loss, saved per process and put back when
    the Trainer restores the random streams of a resumed run."""

    ddpckpt_per_rank = True

    def __init__(self, trainer: DdpckptTrainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        return {
            "rng": capture_streams(),
            "tr_loss": trainer._tr_loss.detach().clone(),
            "total_loss": float(trainer._total_loss_scalar),
            "last_logged": int(trainer._globalstep_last_logged),
            "flos": float(trainer.current_flos),
        }

    def load_state_dict(self, state: Any) -> None:
        """Keep this process's saved run state, its types checked, until :meth:`apply`."""
        kinds: dict[str, type | tuple[type, ...]] = {
            "rng": dict, "tr_loss": torch.Tensor, "total_loss": (int, float),
            "last_logged": int, "flos": (int, float),
        }  # fmt: skip
        where = self._where()
        if not isinstance(state, dict) or any(
            not isinstance(state.get(k), kind) or isinstance(state.get(k), bool)
            for k, kind in kinds.items()
        ):
            raise ddpckpt.CorruptCheckpointError(
                f"{where}: malformed saved per-process run state: not "
                f"{{{', '.join(kinds)}}} of the types it saves"
            )
        if state["tr_loss"].numel() != 1:
            raise ddpckpt.CorruptCheckpointError(
                f"{where}: malformed saved per-process run state: field 'tr_loss' is "
                f"a tensor of shape {list(state['tr_loss'].shape)[:8]}, not one number"
            )
        self.loaded = dict(state)

    def _where(self) -> str:
        resuming = self.trainer._resuming
        return resuming.path if resuming is not None else "DdpckptTrainer"

    def apply(self) -> None:
        state, self.loaded = self.loaded, None
        if state is None:
            return
        trainer = self.trainer
        try:
            restore_streams(state["rng"], "DdpckptTrainer")
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            if isinstance(exc, ddpckpt.CheckpointError):
                raise
            raise ddpckpt.CorruptCheckpointError(
                f"{self._where()}: malformed saved random streams of this process "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from exc
        trainer._tr_loss = state["tr_loss"].to(trainer.args.device)
        trainer._total_loss_scalar = state["total_loss"]
        trainer._globalstep_last_logged = state["last_logged"]
        trainer.current_flos = state["flos"]


class DdpckptTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are ddpckpt checkpoints (see the module).

    Takes what ``Trainer`` takes; ``save_options`` go to :func:`ddpckpt.save` (``sharing``,
    ``timeout``, ``storage_options``). Checkpoints are saved synchronously.
    """

    def __init__(self, *args: Any, save_options: dict[str, Any] | None = None, **kwargs: Any):
        if (save_options or {}).get("async_save"):
            raise ValueError(
                "DdpckptTrainer saves synchronously: leave async_save out of save_options"
            )
        training = kwargs.get("args", args[1] if len(args) > 1 else None)
        url = getattr(training, "output_dir", None)
        made = _missing_dirs(url) if url is not None and "://" in str(url) else []
        super().__init__(*args, **kwargs)
        for directory in made:  # Trainer.__init__ makes output_dir locally, a URL too
            with contextlib.suppress(OSError):  # no longer empty: not only the Trainer's
                os.rmdir(directory)
        self._save_options = dict(save_options or {})
        self._per_rank = _PerRankRun(self)
        self._resuming: _Resuming | None = None

    # ------------------------------------------------------------------ saving

    def _ddpckpt_state(self) -> ddpckpt.TrainingState:
        objects: dict[str, Any] = {
            "model": self.model_wrapped,
            "optimizer": self.optimizer,
            "trainer_state": _state_json(self.state),
            "run": self._per_rank,
        }
        if self.lr_scheduler is not None:
            objects["scheduler"] = self.lr_scheduler
        if getattr(self.accelerator, "scaler", None) is not None:
            objects["scaler"] = self.accelerator.scaler
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            doc = json.loads(config.to_json_string())
            doc["architectures"] = doc.get("architectures") or [type(self.model).__name__]
            objects["config"] = json.dumps(doc)  # for export_pretrained
        return ddpckpt.TrainingState(objects, rng=False)  # streams: in "run", put back later

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Every process: one ddpckpt checkpoint at ``output_dir/checkpoint-<step>``."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        # a dict by name after TrainerState.__post_init__ (annotated as the list it is made from)
        exported = cast("dict[str, Any]", self.state.stateful_callbacks)
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, transformers.trainer_callback.ExportableState):
                name = type(callback).__name__
                if isinstance(exported.get(name), list):
                    exported[name].append(callback.state())
                else:
                    exported[name] = callback.state()
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if self.state.best_global_step == step or _is_checkpoint(best):
                self.state.best_model_checkpoint = best
        events: list[SaveEvent] = []
        stop_listening = add_listener(
            events.append
        )  # a synchronous save: reported before it returns
        try:
            ddpckpt.save(output_dir, self._ddpckpt_state(), step=step, overwrite=True,
                         **self._save_options)  # fmt: skip
        finally:
            stop_listening()
        self._after_commit(run_dir, output_dir)
        for event in events:
            self.log({
                "checkpoint/stall_s": event.stall_seconds,
                "checkpoint/durable_s": event.durable_seconds,
                "checkpoint/size_bytes": event.nbytes,
                "checkpoint/verified": int(event.verified),
            })  # fmt: skip

    def _after_commit(self, run_dir: str, output_dir: str) -> None:
        """Collective: ``trainer_state.json`` in the checkpoint, and rotation, by the first
        process of each storage domain, as ddpckpt found them for ``run_dir`` at the save
        (its cached answer: one round). The Trainer's own does both on global process 0
        only, so on node-local disks the other nodes' checkpoints were never rotated. A
        failure on any process is raised on every one."""
        options = self._save_options
        sharing = options.get("sharing") or options.get("storage")
        with Comm.open(
            "DdpckptTrainer._save_checkpoint", path=run_dir, timeout=options.get("timeout")
        ) as comm:
            # as the save found them (storage_domains keeps them per directory): one round
            domains = storage_domains(comm, locate(output_dir).parent, sharing)
            leads = any(domain[0] == comm.rank for domain in domains)
            text = _state_json(self.state)

            def finish() -> None:
                if leads:
                    _write_trainer_state(output_dir, text)
                    self._rotate(run_dir)

            comm.run("trainer_state and rotation", finish)

    def _rotate(self, run_dir: str) -> None:
        """Local: keep ``save_total_limit`` checkpoints in this process's copy of
        ``run_dir``: the newest and the best always."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        found = _checkpoints(run_dir)
        if not found:  # e.g. the one just saved was deleted meanwhile: nothing to rotate
            return
        best = self.state.best_model_checkpoint
        keep = {found[-1]} | ({os.fspath(best)} if best else set())
        extra = len(found) - max(limit, len(keep))
        for path in [c for c in found if c not in keep][: max(0, extra)]:
            ddpckpt.remove_checkpoint(path)

    # ------------------------------------------------------------------ resuming

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> TrainOutput:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed
        checkpoint in ``output_dir`` that verifies (damaged ones are skipped, with a warning).

        A ddpckpt checkpoint is only read: the ``TrainerState`` comes from its manifest
        (checked field by field) and goes to the Trainer in memory; the
        ``trainer_state.json`` beside it is never read, and nothing is written into it.
        """
        if resume_from_checkpoint is True:
            # a str after TrainingArguments.__post_init__ (None becomes "trainer_output")
            resume_from_checkpoint = ddpckpt.latest(cast(str, self.args.output_dir))
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        if not resume_from_checkpoint or not _is_checkpoint(resume_from_checkpoint):
            return super().train(resume_from_checkpoint, *args, **kwargs)
        path = os.fspath(resume_from_checkpoint)
        state = trainer_state_from_json(_saved_value(path, "trainer_state"), path)
        if self.args.auto_find_batch_size and state.train_batch_size is not None:
            self._train_batch_size = state.train_batch_size  # as the Trainer's own resume
        self._resuming = _Resuming(path, state)
        try:  # the Trainer is told of no checkpoint: it would read its files (see _Resuming)
            return super().train(None, *args, **kwargs)
        finally:
            self._resuming = None

    def _init_training_state(
        self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
        resume_from_checkpoint: str | None, trial: Any,
    ) -> tuple[int, int]:  # fmt: skip
        """The Trainer's own, with the resumed ``TrainerState`` given in memory."""
        resuming = self._resuming
        counts = super()._init_training_state(max_steps, num_update_steps_per_epoch,
                                              num_train_epochs, resume_from_checkpoint, trial)  # fmt: skip
        if resuming is None:
            return counts
        self.state = dataclasses.replace(resuming.state)
        best = self.state.best_model_checkpoint
        if best is not None and not _is_checkpoint(best) and not os.path.isdir(best):
            _log.warning(
                "%s: the best checkpoint it records, %s, does not exist anymore; this run "
                "ignores it", resuming.path, best,
            )  # fmt: skip
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._check_callback_states(resuming.path)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_trained = 0
        if not self.args.ignore_data_skip:
            steps_trained = self.state.global_step % num_update_steps_per_epoch
            steps_trained *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        _log.info("resuming from %s at step %d", resuming.path, self.state.global_step)
        return epochs_trained, steps_trained

    def _check_callback_states(self, path: str) -> None:
        """Refuse saved callback states the live callbacks do not export (the Trainer makes
        each callback anew from its saved arguments and sets its saved attributes)."""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        live = [*self.callback_handler.callbacks, self.control]
        # a dict by name after TrainerState.__post_init__ (annotated as the list it is made from)
        exported = cast("dict[str, Any]", self.state.stateful_callbacks)
        for name, saved in exported.items():
            matching = [c for c in live if type(c).__name__ == name]
            states = saved if isinstance(saved, list) else [saved]
            for callback, data in zip(matching, states, strict=False):  # as the Trainer pairs
                own = callback.state()
                for part in ("args", "attributes"):
                    for key, value in data[part].items():
                        known = own.get(part, {})
                        if key not in known or not _same_kind(value, known[key]):
                            raise ddpckpt.CorruptCheckpointError(
                                f"{path}: malformed saved trainer_state: field "
                                f"'stateful_callbacks': {name}'s {part} {key[:80]!r} is "
                                f"{value!r:.60}, which {name} does not export as such"
                            )

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> Any:
        resuming = self._resuming
        if resuming is not None:  # loads through the methods below, reads no file of its own
            resume_from_checkpoint = resuming.path
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        resuming = self._resuming
        if resuming is not None:  # skips the batches trained, restores the streams after
            kwargs["resume_from_checkpoint"] = resuming.path
        return super()._run_epoch(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not _is_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: everything is loaded at once, once the optimizer exists

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _is_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        info = ddpckpt.load(checkpoint, self._ddpckpt_state())
        saved = trainer_state_from_json(info.extra["trainer_state"], checkpoint)
        if saved.global_step != self.state.global_step:
            raise ddpckpt.errors.StateMismatchError(
                f"{checkpoint}: changed while this run resumed from it (step "
                f"{self.state.global_step} when it began, step {saved.global_step} now); "
                "resume again"
            )

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _is_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _is_checkpoint(checkpoint):
            super()._load_rng_state(checkpoint)
            return
        self._per_rank.apply()

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not _is_checkpoint(best):
            super()._load_best_model()
            return
        _log.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        ddpckpt.load(best, ddpckpt.TrainingState(model=self.model_wrapped, rng=False))


@dataclasses.dataclass(frozen=True)
class _Resuming:
    """The ddpckpt checkpoint a ``train()`` resumes from, and the ``TrainerState`` read
    from its manifest. While it is set the Trainer's own code is told of no checkpoint
    where it would read ``trainer_state.json`` (which may be missing, stale, or a link
    planted by whoever made the checkpoint), and of this one where it loads through this
    class's methods."""

    path: str
    state: TrainerState


def _missing_dirs(path: str) -> list[str]:
    """The local directories that ``os.makedirs(path)`` would make, deepest first."""
    missing = []
    path = os.path.normpath(path)
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _same_kind(value: Any, own: Any) -> bool:
    """Whether a saved callback value may stand for the live one ``own``."""
    if own is None or value is None:
        return True
    if isinstance(own, bool) or isinstance(value, bool):
        return type(own) is type(value)
    if isinstance(own, (int, float)):
        return isinstance(value, (int, float))
    return type(value) is type(own)
