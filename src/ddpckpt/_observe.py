"""The one seam through which a tool watches this process's ddpckpt calls.

The only such tool is ``ddpckpt check-resume``'s recorder. The core never imports it; at its
public calls it publishes two things, and the tool installs an :class:`Observer`:

* :func:`place`: where a call reads or writes a path. The path itself, unless the observer
  maps it (check-resume maps every path into its own run directory, and refuses the
  user's own checkpoints);
* :func:`tell`: one typed event when a call finished (:data:`Event`), and :func:`observer`
  for the hot paths (a loader's every batch), which build no event without one.

Which tool observes is decided once per process, at the first look (``import ddpckpt``
looks): a tool whose environment variable is set (:data:`TOOLS`) is imported then and
installs itself. Outside a tool, which is the usual case, every function here returns at
once. Local to the calling process.
"""

from __future__ import annotations

import enum
import importlib
import os
from dataclasses import dataclass
from typing import Any, Protocol, Union

# A tool's environment variable -> its module, imported at the first look when it is set.
TOOLS = {"DDPCKPT_CHECK_RESUME": "ddpckpt._resumecheck.record"}


class Access(enum.Enum):
    """How a call uses the path it was given."""

    READ = "read"  # a checkpoint or file: load, load_dict, verify
    READ_RUN = "read run"  # a run directory: a read-only Checkpointer
    WRITE = "write"  # a checkpoint, in the directory that holds it: save, save_dict
    WRITE_RUN = "write run"  # a run directory: a Checkpointer, its fast tier
    LOOKUP = "lookup"  # a run directory searched for the checkpoint to resume: latest


@dataclass(frozen=True)
class CheckpointerOpened:
    checkpointer: Any


@dataclass(frozen=True)
class StepEnded:
    """``Checkpointer.should_save(step)``: the training step ``step`` ended."""

    checkpointer: Any
    step: int


@dataclass(frozen=True)
class CheckpointerSaved:
    checkpointer: Any
    step: int
    epoch: int | None


@dataclass(frozen=True)
class CheckpointerResumed:
    checkpointer: Any
    info: Any  # CheckpointInfo | None


@dataclass(frozen=True)
class LossLogged:
    value: Any


@dataclass(frozen=True)
class Saved:
    """``ddpckpt.save`` returned; ``path`` as written."""

    path: str
    state: Any  # TrainingState
    step: int | None
    epoch: int | None


@dataclass(frozen=True)
class Loaded:
    """``ddpckpt.load`` returned ``info``; ``path`` as read."""

    path: str
    state: Any  # TrainingState
    info: Any  # CheckpointInfo


@dataclass(frozen=True)
class BatchYielded:
    """A tracked loader yielded the batch of sample ``indices`` to training."""

    loader: Any
    indices: Any


Event = Union[  # noqa: UP007 - a runtime alias on Python 3.10
    CheckpointerOpened, StepEnded, CheckpointerSaved, CheckpointerResumed, LossLogged, Saved,
    Loaded, BatchYielded,
]  # fmt: skip


class Observer(Protocol):
    def place(self, location: str, call: str, access: Access) -> str:
        """Where ``call`` uses ``location``; may raise to refuse the call."""

    def tell(self, event: Event) -> None:
        """A call finished (see :data:`Event`)."""


_installed: Observer | None = None
_looked = False


def install(tool: Observer | None) -> None:
    """Have ``tool`` observe this process from now on (``None``: none)."""
    global _installed
    _installed = tool


def observer() -> Observer | None:
    """The observer of this process, or ``None`` (the usual case)."""
    global _looked
    if not _looked:
        _looked = True
        for variable, module in TOOLS.items():
            if os.environ.get(variable):
                importlib.import_module(module).start()
    return _installed


def place(path: str | os.PathLike[str], call: str, access: Access) -> str:
    """Where ``call`` uses ``path``: ``path`` as a string, unless an observer maps it."""
    tool = observer()
    location = os.fspath(path)
    return location if tool is None else tool.place(location, call, access)


def tell(event: Event) -> None:
    """Tell the observer, if any, that a call finished."""
    tool = observer()
    if tool is not None:
        tool.tell(event)
