"""What makes a tracked DataLoader's resume inexact: refused when the loader is first
tracked, or said in a warning at the first pass after a resume (:mod:`ddpckpt._training.loader`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import IterableDataset

from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._state.objects import is_stateful
from ddpckpt.errors import InexactResumeError

_log = get_logger(__name__)


def refuse_untrackable(loader: Any) -> None:
    """Raise :class:`InexactResumeError` for a loader whose position ddpckpt cannot track."""
    iterable = isinstance(loader.dataset, IterableDataset)
    if iterable and (not is_stateful(loader.dataset) or loader.num_workers > 0):
        raise InexactResumeError(
            f"a DataLoader over the IterableDataset {type(loader.dataset).__qualname__} "
            "cannot resume exactly: its position lives in the dataset's iterator"
            + (" in each worker" if loader.num_workers else "")
            + ". Give the dataset state_dict()/load_state_dict() and use num_workers=0, "
            "or use torchdata's StatefulDataLoader (which snapshots each worker)"
        )
    if not getattr(loader, "in_order", True):
        raise InexactResumeError(
            "a DataLoader with in_order=False yields batches out of order, so the batches "
            "training consumed are not a prefix of the epoch: use in_order=True (the default)"
        )


def warn_epoch_gap(record: Mapping[str, Any], epoch: Any, batches: int | None = None) -> None:
    """Say so when the first epoch after a resume skips or repeats data of the saved run.

    ``batches``: a whole pass's batches now, for a record that has none (a sampler that keeps
    its own position, such as ``ResumableDistributedSampler``)."""
    saved = record.get("epoch")
    if not record["started"] or saved is None or epoch is None:
        return
    if not record["finished"]:
        where = f"inside epoch {saved} (after {record['position']} batches)"
        fix = (
            f"restart the loop at epoch {saved}: a checkpoint saved inside an epoch records that "
            "epoch (save epoch=epoch inside the loop and epoch=epoch + 1 after it; restart at "
            "info.epoch)"
        )
        if epoch > saved:
            total = record.get("batches") or batches
            left = None if total is None else total - int(record["position"])
            what = (
                f"the remaining {left} batches of epoch {saved} are skipped"
                if left is not None and left > 0
                else f"the rest of epoch {saved} is skipped"
            )
        else:
            what = f"{_epochs(epoch, saved - 1)} run again and epoch {saved} from its start"
    elif epoch > saved + 1 or epoch < saved:
        where = f"after epoch {saved} ended"
        fix = f"restart the loop at epoch {saved + 1}"
        gap = _epochs(saved + 1, epoch - 1) if epoch > saved else _epochs(epoch, saved)
        what = f"{gap} {'skipped' if epoch > saved else 'run again'}"
    else:
        return
    _log.warning(
        "DataLoader: the checkpoint was saved %s, but the loop's first epoch after the "
        "resume is %s (sampler.set_epoch), so %s and the resume is not exact: %s",
        where,
        epoch,
        what,
        fix,
        extra=same_on_every_rank(),  # every rank restarts at the same epoch: say it once
    )


def _epochs(first: int, last: int) -> str:
    return f"epoch {first} is" if first == last else f"epochs {first} to {last} are"
