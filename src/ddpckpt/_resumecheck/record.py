"""Digests of the training state at every step, recorded only under ``ddpckpt check-resume``.

The checker sets :data:`ENV` (a JSON object: the run's directory and, for the run it kills,
which rank dies at which step). Without it, this module is never imported: the core's seam
(:mod:`ddpckpt._observe`) looks at the environment once and finds no observer, and nothing is
recorded, no hook is registered, no file is written, no path is mapped.

With it, the seam imports this module when ddpckpt is imported, and :func:`start` installs the
recorder as the process's observer: it maps every path the script's
ddpckpt calls use into the run's directory (:mod:`.isolate`), notes each call that seeds a
global random generator and every warning ddpckpt logs, and appends JSON lines to
``DIR/records/rank<R>.jsonl`` (``R`` the global rank of the process group, once the script
has made one):

* ``start``: the process began (pid, world size, torchrun restart count, how steps are told
  apart: ``checkpointer`` or ``plain``, the generators' digests when ddpckpt was imported);
* ``resume``: a resume returned (the step it restored, the state after it);
* ``step``: a step ended: the state at its start (taken at its first forward: random
  generators, learning rates, schedulers, parameters, buffers, optimizer state) and at its
  end (everything, plus the sample indices of its batches, a digest of the models' inputs and
  the losses given to ``log_step``);
* ``save``: a save returned (the state it saved);
* ``seed``, ``warning``, ``route``, ``refused``: a seeding call, a ddpckpt warning, where a
  path went, a call the check refused;
* ``exit``: the script's code ended (from atexit, before the interpreter's teardown), and
  whether it failed as far as the process can see (an unhandled exception, ``sys.exit``
  with an error). A ``SystemExit`` raised otherwise (``raise SystemExit(3)``, the builtin
  ``exit(3)``, a ``sys.exit`` bound before ddpckpt was imported) is not visible from
  atexit: the checker learns the exit code from the launcher (:mod:`.ending`), and
  ``os._exit`` writes no ``exit`` event at all.

Two kinds of loop are followed. A script with a writable :class:`~ddpckpt.Checkpointer` (the
first one it makes) ends a step at each ``should_save(step)``, numbered as the script numbers
it. A plain loop (``ddpckpt.save`` / ``ddpckpt.latest`` / ``ddpckpt.load``) counts its steps
by the ``step()`` calls of the first optimizer that steps, from the start of the run (a load
of a checkpoint this run saved continues that count), and records a step at every
optimizer's ``step()`` (a GAN's two optimizers: two records of one step, told apart by their
order), so that each record is taken at the same place in the code in every run, and a
resume, made between two steps, lies between two records; the state is the one passed to the
last ``save`` or ``load``. The checker shows those counts in the script's own numbering (the
``step=`` of its saves). The rank to kill SIGKILLs itself at the chosen step once (a marker
file remembers it across restarts).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpckpt import _observe
from ddpckpt._log import current_rank, observe
from ddpckpt._observe import observer
from ddpckpt._resumecheck import digests, isolate, records
from ddpckpt.errors import CorruptCheckpointError

ENV = "DDPCKPT_CHECK_RESUME"  # its module is named for it in ddpckpt._observe.TOOLS
_RECORDER: Recorder | None = None
_SEEDS_KEPT = 20  # seeding calls recorded per generator and process; more are counted
# (module, attribute, generator) of the calls that seed a global generator
_SEEDING = (("torch", "manual_seed", "rng.torch"), ("torch.random", "manual_seed", "rng.torch"),
            ("torch", "seed", "rng.torch"), ("torch.cuda", "manual_seed", "rng.cuda"),
            ("torch.cuda", "manual_seed_all", "rng.cuda"), ("random", "seed", "rng.python"),
            ("numpy.random", "seed", "rng.numpy"))  # fmt: skip


def start() -> None:
    """Under a check (:data:`ENV` set): record this process from now on. Called once per
    process, by the core's first look (:func:`ddpckpt._observe.observer`)."""
    global _RECORDER
    spec = os.environ.get(ENV)
    if spec and _RECORDER is None:
        _RECORDER = Recorder(json.loads(spec))


def active() -> Recorder | None:
    """The recorder of this process, or ``None`` outside a check (the usual case)."""
    observer()
    return _RECORDER


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class Recorder:
    """This process's recording during a check (see the module docstring)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.dir = str(spec["dir"])
        self.kill: Mapping[str, Any] | None = spec.get("kill")
        self.pid = os.getpid()
        self.isolation = isolate.Isolation(self.dir, record=self._write)
        self.mode: str | None = None  # "checkpointer" or "plain", at the first step
        self.checkpointer: weakref.ref[Any] | None = None
        self.plain_state: Any = None  # a plain loop's state: of its last save() or load()
        self.stepped: list[torch.optim.Optimizer] = []  # every optimizer that stepped
        self.counted: torch.optim.Optimizer | None = None  # a plain loop's step boundary
        self.count = 0  # a plain loop's steps
        self.last_step: int | None = None  # the step that ended last (or was resumed)
        self.resumed_from: int | None = None
        self.samples: dict[int, list[Any]] = {}  # loader id -> batches consumed this step
        self.inputs: Any = None  # hasher of this step's model inputs
        self.forwards = 0
        self.losses: list[Any] = []
        self.start: dict[str, Any] | None = None
        self.saves: dict[int, int] = {}  # step -> saves of it in this process
        self.seeds: dict[str, int] = {}  # generator -> seeding calls seen
        self.initial = digests.rng()  # before the script seeds anything (after imports)
        self.file: Any = None
        self.pending: list[dict[str, Any]] = []  # events before the rank is known
        self.hooked: set[int] = set()  # models whose inputs are digested
        self.undo: list[Any] = []
        isolate.install(self.isolation)
        self.undo.append(lambda: isolate.install(None))
        _observe.install(self)
        self.undo.append(lambda: _observe.install(None))
        self.exit_code: Any = None  # what the script passed to sys.exit, if it called it
        self._sys_exit = sys.exit
        sys.exit = self._exit  # type: ignore[assignment]
        self.undo.append(lambda: setattr(sys, "exit", self._sys_exit))
        atexit.register(self._exited)
        self.undo.append(lambda: atexit.unregister(self._exited))
        self.undo.append(register_optimizer_step_post_hook(self._optimizer_stepped).remove)
        self.undo.append(register_module_forward_pre_hook(self._any_forward).remove)
        self._watch_seeds()
        self.undo.append(observe(self._warned))

    def close(self) -> None:
        """Undo every hook (for tests: a process under a check records until it ends)."""
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
        self.kill = None
        if self.file is not None:
            self.file.close()

    # ------------------------------------------------------------------ the core's seam

    def place(self, location: str, call: str, access: _observe.Access) -> str:
        return self.isolation.place(location, call, access)

    def tell(self, event: _observe.Event) -> None:
        if isinstance(event, _observe.BatchYielded):
            self.batch(event.loader, event.indices)
        elif isinstance(event, _observe.StepEnded):
            self.step(event.checkpointer, event.step)
        elif isinstance(event, _observe.LossLogged):
            self.loss(event.value)
        elif isinstance(event, _observe.CheckpointerSaved):
            self.saved(event.checkpointer, event.step, event.epoch)
        elif isinstance(event, _observe.Saved):
            self.saved_plain(event.path, event.state, event.step, event.epoch)
        elif isinstance(event, _observe.Loaded):
            self.loaded_plain(event.path, event.state, event.info)
        elif isinstance(event, _observe.CheckpointerResumed):
            self.resumed(event.checkpointer, event.info)
        elif isinstance(event, _observe.CheckpointerOpened):
            self.attach(event.checkpointer)

    def _ours(self) -> bool:  # DataLoader workers fork the recorder too: they record nothing
        return os.getpid() == self.pid and bool(self.undo)

    # ------------------------------------------------------------------ what is watched

    @property
    def state(self) -> Any:
        """The TrainingState followed: the Checkpointer's, or a plain loop's."""
        if self.checkpointer is not None:
            ckpt = self.checkpointer()
            return None if ckpt is None else ckpt.state
        return self.plain_state

    def _follow(self, state: Any) -> None:
        """Digest the inputs of ``state``'s models from now on."""
        from ddpckpt._training.wrappers import unwrap_model

        for model in state.models.values():
            root = unwrap_model(model)
            if id(root) not in self.hooked:
                self.hooked.add(id(root))
                self.undo.append(
                    root.register_forward_pre_hook(self._inputs, with_kwargs=True).remove
                )

    def attach(self, ckpt: Any) -> None:
        """Follow ``ckpt`` if it is the process's first writable Checkpointer, made before
        the loop's first step; later ones are only mapped, read-only ones never followed."""
        if ckpt.read_only or self.checkpointer is not None or self.mode == "plain":
            return
        self.mode, self.checkpointer = "checkpointer", weakref.ref(ckpt)
        self._follow(ckpt.state)
        self._write({"event": "attach", "directory": ckpt.directory})

    def _is_followed(self, ckpt: Any) -> bool:
        return self.checkpointer is not None and self.checkpointer() is ckpt

    # ------------------------------------------------------------------ hooks

    def _any_forward(self, module: Any, args: Any) -> None:
        """Before any model is known (a plain loop before its first save or load), a step
        starts at the first forward of any module."""
        if self.start is None and not self.hooked and self._ours():
            self.start = digests.at_start(self.state, self.stepped)

    def _inputs(self, module: Any, args: Any, kwargs: Any) -> None:
        """A followed model's forward: a step starts at the first one (inside DDP's forward,
        after it broadcast rank 0's buffers), and its inputs are digested."""
        if not self._ours():
            return
        if self.start is None:
            self.start = digests.at_start(self.state, self.stepped)
        if self.inputs is None:
            self.inputs = xxhash.xxh3_64()
        digests.feed(self.inputs, (args, kwargs))
        self.forwards += 1

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._ours():
            return
        if all(optimizer is not known for known in self.stepped):
            self.stepped.append(optimizer)
        if self.mode is None:
            self.mode, self.counted = "plain", optimizer
        if self.mode == "plain":  # each optimizer's step ends a part of the script's step
            self.count += optimizer is self.counted
            self._end_step(self.count)

    def batch(self, loader: Any, indices: Any) -> None:
        """A tracked DataLoader yielded the batch of ``indices`` to the training loop."""
        items = indices if isinstance(indices, (list, tuple)) else [indices]
        self.samples.setdefault(id(loader), []).append([int(i) for i in items])

    def loss(self, value: Any) -> None:
        """``log_step(loss)``: any number or tensor (a tensor of several losses too)."""
        self.losses.append(
            digests.number(value.detach() if isinstance(value, torch.Tensor) else value)
        )

    def step(self, ckpt: Any, step: int) -> None:
        """``should_save(step)`` of a Checkpointer: the end of a step, if it is followed."""
        if self._is_followed(ckpt):
            self._end_step(step)

    def _end_step(self, step: int) -> None:
        end = digests.whole(self.state, self.stepped)
        end.update(
            digests.consumed(self.state, self.samples, self.inputs, self.forwards, self.losses)
        )
        self._write({"event": "step", "step": step, "start": self.start, "end": end})
        self.last_step = step
        self._reset()
        self._maybe_kill("step", step, 0)

    def _reset(self) -> None:
        self.start, self.inputs, self.forwards, self.losses, self.samples = None, None, 0, [], {}

    def saved(self, ckpt: Any, step: int, epoch: int | None) -> None:
        """``Checkpointer.save(step)`` returned."""
        if self._is_followed(ckpt):
            self._saved(step, step, epoch, ckpt.directory)

    def saved_plain(self, path: str, state: Any, step: int | None, epoch: int | None) -> None:
        """``ddpckpt.save(path, state, step=step)`` returned (``path`` as written)."""
        if not self._ours() or self.mode == "checkpointer":
            return
        self.plain_state = state
        self._follow(state)
        self._saved(self.count, step, epoch, path)

    def _saved(self, step: int, label: int | None, epoch: int | None, path: str) -> None:
        self.saves[step] = self.saves.get(step, 0) + 1
        state = digests.whole(self.state, self.stepped)
        finished = [
            v.get("finished")
            for k, v in state.items()
            if k.startswith("loader") and isinstance(v, dict)
        ]
        self._write({"event": "save", "step": step, "label": label, "n": self.saves[step], "epoch": epoch,
                     "epoch_end": any(finished) if finished else None, "path": path, "state": state})  # fmt: skip
        self._maybe_kill("save", step, self.saves[step])

    def resumed(self, ckpt: Any, info: Any) -> None:
        """``Checkpointer.resume()`` returns ``info``."""
        if self._is_followed(ckpt):
            step = None if info is None else info.step
            self._resumed(step, step, info)

    def loaded_plain(self, path: str, state: Any, info: Any) -> None:
        """``ddpckpt.load(path, state)`` returned ``info`` (``path`` as read). A checkpoint
        this run saved is a resume; anything else (pretrained weights) is not."""
        if not self._ours() or self.mode == "checkpointer":
            return
        self.plain_state = state
        self._follow(state)
        count = self._count_of(path)
        if count is not None:
            self.count = count
            self._resumed(count, info.step, info)

    def _count_of(self, path: str) -> int | None:
        """The step count at which this run saved the checkpoint ``path``, from its records
        (this rank's first: every rank records every save)."""
        folder = os.path.join(self.dir, records.RECORDS)
        own = f"rank{current_rank()}.jsonl"
        names = sorted(os.listdir(folder), key=lambda n: n != own) if os.path.isdir(folder) else []
        for name in filter(records.is_rank_file, names):
            found = None
            try:
                processes = records.read_rank_file(os.path.join(folder, name)).processes
            except CorruptCheckpointError:  # the checker reports damaged records, not a load
                continue
            for events in processes:
                for event in events:
                    if event["event"] == "save" and event["path"] == path:
                        found = event["step"]
            if found is not None:
                return found
        return None

    def _resumed(self, step: int | None, label: int | None, info: Any) -> None:
        self.resumed_from = self.last_step = step
        epoch = None if info is None else info.epoch
        state = digests.whole(self.state, self.stepped)
        self._write(
            {"event": "resume", "step": step, "label": label, "epoch": epoch, "state": state}
        )
        self._reset()

    # ------------------------------------------------------------------ evidence

    def _watch_seeds(self) -> None:
        import importlib

        for module_name, attribute, generator in _SEEDING:
            try:
                module = importlib.import_module(module_name) if module_name != "random" else random
            except ImportError:
                continue
            original = getattr(module, attribute, None)
            if original is None:
                continue

            def seeding(*args: Any, _original: Any = original, _generator: str = generator,
                        **kwargs: Any) -> Any:  # fmt: skip
                self._seeded(_generator, args, kwargs, sys._getframe(1))
                return _original(*args, **kwargs)

            setattr(module, attribute, seeding)
            self.undo.append(lambda m=module, a=attribute, o=original: setattr(m, a, o))

    def _seeded(self, generator: str, args: Any, kwargs: Any, frame: Any) -> None:
        caller = frame.f_globals.get("__name__", "")
        if not self._ours() or caller.startswith(("ddpckpt.", "torch.", "numpy.")):
            return  # torch seeding CUDA too, SeededDataset seeding a sample, a loader worker
        seen = self.seeds[generator] = self.seeds.get(generator, 0) + 1
        if seen > _SEEDS_KEPT:
            return
        value = args[0] if args else kwargs.get("seed", kwargs.get("a"))
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        self._write({"event": "seed", "generator": generator, "value": repr(value)[:40],
                     "where": where, "after_step": self.last_step,
                     "resumed_from": self.resumed_from})  # fmt: skip

    def _warned(self, record: Any) -> None:
        if not self._ours():
            return
        self._write({"event": "warning", "logger": record.name, "level": record.levelname,
                     "text": record.getMessage(), "after_step": self.last_step,
                     "resumed_from": self.resumed_from})  # fmt: skip

    def _exit(self, code: Any = None) -> None:
        self.exit_code = code
        self._sys_exit(code)

    def _exited(self) -> None:
        """The script's Python code has ended (atexit runs before the interpreter's teardown):
        record whether it failed (an unhandled exception, ``sys.exit`` with an error), so that
        the checker tells a process that died afterwards, in the teardown, from one whose
        script failed."""
        if self.file is not None and self._ours():
            failed = getattr(sys, "last_value", None) is not None or self.exit_code not in (None, 0)
            self._line({"event": "exit", "failed": failed})

    # ------------------------------------------------------------------ output

    def _write(self, record: Mapping[str, Any]) -> None:
        if not self._ours():
            return
        if self.file is None:
            import torch.distributed as dist

            if record["event"] in ("seed", "warning", "route", "attach", "created") and not (
                dist.is_available() and dist.is_initialized()
            ):
                self.pending.append(dict(record))  # the rank is known once the group is made
                return
            folder = os.path.join(self.dir, "records")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{current_rank()}.jsonl")
            self.file = open(path, "a")  # noqa: SIM115 - open while the process records
            if self.file.tell() > 0:  # an earlier process of this rank, killed mid-line: its
                with open(path, "rb") as f:  # torn record stays on a line of its own
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self.file.write("\n")
            self._line({"event": "start", "pid": self.pid, "world": _world(),
                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        "initial": self.initial, "time": time.time()})  # fmt: skip
            for earlier in self.pending:
                self._line(earlier)
            self.pending.clear()
        self._line(record)

    def _line(self, record: Mapping[str, Any]) -> None:
        fitted = records.within_limits(record)  # never what the checker refuses as damaged
        self.file.write(json.dumps(fitted, default=digests.json_default) + "\n")
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
