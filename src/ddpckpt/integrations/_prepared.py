"""The position of a DataLoader that Accelerate prepared (``DataLoaderShard``), as ddpckpt
saves any DataLoader's: what training consumed, and the random states its order and its
workers' seed were drawn from.

Accelerate's ``DataLoaderShard`` iterates a plain torch DataLoader (``base_dataloader``,
whose batch sampler is a ``BatchSamplerShard`` over the original one) one batch ahead of
training and counts its passes (``iteration``, the epoch it passes to ``set_epoch``). The
base loader is tracked by ddpckpt (:mod:`ddpckpt._training.loader`); this object corrects
its position for the batch held ahead and saves the pass counter with it. Local: every
rank saves and loads its own (``ddpckpt_per_rank``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpckpt._training.loader import _iterating, held_back, is_tracked, track_loader
from ddpckpt.errors import InexactResumeError, StateMismatchError


class PreparedLoaderPosition:
    """Saves and restores where an Accelerate-prepared DataLoader is (an ``extra`` object)."""

    ddpckpt_per_rank = True

    def __init__(self, prepared: Any, name: str) -> None:
        base = getattr(prepared, "base_dataloader", None)
        if base is None or getattr(prepared, "use_stateful_dataloader", False):
            raise InexactResumeError(
                f"{name}: {type(prepared).__qualname__} is not a DataLoader Accelerate prepared "
                "over a torch DataLoader (use_stateful_dataloader=False), whose position "
                "ddpckpt can save"
            )
        if not is_tracked(base):
            if _iterating(base):
                raise InexactResumeError(
                    f"{name}: ddpckpt first sees this prepared DataLoader while it is being "
                    "iterated, so it cannot know which batches training consumed; call "
                    "training_state(accelerator) (or load_state) after accelerator.prepare "
                    "and before the training loop"
                )
            track_loader(base)
        base._ddpckpt_stream.whole_pass_len = True  # len(prepared) stays the whole pass
        self.prepared = prepared
        self.base = base

    def state_dict(self) -> dict[str, Any]:
        state = held_back(self.base)  # the prepared loader holds a batch during a pass
        finished = bool(state.get("finished"))
        in_pass = any(
            loader is self.prepared for loader in self.prepared.gradient_state.dataloader_references
        )
        # At the last batch the pass counter moves on only when the loop asks for more.
        passes = self.prepared.iteration + (1 if finished and in_pass else 0)
        return {"iteration": passes, "loader": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "iteration" not in state or "loader" not in state:
            raise StateMismatchError(
                f"not the state of an Accelerate-prepared DataLoader (keys: {sorted(state)})"
            )
        self.prepared.iteration = int(state["iteration"])
        self.base.load_state_dict(state["loader"])
