"""Gradient accumulation whose position survives a checkpoint.

::

    accumulation = ddpckpt.GradientAccumulation(ddp_model, steps=4)
    ckpt = ddpckpt.Checkpointer(..., extra={"accumulation": accumulation})
    for batch in loader:
        with accumulation.context():          # DDP's no_sync() except on the window's last micro-step
            scaler.scale(loss_fn(ddp_model(batch)) / accumulation.steps).backward()
        if accumulation.step():               # True once per window: time to step the optimizer
            scaler.step(optimizer); scaler.update(); optimizer.zero_grad(); scheduler.step()

Its state is the micro-step within the window and, when a checkpoint is taken in the
middle of a window, the gradients accumulated so far (they differ between ranks until the
window's last backward synchronises them, so the state is saved per rank). A resumed run
therefore takes the very same next optimizer step. Restoring into a different number of
``steps`` drops the partial window with a warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ddpckpt._log import get_logger
from ddpckpt._training.wrappers import unwrap_model

_log = get_logger(__name__)


class GradientAccumulation:
    """Counts micro-steps of an accumulation window of ``steps`` backward passes.

    Put it in the checkpoint's ``extra`` (it is saved per rank) so that a resume inside a
    window continues it exactly. Every rank makes its own, with the same ``steps``.

    Args:
        model: The DDP-wrapped model, whose gradient all-reduce :meth:`context` skips.
        steps: Backward passes per optimizer step.

    Attributes:
        model: The model given.
        steps: Backward passes per optimizer step.
        micro: Backward passes counted in the current window (``0`` to ``steps - 1``).

    Raises:
        ValueError: ``steps`` is not a positive int.
    """

    ddpckpt_per_rank = True  # saved per rank (see ddpckpt.PerRank)

    def __init__(self, model: nn.Module, steps: int) -> None:
        if type(steps) is not int or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        self.model = model
        self.steps = steps
        self.micro = 0

    @property
    def last(self) -> bool:
        """Whether the next backward completes the window (and so synchronises the
        gradients)."""
        return self.micro == self.steps - 1

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Wrap each micro-step's forward and backward: DDP's ``no_sync()`` except on the
        window's last micro-step, when DDP all-reduces the gradients; local, but every
        rank must use it at the same micro-steps (DDP's all-reduce is collective). A model
        without ``no_sync`` is synchronised every time."""
        no_sync = getattr(self.model, "no_sync", None)
        with no_sync() if (no_sync is not None and not self.last) else contextlib.nullcontext():
            yield

    def step(self) -> bool:
        """Count one micro-step, after its backward; local.

        Returns:
            True when the window is complete: step the optimizer now.
        """
        self.micro += 1
        if self.micro == self.steps:
            self.micro = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the window; ddpckpt calls it at a save (per rank).

        Returns:
            ``steps``, the micro-step, and the gradients accumulated so far when the
            window is partway (empty at a window's boundary).
        """
        grads = {}
        if self.micro:
            for name, param in unwrap_model(self.model).named_parameters():
                if param.grad is not None:
                    grads[name] = param.grad.detach()
        return {"steps": self.steps, "micro": self.micro, "grads": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position :meth:`state_dict` returned, with the accumulated gradients;
        ddpckpt calls it at a load, each rank with its own. Saved with another ``steps``,
        the partial window is dropped with a WARNING (the micro-step restarts at 0).

        Args:
            state: What :meth:`state_dict` returned on this rank.

        Raises:
            KeyError: A saved gradient names a parameter the model does not have.
        """
        if state["steps"] != self.steps:
            _log.warning(
                "gradient accumulation changed from %d to %d micro-steps per optimizer step; "
                "the partial window saved in the checkpoint (%d micro-steps) is dropped",
                state["steps"],
                self.steps,
                state["micro"],
            )
            self.micro = 0
            return
        self.micro = int(state["micro"])
        params = dict(unwrap_model(self.model).named_parameters())
        with torch.no_grad():
            for name, grad in state["grads"].items():
                param = params[name]
                if param.grad is not None and param.grad.shape == grad.shape:
                    param.grad.copy_(grad)  # a view into DDP's buckets stays one
                else:
                    param.grad = grad.to(device=param.device, dtype=param.dtype).clone()
