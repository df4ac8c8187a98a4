"""``export_pretrained`` (public as
:func:`ddpckpt.integrations.transformers.export_pretrained`): a ``from_pretrained``
directory from a ``DdpckptTrainer`` checkpoint, the model rebuilt from its saved
configuration (:mod:`ddpckpt.integrations._hf_records`) within bounds the checkpoint's
tensors set."""

from __future__ import annotations

from ddpckpt.integrations._require import require
from ddpckpt.storage._location import locate

require("transformers", "Hugging Face transformers", "transformers")

import os  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import ddpckpt  # noqa: E402
from ddpckpt._format.manifest import read_manifest  # noqa: E402
from ddpckpt._format.sections import StateSections  # noqa: E402
from ddpckpt._io.reader import FileSource  # noqa: E402
from ddpckpt.integrations._hf_checkpoints import _saved_value  # noqa: E402
from ddpckpt.integrations._hf_records import (  # noqa: E402
    SavedModelConfig,
    config_class,
    model_class,
    model_config_from_json,
)


def export_pretrained(
    checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], model: Any = None
) -> str:
    """Write a ``from_pretrained`` directory (``config.json``, ``model.safetensors``) from a
    :class:`DdpckptTrainer` checkpoint; local, one process. Returns ``out_dir``.

    The model is rebuilt from the configuration saved in the checkpoint, read as untrusted
    input: its ``model_type`` must be one of transformers and its ``architectures`` name one
    of the model classes transformers' auto mappings give that type (a
    ``PreTrainedModel``); every field is type-checked, and the model is first built on the
    meta device and its shapes compared with the checkpoint's tensors, so that nothing is
    allocated for a configuration that does not match them. Pass ``model`` (an instance of
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
        CorruptCheckpointError: The checkpoint is damaged, or its saved configuration is
            malformed, names no model class of transformers for its model type, or does
            not match its tensors (the message names the field or the tensor).
        CheckpointError: The checkpoint is missing.
        StateMismatchError: It is no checkpoint of :class:`DdpckptTrainer`.
    """
    checkpoint = os.fspath(checkpoint)
    if model is None:
        model = _model_from_saved_config(checkpoint)
    weights = ddpckpt.load_state_dict(checkpoint, model="model")
    model.load_state_dict(weights)
    model.save_pretrained(out_dir)
    return os.fspath(out_dir)


def _model_from_saved_config(checkpoint: str) -> torch.nn.Module:
    """The model the checkpoint's saved configuration describes, on the CPU, built only
    once a meta-device build of it has the checkpoint's tensors' names and shapes."""
    saved = model_config_from_json(_saved_value(checkpoint, "config"), checkpoint)
    cls = model_class(saved, checkpoint)
    stored = _stored_shapes(checkpoint)
    config = _config(saved, checkpoint)
    with _bounded_build(checkpoint, len(stored)), torch.device("meta"):
        skeleton = _build(cls, config, saved, checkpoint)
    built = {key: tuple(t.shape) for key, t in skeleton.state_dict().items()}
    for key in sorted(set(built) | set(stored)):
        if built.get(key) != stored.get(key):
            raise ddpckpt.CorruptCheckpointError(
                f"{checkpoint}: malformed saved model config: {saved.architecture} built from "
                f"it has {_described(built.get(key))} for {key[:200]!r}, where the checkpoint "
                f"has {_described(stored.get(key))}"
            )
    _check_size(skeleton, checkpoint, saved)
    return _build(cls, config, saved, checkpoint)


def _check_size(skeleton: torch.nn.Module, checkpoint: str, saved: SavedModelConfig) -> None:
    """Refuse a model that would take far more memory than the checkpoint stores: buffers
    left out of its state (a causal mask sized by ``max_position_embeddings``) are not
    compared with the checkpoint's tensors, but are allocated all the same."""
    tensors = [*skeleton.parameters(), *skeleton.buffers()]
    needed = sum(t.numel() * t.element_size() for t in tensors)
    stored = read_manifest(locate(checkpoint)).nbytes
    if needed > 2 * stored + (64 << 20):
        raise ddpckpt.CorruptCheckpointError(
            f"{checkpoint}: malformed saved model config: {saved.architecture} built from it "
            f"would take {needed} bytes of parameters and buffers, where the checkpoint "
            f"stores {stored} bytes in all"
        )


def _described(shape: tuple[int, ...] | None) -> str:
    return "no tensor" if shape is None else f"a tensor of shape {list(shape)}"


def _stored_shapes(checkpoint: str) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of the checkpoint's model ``model`` (tied aliases too), from
    the manifest: no tensor is read."""
    location = locate(checkpoint)
    manifest = read_manifest(location)
    stored = StateSections.from_json(manifest.state, checkpoint)
    section = stored.models.get("model")
    if section is None:
        raise ddpckpt.errors.StateMismatchError(
            f"{checkpoint}: not a checkpoint of DdpckptTrainer (it holds no model 'model')"
        )
    prefix, source = stored.layout.model_prefix("model"), FileSource(location, manifest)
    names = {key: key for key in section.keys} | dict(section.aliases)
    return {key: tuple(source.meta(prefix + name)[1]) for key, name in names.items()}


_BUILD_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError,
                 AssertionError, RuntimeError, NotImplementedError)  # fmt: skip


def _config(saved: SavedModelConfig, checkpoint: str) -> Any:
    try:
        return config_class(saved.model_type).from_dict(dict(saved.values))
    except ddpckpt.CheckpointError:
        raise
    except _BUILD_ERRORS as exc:  # a value its configuration class refuses
        raise ddpckpt.CorruptCheckpointError(
            f"{checkpoint}: malformed saved model config: transformers refuses it as a "
            f"{saved.model_type!r} configuration ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc


def _build(cls: type, config: Any, saved: SavedModelConfig, checkpoint: str) -> torch.nn.Module:
    try:
        return cls(config)
    except ddpckpt.CheckpointError:
        raise
    except _BUILD_ERRORS as exc:  # values of the right types that do not fit together
        raise ddpckpt.CorruptCheckpointError(
            f"{checkpoint}: malformed saved model config: {saved.architecture} cannot be built "
            f"from it ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc


@contextmanager
def _bounded_build(checkpoint: str, tensors: int) -> Iterator[None]:
    """Stop a model's construction (on this thread) once it has registered far more
    modules, parameters or buffers than the checkpoint's ``tensors`` could belong to: a
    configuration claiming thousands of layers is refused in a moment, not built."""
    limit = 4 * tensors + 1024
    counted = [0]
    thread = threading.get_ident()

    def count(*_: Any) -> None:
        if threading.get_ident() != thread:
            return
        counted[0] += 1
        if counted[0] > limit:
            raise ddpckpt.CorruptCheckpointError(
                f"{checkpoint}: malformed saved model config: the model it describes has more "
                f"than {limit} modules and tensors, where the checkpoint holds {tensors} tensors"
            )

    modules = torch.nn.modules.module
    handles = [
        modules.register_module_module_registration_hook(count),
        modules.register_module_parameter_registration_hook(count),
        modules.register_module_buffer_registration_hook(count),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
