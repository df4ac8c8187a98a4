"""keep_best's notice: a save whose metrics cannot rank it among the best.

:class:`~ddpckpt.policies.KeepBest` passes over a checkpoint without a finite number for
its ``monitor`` (as documented); a misspelled ``monitor``, or saves that pass no metrics,
would then keep nothing as best without a word. The rank that applies retention (each
storage domain's first, under the run's lock) says so after the save, once per run and
monitor, with the text every such rank would log (rank 0 prints it).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ddpckpt._format.codec import decode
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt.errors import CheckpointError
from ddpckpt.policies import KeepAnyOf, KeepBest, Record, Retention

_log = get_logger(__name__)


class BestNotices:
    """What one run's saves have said about ``keep_best`` on this rank."""

    def __init__(self, directory: str) -> None:
        self.directory = directory  # the run directory, as messages name it
        self._told: set[str] = set()  # the monitors said once already

    def after_save(
        self,
        retention: Retention,
        header: Mapping[str, Any],
        records: Callable[[], Sequence[Record]],
    ) -> None:
        """Local, on a rank that applies retention, once the save of ``header`` (as it is
        written to the manifest) is committed and retention applied: a WARNING for each
        :class:`KeepBest` of ``retention`` that cannot rank it, the first time for its
        monitor. ``records``: the run's committed checkpoints, read only then."""
        step = header["step"]
        metrics: dict[str, Any] | None = None
        for part in _best_parts(retention):
            if part.monitor in self._told:
                continue
            if metrics is None:
                metrics = decode(header["metrics"], _no_tensor, where=self.directory)
            if part.best([Record(step, metrics)]):
                continue
            self._told.add(part.monitor)
            try:
                kept: list[int] | None = part.best(records())
            except (OSError, CheckpointError):  # the listing failed: say nothing of it
                kept = None
            _log.warning(
                "%s", unranked(part, step, metrics, self.directory, kept),
                extra=same_on_every_rank(),
            )  # fmt: skip


def unranked(
    part: KeepBest, step: int, metrics: Mapping[str, Any], directory: str, kept: list[int] | None
) -> str:
    """The notice that the save of ``step`` with ``metrics`` does not count for ``part``;
    ``kept``: the steps it keeps as best now (``None``: unknown)."""
    monitor = part.monitor
    if not metrics:
        given = f"save(step={step}) gave no metrics"
    elif monitor not in metrics:
        given = f"save(step={step}, metrics=...) gave only {', '.join(map(repr, metrics))}"
    else:
        given = (
            f"save(step={step}, metrics=...) gave {monitor!r}={metrics[monitor]!r}, which is "
            "no finite number (NaN, inf, -inf and non-numbers never count as best)"
        )
    if kept is None:
        standing = ""
    elif not kept:
        standing = f", and no checkpoint of {directory} is kept as best"
    elif len(kept) == 1:
        standing = f"; the one kept as best by it is step {kept[0]}"
    else:
        standing = f"; the ones kept as best by it are steps {', '.join(map(str, kept))}"
    if monitor in metrics:
        action = f"pass a finite number as metrics[{monitor!r}]"
    else:
        action = f"pass metrics={{{monitor!r}: ...}} to save()"
    if metrics and monitor not in metrics:
        close = difflib.get_close_matches(monitor, list(metrics), n=1)
        action += f", or monitor={close[0]!r}" if close else ", or set monitor= to one of those"
    return (
        f"keep_best={part.k} monitors {monitor!r}, but {given}: checkpoint step {step} cannot "
        f"count as best{standing}. For saves to count, {action} (said once per run; later "
        "saves like it are not reported)"
    )


def _best_parts(retention: Retention) -> list[KeepBest]:
    """The :class:`KeepBest` policies ``retention`` is made of (a retention of your own
    that is neither, nor a :class:`KeepAnyOf`, has none we know of)."""
    if isinstance(retention, KeepBest):
        return [retention]
    if isinstance(retention, KeepAnyOf):
        return [part for policy in retention.policies for part in _best_parts(policy)]
    return []


def _no_tensor(name: str) -> torch.Tensor:
    """Metrics are plain scalars (``header_fields`` turns one-element tensors into numbers)."""
    raise CheckpointError(f"metrics refer to a tensor ({name})")
