"""Digests of the training state at every step, recorded only under ``ddpckpt check-resume``.

The checker sets :data:`ENV` (a JSON object: the run's directory and, for the run it kills,
which rank dies at which step). Without it, :func:`active` returns ``None`` after one look at
the environment and every hook in the library is a no-op: nothing is recorded, no hook is
registered, no file is written.

With it, each process appends JSON lines to ``DIR/records/rank<R>.jsonl``:

* ``start``: the process began (its pid, world size, torchrun restart count);
* ``resume``: :meth:`Checkpointer.resume` returned (the step it restored, the state after it);
* ``step``: :meth:`Checkpointer.should_save` was called for a step: the state at the start of
  the step (taken at the model's first forward: random generators, learning rates,
  scheduler, parameters, buffers, optimizer state) and at its end (everything, plus the sample indices of the batches the
  step consumed, a digest of the model's inputs and the losses passed to ``log_step``);
* ``save``: :meth:`Checkpointer.save` returned (the state it saved).

Checkpoint directories are redirected under ``DIR/checkpoints`` so that the checked runs
never read or write the user's own runs (the script's own directory is created, as a
Checkpointer creates it, and left empty). The rank to kill SIGKILLs itself at the chosen
point once (a marker file remembers it across restarts).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpckpt._format.tensorfile import byte_view
from ddpckpt._log import current_rank
from ddpckpt._state.dtensor import local_tensor
from ddpckpt._state.zero import local_state_dict

ENV = "DDPCKPT_CHECK_RESUME"
_LOOKED = False
_RECORDER: Recorder | None = None
_SAMPLES_KEPT = 4096  # sample indices stored per step and loader; more are stored as a digest


def active() -> Recorder | None:
    """The recorder of this process, or ``None`` outside a check (the usual case)."""
    global _LOOKED, _RECORDER
    if not _LOOKED:
        _LOOKED = True
        spec = os.environ.get(ENV)
        if spec:
            _RECORDER = Recorder(json.loads(spec))
    return _RECORDER


def redirect(directory: str, *, read_only: bool = False) -> str:
    """Where a Checkpointer uses ``directory`` during a check: under the run's directory.

    A ``read_only`` Checkpointer (pretrained weights, another run's checkpoints) reads
    where the script says, unless the check's runs write that very directory (a reader of
    the run being trained): then it reads the check's copy.
    """
    recorder = active()
    if recorder is None:
        return directory
    if read_only:
        copy = recorder.checkpoint_dir(directory, create=False)
        return copy if os.path.isdir(copy) else directory
    return recorder.checkpoint_dir(directory)


def digest(obj: Any) -> str:
    """A 64-bit hash of a nested state (tensors by dtype, shape and bytes; values by repr)."""
    hasher = xxhash.xxh3_64()
    _feed(hasher, obj)
    return hasher.hexdigest()


def _feed(hasher: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = local_tensor(obj).detach()  # a DTensor: this rank's shard
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            hasher.update(byte_view(tensor))
    elif isinstance(obj, Mapping):
        hasher.update(b"{")
        for key, value in obj.items():
            _feed(hasher, key)
            _feed(hasher, value)
        hasher.update(b"}")
    elif isinstance(obj, (list, tuple)):
        hasher.update(b"[")
        for value in obj:
            _feed(hasher, value)
        hasher.update(b"]")
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype"):  # a numpy array
        hasher.update(f"A{obj.dtype}{getattr(obj, 'shape', ())}".encode())
        hasher.update(obj.tobytes())
    else:
        hasher.update(repr(obj).encode())


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


class Recorder:
    """This process's recording during a check (see the module docstring)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.dir = str(spec["dir"])
        self.kill: Mapping[str, Any] | None = spec.get("kill")
        self.primary: weakref.ref[Any] | None = None
        self.file: Any = None
        self.optimizers: list[torch.optim.Optimizer] = []  # every optimizer that stepped
        self.samples: dict[int, list[Any]] = {}  # loader id -> batches consumed this step
        self.inputs: Any = None  # hasher of this step's model inputs
        self.forwards = 0
        self.losses: list[float] = []
        self.start: dict[str, Any] | None = None
        self.saves: dict[int, int] = {}  # step -> saves of it in this process

    # ------------------------------------------------------------------ set-up

    def checkpoint_dir(self, directory: str, *, create: bool = True) -> str:
        path = os.path.abspath(directory)
        if create:  # as a Checkpointer would, for the script's own files next to it; left empty
            os.makedirs(path, exist_ok=True)
        name = f"{os.path.basename(path.rstrip(os.sep)) or 'run'}-{digest(path)[:8]}"
        return os.path.join(self.dir, "checkpoints", name)

    def attach(self, ckpt: Any) -> None:
        """Follow ``ckpt`` if it is the process's first writable Checkpointer; later ones are
        only redirected, and read-only ones (which never train) are never followed."""
        if ckpt.read_only or (self.primary is not None and self.primary() is not None):
            return
        self.primary = weakref.ref(ckpt)
        from ddpckpt._state.model import unwrap_model

        unwrap_model(ckpt.model).register_forward_pre_hook(self._forward, with_kwargs=True)
        register_optimizer_step_post_hook(self._stepped)
        self._write(
            {
                "event": "start",
                "pid": os.getpid(),
                "world": int(os.environ.get("WORLD_SIZE", "1")),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "rng_saved": bool(ckpt.rng),
                "time": time.time(),
            }
        )

    def _is_primary(self, ckpt: Any) -> bool:
        return self.primary is not None and self.primary() is ckpt

    # ------------------------------------------------------------------ hooks

    def _forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.start is None:
            ckpt = self.primary() if self.primary is not None else None
            if ckpt is not None:
                self.start = self._start_state(ckpt)
        if self.inputs is None:
            self.inputs = xxhash.xxh3_64()
        _feed(self.inputs, (args, kwargs))
        self.forwards += 1

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if all(optimizer is not known for known in self.optimizers):
            self.optimizers.append(optimizer)

    def batch(self, loader: Any, indices: Any) -> None:
        """A tracked DataLoader yielded the batch of ``indices`` to the training loop."""
        items = indices if isinstance(indices, (list, tuple)) else [indices]
        self.samples.setdefault(id(loader), []).append([int(i) for i in items])

    def loss(self, value: Any) -> None:
        """``log_step(loss)``: any number or tensor (a tensor of several losses too)."""
        self.losses.append(_number(value.detach() if isinstance(value, torch.Tensor) else value))

    def step(self, ckpt: Any, step: int) -> None:
        """``should_save(step)``: the end of a step."""
        if not self._is_primary(ckpt):
            return
        end = self._state(ckpt)
        end.update(self._consumed(ckpt))
        self._write({"event": "step", "step": step, "start": self.start, "end": end})
        self.start, self.inputs, self.forwards, self.losses, self.samples = None, None, 0, [], {}
        self._maybe_kill("step", step, 0)

    def saved(self, ckpt: Any, step: int, epoch: int | None) -> None:
        """``save(step)`` returned."""
        if not self._is_primary(ckpt):
            return
        self.saves[step] = self.saves.get(step, 0) + 1
        state = self._state(ckpt)
        finished = [v.get("finished") for k, v in state.items() if k.startswith("loader.")]
        record = {"event": "save", "step": step, "n": self.saves[step], "epoch": epoch}
        record.update({"epoch_end": any(finished) if finished else None, "state": state})
        self._write(record)
        self._maybe_kill("save", step, self.saves[step])

    def resumed(self, ckpt: Any, info: Any) -> Any:
        """``resume()`` returns ``info``; returned unchanged."""
        if self._is_primary(ckpt):
            step = None if info is None else info.step
            epoch = None if info is None else info.epoch
            state = self._state(ckpt)
            self._write({"event": "resume", "step": step, "epoch": epoch, "state": state})
            self.start, self.inputs, self.forwards, self.losses, self.samples = (
                None,
                None,
                0,
                [],
                {},
            )
        return info

    # ------------------------------------------------------------------ state

    def _start_state(self, ckpt: Any) -> dict[str, Any]:
        """What a step starts from: the state the previous step (or resume()) left, so that
        a change made between resume() and the first step is told from what the step did.
        Optimizers the Checkpointer does not hold are known only once they step: left out."""
        state: dict[str, Any] = {}
        state.update(self._rng())
        state.update(self._schedule(ckpt))
        state.update(self._model(ckpt))
        state.update(self._optimizers(ckpt, saved_only=True))
        return state

    def _state(self, ckpt: Any) -> dict[str, Any]:
        state: dict[str, Any] = {}
        state.update(self._model(ckpt))
        state.update(self._optimizers(ckpt))
        state.update(self._schedule(ckpt))
        if ckpt.scaler is not None:
            state["scaler"] = {k: _number(v) for k, v in ckpt.scaler.state_dict().items()}
        state.update(self._rng())
        state.update(self._extras(ckpt))
        return state

    def _model(self, ckpt: Any) -> dict[str, Any]:
        from ddpckpt._state.model import unwrap_model

        root = unwrap_model(ckpt.model)
        return {
            "model.parameters": {n: digest(p) for n, p in root.named_parameters()},
            "model.buffers": {n: digest(b) for n, b in root.named_buffers()},
        }

    def _known_optimizers(self, ckpt: Any) -> list[tuple[str, torch.optim.Optimizer]]:
        known = []
        if ckpt.optimizer is not None:
            known.append(("optimizer", ckpt.optimizer))
        for name, obj in (ckpt.extra or {}).items():
            if isinstance(obj, torch.optim.Optimizer):
                known.append((f"optimizer:extra.{name}", obj))
        unsaved = [o for o in self.optimizers if all(o is not k for _, k in known)]
        known += [(f"optimizer:unsaved.{i}", o) for i, o in enumerate(unsaved)]
        return known

    def _optimizers(self, ckpt: Any, saved_only: bool = False) -> dict[str, Any]:
        state = {}
        for name, optimizer in self._known_optimizers(ckpt):
            if saved_only and name.startswith("optimizer:unsaved"):
                continue
            saved = local_state_dict(optimizer)
            # The groups the user and schedulers change: ZeRO copies them into its local
            # optimizer only inside step(), so the local optimizer's lag behind.
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            state[name] = {
                "type": type(optimizer).__name__,
                "entries": len(saved["state"]),
                "state": digest(saved["state"]),
                "groups": digest(groups),
            }
        return state

    def _schedule(self, ckpt: Any) -> dict[str, Any]:
        state: dict[str, Any] = {}
        lrs = []  # of the optimizers the Checkpointer holds (others: their own component)
        for name, optimizer in self._known_optimizers(ckpt):
            if not name.startswith("optimizer:unsaved"):
                lrs += [_number(g.get("lr")) for g in optimizer.param_groups]
        state["lr"] = lrs
        scheduler = ckpt.scheduler
        if scheduler is not None and callable(getattr(scheduler, "state_dict", None)):
            saved = scheduler.state_dict()
            last_lr = getattr(scheduler, "get_last_lr", None)
            state["scheduler"] = {
                "last_epoch": _number(saved.get("last_epoch")),
                "lr": [_number(v) for v in last_lr()] if callable(last_lr) else None,
                "state": digest(saved),
            }
        return state

    def _rng(self) -> dict[str, Any]:
        from ddpckpt._state.rng import capture_rng

        return {f"rng.{part}": digest(value) for part, value in capture_rng().items()}

    def _extras(self, ckpt: Any) -> dict[str, Any]:
        from ddpckpt._training.loader import is_tracked

        state: dict[str, Any] = {}
        for name, obj in (ckpt.extra or {}).items():
            if is_tracked(obj):
                record = obj._ddpckpt_resume or obj._ddpckpt_now
                keys = ("epoch", "position", "finished")
                state[f"loader.{name}"] = {k: record[k] for k in keys} if record else "not started"
            elif isinstance(obj, (torch.optim.Optimizer, torch.utils.data.DataLoader)):
                continue
            elif callable(getattr(obj, "state_dict", None)):
                state[f"extra.{name}"] = digest(obj.state_dict())
            else:  # a plain value (tensor, number, dict, list, numpy array): saved as it is
                state[f"extra.{name}"] = digest(obj)
        return state

    def _consumed(self, ckpt: Any) -> dict[str, Any]:
        """What the step read: its batches' sample indices, its inputs, its losses."""
        consumed: dict[str, Any] = {}
        names = {id(obj): name for name, obj in (ckpt.extra or {}).items()}
        for loader, batches in self.samples.items():
            name = names.get(loader, "unnamed")
            kept = sum(len(b) for b in batches) <= _SAMPLES_KEPT
            consumed[f"loader.{name}.samples"] = batches if kept else digest(batches)
        if self.forwards:
            consumed["inputs"] = {"forwards": self.forwards, "digest": self.inputs.hexdigest()}
        if self.losses:
            consumed["loss"] = self.losses
        return consumed

    # ------------------------------------------------------------------ output

    def _write(self, record: Mapping[str, Any]) -> None:
        if self.file is None:
            folder = os.path.join(self.dir, "records")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{current_rank()}.jsonl")
            self.file = open(path, "a")  # noqa: SIM115 - open while the process records
        self.file.write(json.dumps(record, default=_json_default) + "\n")
        self.file.flush()

    def _maybe_kill(self, event: str, step: int, count: int) -> None:
        kill = self.kill
        if kill is None or current_rank() != kill["rank"] or step != kill["step"]:
            return
        if event != kill["event"] or (event == "save" and count != kill["saves"]):
            return
        marker = os.path.join(self.dir, "killed")
        if os.path.exists(marker):
            return  # killed once already: this is the restarted run
        with open(marker, "w") as f:
            json.dump({"rank": kill["rank"], "step": step, "event": event, "pid": os.getpid()}, f)
        self.file.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _number(value)
    if isinstance(value, Iterable):
        return list(value)
    return repr(value)
