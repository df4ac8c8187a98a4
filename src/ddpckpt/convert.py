"""Move in from other checkpoint formats without running their pickles: the Python API of
``ddpckpt import``.

::

    imported = ddpckpt.convert.import_checkpoint("model.pt", "ckpt/imported")
    for entry in imported.left_out:
        print("not imported:", entry)
    ddpckpt.load(imported.path, model=model, optimizer=optimizer)

Local: call it in one process (one rank, then a barrier, in a job that imports before it
trains); every rank then loads the result at any world size. See the "Coming from" page for
the formats understood and what carries over.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Imported", "import_checkpoint"]


@dataclass(frozen=True)
class Imported:
    """What :func:`import_checkpoint` wrote."""

    path: str
    """The ddpckpt checkpoint directory, complete (committed)."""
    left_out: tuple[str, ...]
    """The source's entries not imported, each with why (values that cannot be stored
    without pickle); each was also logged as a WARNING."""


def import_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    model_key: str | None = None,
    trusted_globals: Iterable[str] = (),
    trusted_source: bool = False,
    overwrite: bool = False,
) -> Imported:
    """Convert ``source`` into a ddpckpt checkpoint at ``destination``, as
    ``ddpckpt import SOURCE DESTINATION`` does; local.

    ``source`` is a ``torch.save`` file (a bare model ``state_dict``, or a dict of model,
    optimizer, scheduler, scaler, step, epoch under the usual names), a Lightning ``.ckpt``,
    a ``torch.distributed.checkpoint`` (DCP) directory (torchtitan's too), a Hugging Face ``Trainer``
    ``checkpoint-N`` directory or an Accelerate ``save_state`` directory (these two as
    :class:`~ddpckpt.integrations.transformers.DdpckptTrainer` and
    :func:`~ddpckpt.integrations.accelerate.load_state` resume them, each process's random
    streams as that rank's own; Accelerate's several models as ``model0``, ``model1`` ...),
    a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3: its fp32 master weights and moments put
    together from every rank's slice), or a directory of safetensors weights (DCP's
    ``HuggingFaceStorageWriter``, ``save_pretrained``). No pickle of it runs: ``torch.save``
    files are read with torch's weights-only unpickler (numpy arrays of numbers allowed in
    random streams only; DeepSpeed's four records as inert stand-ins), DCP's ``.metadata``
    with one that knows only DCP's own metadata records. ``module.`` and ``_orig_mod.``
    prefixes are removed.

    Args:
        source: The file or directory to import.
        destination: The checkpoint directory to create; it appears only once complete.
        model_key: The entry holding the model weights, where it is not recognised.
        trusted_globals: ``module.Name`` of plain data classes the file may unpickle
            (never a function).
        trusted_source: Import with a torch whose weights-only loader has known bypasses.
        overwrite: Replace ``destination`` if it is a checkpoint already.

    Returns:
        The checkpoint's path and what was left out.

    Raises:
        UnsafeCheckpointError: The file names a global that is not allowed (it did not run).
        CheckpointNotFoundError: ``source`` does not exist.
        CorruptCheckpointError: The file is damaged, or its layout is not one understood.
        ModuleNotFoundError: A Trainer or Accelerate checkpoint's random streams need numpy,
            which is not installed.
        CheckpointExistsError: ``destination`` holds a checkpoint and ``overwrite`` is False.
    """
    from ddpckpt._convert.legacy import import_checkpoint as convert

    path, dropped = convert(
        source,
        destination,
        model_key=model_key,
        trusted_globals=trusted_globals,
        trusted_source=trusted_source,
        overwrite=overwrite,
    )
    return Imported(path, tuple(dropped))
