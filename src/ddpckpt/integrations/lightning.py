"""PyTorch Lightning with ddpckpt's checkpoints and an exact mid-epoch resume: pass
``plugins=[DdpckptCheckpointIO()]`` and ``callbacks=[ExactResume(), ...]`` to the
``Trainer`` (a complete script: the Lightning page of the documentation).

:class:`DdpckptCheckpointIO` stores Lightning's checkpoint dict (global rank 0 writes it,
every rank reads it) as a ddpckpt checkpoint directory: no pickle, every byte
checksummed, committed atomically; it composes with Lightning's ``AsyncCheckpointIO``.
:class:`ExactResume` adds what Lightning does not restore: each rank's random streams and
the position of the train DataLoader (sampler, loader workers' seed), so that a run
resumed from a checkpoint saved inside an epoch continues bit for bit as if it had never
stopped; it also reports every committed checkpoint (:mod:`ddpckpt.events`) to the
Trainer's loggers. Either works without the other. :func:`load_from_checkpoint` loads a
trained module from such a checkpoint, as ``MyModule.load_from_checkpoint`` does from a
``torch.save`` file.
"""

from __future__ import annotations

from ddpckpt.integrations._require import require

require("lightning", "PyTorch Lightning", "lightning")

import os  # noqa: E402
from collections import Counter, OrderedDict, defaultdict  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.core import saving  # noqa: E402
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402
from lightning.pytorch.utilities.migration import migrate_checkpoint  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402

import ddpckpt  # noqa: E402
from ddpckpt._log import get_logger  # noqa: E402
from ddpckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ddpckpt.integrations._lightning_exact import ExactResume  # noqa: E402
from ddpckpt.storage._registry import configure  # noqa: E402

__all__ = ["DdpckptCheckpointIO", "ExactResume", "load_from_checkpoint"]
ExactResume.__module__ = __name__  # public here (its code: _lightning_exact.py)

_log = get_logger(__name__)


class DdpckptCheckpointIO(CheckpointIO):
    """Lightning's checkpoints as ddpckpt checkpoints: ``Trainer(plugins=[DdpckptCheckpointIO()])``.

    Each checkpoint path (``epoch=0-step=100.ckpt``, ``last.ckpt``) becomes a directory of
    safetensors files and a JSON manifest, written by :func:`ddpckpt.save_dict` on the
    process Lightning saves from (global rank 0) and read by :func:`ddpckpt.load_dict` on
    every rank. Saving the same path again (``last.ckpt``) replaces it atomically. For
    asynchronous saves wrap it: ``AsyncCheckpointIO(DdpckptCheckpointIO())``.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Write ``checkpoint`` as the checkpoint directory ``path``, replacing one there.

        Lightning calls it on the process it saves from (global rank 0).

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: The checkpoint directory (or URL).
            storage_options: Configure an ``s3://`` URL's client (endpoint, region,
                credentials: :meth:`S3Storage.from_options <ddpckpt.storage.s3.S3Storage.from_options>`).

        Raises:
            CheckpointError: As :func:`ddpckpt.save_dict`.
        """
        path = os.fspath(path)
        configure(path, storage_options)
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        ddpckpt.save_dict(
            path,
            _plain(checkpoint),
            step=step if isinstance(step, int) else None,
            epoch=epoch if isinstance(epoch, int) else None,
            overwrite=True,  # Lightning saves last.ckpt again and again
        )

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``, every byte verified; on every rank, alone.

        Args:
            path: The checkpoint directory (or URL).
            map_location: As for :func:`ddpckpt.load_dict`; ``None`` reads it on the CPU
                (Lightning copies the state into the modules itself).
            weights_only: Ignored: nothing in the checkpoint can run code.

        Returns:
            Lightning's checkpoint dict.

        Raises:
            CheckpointError: The checkpoint is missing, damaged or not a ddpckpt one.
        """
        # None would put each tensor on the device rank 0 saved it from (cuda:0 on every
        # rank); Lightning copies the state into the modules itself, so read it on the CPU.
        location = "cpu" if map_location is None else map_location
        return ddpckpt.load_dict(os.fspath(path), map_location=location)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (a crash midway leaves none that looks complete).

        A path that holds something other than a committed checkpoint (a ``torch.save``
        file of an earlier run) is left alone, with a warning.

        Args:
            path: The checkpoint directory (or URL).
        """
        path = os.fspath(path)
        try:
            ddpckpt.remove_checkpoint(path)
        except ddpckpt.CheckpointNotFoundError:
            if os.path.lexists(path):
                _log.warning("%s is not a ddpckpt checkpoint; not removed", path)


def _plain(value: Any) -> Any:
    """``value`` with dict subclasses (Lightning's ``AttributeDict`` hyperparameters) as
    plain dicts: ddpckpt stores only types it can restore as they were."""
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _plain(v)) for k, v in value.items())
    if isinstance(value, Mapping) and type(value) not in (Counter, defaultdict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_from_checkpoint(
    cls: type[pl.LightningModule] | type[pl.LightningDataModule],
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    *,
    trust_instantiator: bool = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a checkpoint
    :class:`DdpckptCheckpointIO` wrote (``last.ckpt`` is a directory, which Lightning's own
    method cannot read); any one process calls it, alone (not collective).

    Lightning's semantics: the hyperparameters ``save_hyperparameters()`` stored build
    ``cls``, ``kwargs`` override them, the module's ``configure_model`` and
    ``on_load_checkpoint`` hooks run, and the weights are loaded into it, which is then on
    the device of the loaded tensors. Hyperparameters that name an ``_instantiator``
    (``LightningCLI`` writes one, with the class to import) are refused unless you pass
    ``trust_instantiator=True``: the instantiator would import and call what the checkpoint
    names. Even then, only instantiators on Lightning's allowlist are used, as in Lightning.

    Args:
        cls: The ``LightningModule`` (or ``LightningDataModule``) subclass to build.
        checkpoint_path: The checkpoint directory (or URL), e.g. ``checkpoints/last.ckpt``.
        map_location: Where tensors go: a device, a dict from saved device to device, or a
            function ``(tensor, saved device) -> tensor`` (:func:`ddpckpt.load_dict`);
            ``None``, as in Lightning, the device each was saved from when this machine
            has that kind of device, else the CPU.
        hparams_file: A ``.yaml`` or ``.csv`` file whose hyperparameters replace the
            checkpoint's, as in Lightning.
        strict: Whether the checkpoint's keys must match the module's exactly; ``None``:
            the module's ``strict_loading`` (by default true), as in Lightning.
        trust_instantiator: Let hyperparameters naming an instantiator on Lightning's
            allowlist build the module (for a checkpoint you trust).
        **kwargs: Arguments of ``cls``, overriding the saved hyperparameters.

    Returns:
        The module (or data module), as Lightning's method returns it.

    Raises:
        CheckpointNotFoundError: No ddpckpt checkpoint at ``checkpoint_path``; a file there
            (a ``torch.save`` checkpoint) is named as such, never unpickled.
        CorruptCheckpointError: A file does not match its checksum, the dict is not a
            Lightning checkpoint of Lightning 2 or later, or its hyperparameters name an
            ``_instantiator`` (without ``trust_instantiator``, or outside Lightning's
            allowlist).
        RuntimeError: This Lightning lacks what the load reuses (it names the version), or
            ``strict`` and the keys differ (PyTorch's message).
    """
    if not (
        isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))
    ):
        raise TypeError(
            "load_from_checkpoint builds a LightningModule or LightningDataModule subclass, "
            f"not {cls!r}"
        )
    load_state = _lightning_load_state()
    path = os.fspath(checkpoint_path)
    location = _SAVED_DEVICE_IF_PRESENT if map_location is None else map_location
    try:
        checkpoint = DdpckptCheckpointIO().load_checkpoint(path, map_location=location)
    except CheckpointNotFoundError as err:
        if os.path.isfile(path):  # never opened: it may be a pickle, which can run code
            raise CheckpointNotFoundError(
                f"{path}: is a file, not a ddpckpt checkpoint directory; if it is a "
                f"torch.save checkpoint (Lightning's own CheckpointIO), load it with "
                f"{cls.__name__}.load_from_checkpoint({path!r}), or convert it with "
                "`ddpckpt import`"
            ) from err
        raise
    _check_lightning_dict(checkpoint, cls, path)
    try:  # as Lightning does; _check_lightning_dict refused what needs more than renames
        checkpoint, _ = migrate_checkpoint(checkpoint)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise CorruptCheckpointError(f"{path}: Lightning cannot migrate it: {err!r:.200}") from err

    # What follows is Lightning 2.6.6's _load_from_checkpoint after its torch.load.
    if hparams_file is not None:
        extension = os.fspath(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            # Lightning's annotation says str | Path; it takes any path (through fsspec)
            hparams = saving.load_hparams_from_tags_csv(hparams_file)  # type: ignore[arg-type]
        elif extension in ("yml", "yaml"):
            hparams = saving.load_hparams_from_yaml(hparams_file)  # type: ignore[arg-type]
        else:
            raise ValueError(f"hparams_file must be a .csv, .yml or .yaml file: {hparams_file}")
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    _refuse_instantiator(checkpoint, cls, path, trust_instantiator)

    if issubclass(cls, pl.LightningDataModule):
        return load_state(cls, checkpoint, **kwargs)
    model = load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        _log.warning("%s: the checkpoint's state_dict is empty; %s is as built", path, cls.__name__)
        return model
    tensors = (t for t in state_dict.values() if isinstance(t, torch.Tensor))
    return model.to(next(tensors, torch.tensor(0)).device)


def _lightning_load_state() -> Callable[..., Any]:
    """Lightning's private ``_load_state`` (2.6.6: ``lightning.pytorch.core.saving``), which
    builds a module from a checkpoint dict; the one place Lightning implements it."""
    load_state = getattr(saving, "_load_state", None)
    if not callable(load_state) or not isinstance(
        getattr(saving, "_ALLOWED_INSTANTIATORS", None), (set, frozenset)
    ):
        raise RuntimeError(
            f"ddpckpt's load_from_checkpoint does not know this Lightning ({pl.__version__}): "
            "lightning.pytorch.core.saving has no _load_state or _ALLOWED_INSTANTIATORS; it "
            "was tested with Lightning 2.6.6: install that version, or load the weights "
            "with ddpckpt.load_dict(path)['state_dict'] and model.load_state_dict"
        )
    return load_state


def _hparams_keys(cls: type[pl.LightningModule] | type[pl.LightningDataModule]) -> list[str]:
    """The checkpoint keys Lightning reads ``cls``'s hyperparameters from."""
    past = list(saving.CHECKPOINT_PAST_HPARAMS_KEYS) if issubclass(cls, pl.LightningModule) else []
    return [*past, cls.CHECKPOINT_HYPER_PARAMS_KEY]


def _check_lightning_dict(
    checkpoint: Any, cls: type[pl.LightningModule] | type[pl.LightningDataModule], path: str
) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``checkpoint`` has the types Lightning's
    load relies on (it would fail on others with a bare ``KeyError`` or ``TypeError``)."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not a Lightning checkpoint: {what}")

    if not isinstance(checkpoint, dict):
        raise bad(f"it holds a {type(checkpoint).__name__}, not a dict")
    version = checkpoint.get("pytorch-lightning_version")
    try:
        written_by = Version(version if isinstance(version, str) else "")
    except InvalidVersion:
        raise bad(f"'pytorch-lightning_version' is {version!r:.60}, not a version") from None
    if written_by < Version("2.0"):  # DdpckptCheckpointIO works with Lightning 2 only
        raise bad(
            f"it says Lightning {version} wrote it, older than any DdpckptCheckpointIO ran in"
        )
    for key in _hparams_keys(cls):
        value = checkpoint.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad(f"{key!r} is not a dict of hyperparameters by name")
    for key in (cls.CHECKPOINT_HYPER_PARAMS_NAME, cls.CHECKPOINT_HYPER_PARAMS_TYPE):
        if not isinstance(checkpoint.get(key), (str, type(None))):
            raise bad(f"{key!r} is a {type(checkpoint[key]).__name__}, not a name")
    if issubclass(cls, pl.LightningModule):
        state_dict = checkpoint.get("state_dict")
        if not isinstance(state_dict, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()
        ):
            raise bad("it has no 'state_dict' of tensors by name")


def _refuse_instantiator(
    checkpoint: dict[str, Any],
    cls: type[pl.LightningModule] | type[pl.LightningDataModule],
    path: str,
    trusted: bool,
) -> None:
    """Refuse hyperparameters naming an ``_instantiator`` before Lightning sees them: it
    would import the class they name and call it with their arguments. With ``trusted``,
    only one outside Lightning's allowlist is refused (Lightning checks that too)."""
    allowed = saving._ALLOWED_INSTANTIATORS
    for key in _hparams_keys(cls):
        hparams = checkpoint.get(key)
        named = hparams.get("_instantiator") if isinstance(hparams, Mapping) else None
        if named is None:
            continue
        if not trusted:
            raise CorruptCheckpointError(
                f"{path}: its hyperparameters ({key!r}) name the instantiator {named!r:.200} "
                "(LightningCLI writes one), which would import and call the class they name; "
                "refused. If you trust this checkpoint, pass trust_instantiator=True, or pass "
                f"{cls.__name__}'s arguments as keyword arguments"
            )
        if not isinstance(named, str) or named not in allowed:
            raise CorruptCheckpointError(
                f"{path}: its hyperparameters ({key!r}) name the instantiator {named!r:.200}, "
                "which is not in Lightning's allowlist of trusted instantiators; refused. If "
                "you trust this checkpoint, add the name to "
                "lightning.pytorch.core.saving._ALLOWED_INSTANTIATORS first"
            )


class _SavedDeviceIfPresent(Mapping[str, str]):
    """Lightning's default ``map_location`` as a :func:`ddpckpt.load_dict` mapping from saved
    device to device: the saved device where this machine has its kind, else the CPU."""

    def __getitem__(self, saved: str) -> str:
        kind = torch.device(saved).type
        backend = getattr(torch, kind, None)
        present = kind == "cpu" or bool(getattr(backend, "is_available", lambda: False)())
        return saved if present else "cpu"

    def __iter__(self) -> Any:
        return iter(())  # defined for every device, listing none

    def __len__(self) -> int:
        return 0


_SAVED_DEVICE_IF_PRESENT = _SavedDeviceIfPresent()
