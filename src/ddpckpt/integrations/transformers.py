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

require("transformers", "Hugging Face transformers", "transformers")

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerState  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints  # noqa: E402

import ddpckpt  # noqa: E402
from ddpckpt._format.codec import decode  # noqa: E402
from ddpckpt._format.manifest import MANIFEST_NAME, read_manifest  # noqa: E402
from ddpckpt._format.sections import StateSections  # noqa: E402
from ddpckpt._log import get_logger  # noqa: E402
from ddpckpt.events import SaveEvent, add_listener  # noqa: E402
from ddpckpt.integrations._ranks import capture_streams, restore_streams  # noqa: E402

__all__ = ["DdpckptTrainer", "export_pretrained"]

_log = get_logger(__name__)
TRAINER_STATE_NAME = "trainer_state.json"


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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)

    def apply(self) -> None:
        state, self.loaded = self.loaded, None
        if state is None:
            return
        trainer = self.trainer
        restore_streams(state["rng"], "DdpckptTrainer")
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
        super().__init__(*args, **kwargs)
        self._save_options = dict(save_options or {})
        self._per_rank = _PerRankRun(self)

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
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, transformers.trainer_callback.ExportableState):
                name = type(callback).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()
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
        if self.args.should_save:
            _write_trainer_state(output_dir, _state_json(self.state))
            self._rotate(run_dir)
        for event in events:
            self.log({
                "checkpoint/stall_s": event.stall_seconds,
                "checkpoint/durable_s": event.durable_seconds,
                "checkpoint/size_bytes": event.nbytes,
                "checkpoint/verified": int(event.verified),
            })  # fmt: skip

    def _rotate(self, run_dir: str) -> None:
        """Keep ``save_total_limit`` checkpoints: the newest and the best always."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        found = [c for c in sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR) if _is_checkpoint(c)]
        keep = {found[-1]} | ({self.state.best_model_checkpoint} - {None})
        extra = len(found) - max(limit, len(keep))
        for path in [c for c in found if c not in keep][: max(0, extra)]:
            ddpckpt.remove_checkpoint(path)

    # ------------------------------------------------------------------ resuming

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed
        checkpoint in ``output_dir`` that verifies (damaged ones are skipped, with a warning)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = ddpckpt.latest(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        if resume_from_checkpoint and _is_checkpoint(resume_from_checkpoint):
            self._ensure_trainer_state(os.fspath(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _ensure_trainer_state(self, path: str) -> None:
        """The Trainer reads ``trainer_state.json``; a save killed after its commit left none."""
        if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            _write_trainer_state(path, _saved_value(path, "trainer_state"))  # the same bytes

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not _is_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: everything is loaded at once, once the optimizer exists

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _is_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        info = ddpckpt.load(checkpoint, self._ddpckpt_state())
        saved = TrainerState(**json.loads(info.extra["trainer_state"]))
        if saved.global_step != self.state.global_step:
            raise ddpckpt.StateMismatchError(
                f"{checkpoint}: {TRAINER_STATE_NAME} says step {self.state.global_step}, the "
                f"checkpoint itself step {saved.global_step}; delete {TRAINER_STATE_NAME} there "
                "(it is written again from the checkpoint) and resume again"
            )
        self.state = saved

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


def _is_checkpoint(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


def _state_json(state: TrainerState) -> str:
    """What ``TrainerState.save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _write_trainer_state(directory: str, text: str) -> None:
    target = os.path.join(directory, TRAINER_STATE_NAME)
    temporary = f"{target}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, target)


def export_pretrained(
    checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], model: Any = None
) -> str:
    """Write a ``from_pretrained`` directory (``config.json``, ``model.safetensors``) from a
    :class:`DdpckptTrainer` checkpoint; local, one process. Returns ``out_dir``.

    The model is rebuilt from the configuration saved in the checkpoint (its
    ``architectures`` name a class of ``transformers``); pass ``model`` (an instance of
    the trained class, e.g. ``MyModel(config)``) for a class of your own. Save the
    tokenizer or processor next to it yourself (``tokenizer.save_pretrained(out_dir)``).

    Args:
        checkpoint: A ``checkpoint-<step>`` directory a :class:`DdpckptTrainer` wrote.
        out_dir: The directory to write.
        model: An instance of the trained class, when it is not a class of
            ``transformers``.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: The checkpoint is missing or damaged.
        StateMismatchError: Its configuration names no class of ``transformers`` and
            ``model`` was not passed.
    """
    checkpoint = os.fspath(checkpoint)
    if model is None:
        model = _model_from_saved_config(checkpoint)
    weights = ddpckpt.load_state_dict(checkpoint, model="model")
    model.load_state_dict(weights)
    model.save_pretrained(out_dir)
    return os.fspath(out_dir)


def _model_from_saved_config(checkpoint: str) -> torch.nn.Module:
    doc = json.loads(_saved_value(checkpoint, "config"))
    names = doc.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ddpckpt.StateMismatchError(
            f"{checkpoint}: the saved configuration names the architecture {names!r}, which "
            "is not a class of transformers; pass model= (an instance of it) to export_pretrained"
        )
    config = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    return cls(config)


def _saved_value(checkpoint: str, name: str) -> str:
    """The string saved as the ``extra`` value ``name``, read from the manifest; local."""
    manifest = read_manifest(checkpoint)
    entry = StateSections.from_json(manifest.state, checkpoint).extra.get(name)
    value = None if entry is None or entry.kind != "value" else decode(entry.state, _no_tensor)
    if not isinstance(value, str):
        raise ddpckpt.StateMismatchError(
            f"{checkpoint}: not a checkpoint of DdpckptTrainer (it holds no {name!r})"
        )
    return value


def _no_tensor(name: str) -> torch.Tensor:
    raise ddpckpt.CorruptCheckpointError(f"a tensor ({name}) where a string was saved")
