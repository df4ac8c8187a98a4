"""What a :class:`~ddpckpt.integrations.transformers.DdpckptTrainer` checkpoint says about
the Trainer and the model, read as untrusted input: the saved ``TrainerState`` and the
model's configuration, each a JSON string inside the manifest.

Both go through the trust boundary (:mod:`ddpckpt._format.boundary`: capped JSON, typed
fields); every field is checked against its type and range before anything uses it, so any
document gives a typed record or :class:`~ddpckpt.errors.CorruptCheckpointError` naming the
checkpoint and the field. Nothing here calls code the document names: the model class is
looked up by ``model_type`` in transformers' own auto mappings
(:func:`model_class`), never by a name taken from the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel, TrainerState
from transformers.models.auto import configuration_auto, modeling_auto
from transformers.models.auto.auto_factory import _LazyAutoMapping

from ddpckpt._format.boundary import MAX_INT, Fields, check_int, load_json
from ddpckpt.errors import CorruptCheckpointError

MAX_STATE_BYTES = 64 << 20  # a TrainerState's JSON: its log history grows with the run
MAX_CONFIG_BYTES = 16 << 20  # a model configuration's JSON
MAX_NAME = 256  # characters of a key, a model type or a class name
MAX_TEXT = 1 << 16  # characters of any other string value
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}", re.ASCII)
_STEPS = ("logging_steps", "eval_steps", "save_steps")  # an int, or a ratio of max_steps
_COUNTS = ("global_step", "max_steps", "num_train_epochs", "num_input_tokens_seen")
_FLAGS = ("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search")
_KNOWN_STATE = {f.name for f in fields(TrainerState)}
_DTYPES = {"auto", "float32", "float16", "bfloat16", "float64", "float", "half", "double",
           "int8", "uint8", "float8_e4m3fn", "float8_e5m2"}  # fmt: skip


# ------------------------------------------------------------------ the TrainerState


def trainer_state_from_json(text: Any, where: str) -> TrainerState:
    """The ``TrainerState`` saved as ``text`` in the checkpoint ``where``, every field
    checked (:class:`CorruptCheckpointError` naming it otherwise); local, any process."""
    if not isinstance(text, (str, bytes)):
        raise CorruptCheckpointError(f"{where}: the saved trainer_state is not a JSON text")
    doc = load_json(text, where, "saved trainer_state", limit=MAX_STATE_BYTES)
    f = Fields(doc, where, "saved trainer_state")
    unknown = sorted(set(doc) - _KNOWN_STATE)
    if unknown:
        raise f.error(f"is no field of transformers' TrainerState ({len(unknown)} such)",
                      unknown[0][:MAX_NAME])  # fmt: skip
    values: dict[str, Any] = {}
    for name in _COUNTS:
        values[name] = f.integer(name, 0, MAX_INT, 0)
    for name in _STEPS:
        values[name] = _steps(f, name)
    values["epoch"] = _non_negative(f, "epoch")
    values["total_flos"] = _non_negative(f, "total_flos")
    values["train_batch_size"] = f.integer("train_batch_size", 1, MAX_INT, None, optional=True)
    values["best_global_step"] = f.integer("best_global_step", 0, MAX_INT, None, optional=True)
    best = f.value("best_metric", None)
    values["best_metric"] = None if best is None else f.number("best_metric")
    for name in _FLAGS:
        values[name] = _flag(f, name, name != "is_hyper_param_search")
    for name in ("best_model_checkpoint", "trial_name"):
        value = f.value(name, None)
        values[name] = None if value is None else f.text(name, max_length=MAX_TEXT)
    values["log_history"] = [
        _scalars(entry, f, "log_history") for entry in f.sequence("log_history", [])
    ]
    params = f.value("trial_params", None)
    values["trial_params"] = None if params is None else _scalars(params, f, "trial_params")
    callbacks = f.mapping("stateful_callbacks", {})
    values["stateful_callbacks"] = {
        _name(name, f, "stateful_callbacks"): _callback_states(state, f)
        for name, state in callbacks.items()
    }
    return TrainerState(**values)


def _steps(f: Fields, name: str) -> int | float:
    value = f.value(name, 500)
    if type(value) is int:
        return check_int(value, 0, MAX_INT, lambda p: f.error(p, name))
    if type(value) is float and 0 <= value < 1:  # a ratio of max_steps, as the arguments allow
        return value
    raise f.error("is not an integer >= 0 or a ratio in [0, 1)", name)


def _non_negative(f: Fields, name: str) -> float:
    value = f.number(name, 0.0)
    if value < 0:
        raise f.error(f"is {value!r:.40}, not >= 0", name)
    return value


def _flag(f: Fields, name: str, default: bool) -> bool:
    value = f.value(name, default)
    if type(value) is not bool:
        raise f.error("is not true or false", name)
    return value


def _name(name: str, f: Fields, field: str) -> str:
    if len(name) > MAX_NAME:
        raise f.error(f"has a key of {len(name)} characters (at most {MAX_NAME})", field)
    return name


def _scalar(value: Any, f: Fields, field: str) -> Any:
    if value is None or type(value) in (bool, int, str):
        if type(value) is int and not -MAX_INT <= value <= MAX_INT:
            raise f.error("holds an integer out of the 64-bit range", field)
        if type(value) is str and len(value) > MAX_TEXT:
            raise f.error(f"holds a string of {len(value)} characters", field)
        return value
    if type(value) is float and math.isfinite(value):
        return value
    raise f.error(f"holds {type(value).__name__}, not a number, string, boolean or null", field)


def _scalars(doc: Any, f: Fields, field: str) -> dict[str, Any]:
    """A JSON object of scalars (a log entry, trial parameters, a callback's arguments)."""
    if not isinstance(doc, dict):
        raise f.error("holds something that is not a JSON object", field)
    return {_name(k, f, field): _scalar(v, f, field) for k, v in doc.items()}


def _callback_states(state: Any, f: Fields) -> Any:
    """One callback's ``{"args": {...}, "attributes": {...}}``, or a list of them."""
    if isinstance(state, list):
        return [_callback_state(s, f) for s in state]
    return _callback_state(state, f)


def _callback_state(state: Any, f: Fields) -> dict[str, dict[str, Any]]:
    field = "stateful_callbacks"
    if not isinstance(state, dict) or set(state) - {"args", "attributes"}:
        raise f.error("holds a callback state that is not {args, attributes}", field)
    return {key: _scalars(state.get(key, {}), f, field) for key in ("args", "attributes")}


# ------------------------------------------------------------------ the model's configuration


@dataclass(frozen=True)
class SavedModelConfig:
    """A model configuration saved in a checkpoint, checked: the ``model_type``, the one
    class ``architectures`` names, and every field of the configuration (each of the type
    the configuration class's own default has, or a plain JSON value where it has none)."""

    model_type: str
    architecture: str
    values: dict[str, Any]


def model_config_from_json(text: Any, where: str) -> SavedModelConfig:
    """The model configuration saved as ``text`` in the checkpoint ``where``; local.

    Raises :class:`CorruptCheckpointError` naming the field for any document that is not a
    configuration of a model type transformers knows, with one architecture name and
    fields of the types its configuration class gives them.
    """
    if not isinstance(text, (str, bytes)):
        raise CorruptCheckpointError(f"{where}: the saved model config is not a JSON text")
    doc = load_json(text, where, "saved model config", limit=MAX_CONFIG_BYTES)
    f = Fields(doc, where, "saved model config")
    model_type = f.text("model_type", max_length=MAX_NAME)
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        raise f.error(f"is {model_type[:80]!r}, no model type of transformers", "model_type")
    names = f.sequence("architectures")
    if len(names) != 1 or not isinstance(names[0], str) or not _IDENTIFIER.fullmatch(names[0]):
        raise f.error("is not a list of one class name", "architectures")
    defaults = _defaults(model_type)
    values = {}
    for key, value in doc.items():
        _name(key, f, "(a key)")
        values[key] = _typed(value, defaults.get(key), f, key)
    for key in ("dtype", "torch_dtype"):  # transformers looks these up as names of torch
        if values.get(key) is not None and values[key] not in _DTYPES:
            raise f.error(f"is {values[key]!r:.60}, no dtype transformers saves", key)
    return SavedModelConfig(model_type, names[0], values)


def config_class(model_type: str) -> type[PretrainedConfig]:
    """The configuration class transformers maps ``model_type`` to (a known type)."""
    return configuration_auto.CONFIG_MAPPING[model_type]


_DEFAULTS: dict[str, dict[str, Any]] = {}


def _defaults(model_type: str) -> dict[str, Any]:
    """The fields of a default configuration of ``model_type``, and their values."""
    if model_type not in _DEFAULTS:
        _DEFAULTS[model_type] = config_class(model_type)().to_dict()
    return _DEFAULTS[model_type]


def _typed(value: Any, default: Any, f: Fields, key: str) -> Any:
    """``value`` if it has the JSON type of ``default`` (ints pass for floats; ``null``
    passes where a default is ``None`` or optional), checked to the leaves."""
    _plain(value, f, key, 0)
    if value is None or default is None:
        return value
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,),
             dict: (dict,)}.get(type(default), ())  # fmt: skip
    if kinds and type(value) not in kinds:
        raise f.error(f"is {type(value).__name__}, where the configuration has "
                      f"{type(default).__name__}", key)  # fmt: skip
    return value


def _plain(value: Any, f: Fields, key: str, depth: int) -> None:
    """A JSON value of bounded scalars (the caps of :func:`_scalar`), nested at most 32
    levels."""
    if depth > 32:
        raise f.error("nests deeper than 32 levels", key)
    if isinstance(value, dict):
        for k, v in value.items():
            _name(k, f, key)
            _plain(v, f, key, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _plain(v, f, key, depth + 1)
    else:
        _scalar(value, f, key)


def model_class(saved: SavedModelConfig, where: str) -> type[PreTrainedModel]:
    """The class of transformers ``saved.architecture`` names among those its auto
    mappings give ``saved.model_type``; checked to be a ``PreTrainedModel`` whose
    configuration class is of that model type. :class:`CorruptCheckpointError` otherwise
    (a class of the user's own: pass ``model=``)."""
    config_cls = config_class(saved.model_type)
    offered: list[str] = []
    for name, mapping in vars(modeling_auto).items():
        names = vars(modeling_auto).get(f"{name}_NAMES")
        if not isinstance(mapping, _LazyAutoMapping) or not isinstance(names, dict):
            continue
        listed = names.get(saved.model_type)
        listed = (listed,) if isinstance(listed, str) else tuple(listed or ())
        offered += [n for n in listed if n not in offered]
        if saved.architecture not in listed:
            continue
        found = mapping[config_cls]
        for cls in found if isinstance(found, (tuple, list)) else (found,):
            if (
                isinstance(cls, type)
                and cls.__name__ == saved.architecture
                and issubclass(cls, PreTrainedModel)
                and getattr(getattr(cls, "config_class", None), "model_type", None)
                == saved.model_type
            ):
                return cls
    raise CorruptCheckpointError(
        f"{where}: malformed saved model config: field 'architectures' names "
        f"{saved.architecture!r}, which is no model class transformers gives the model type "
        f"{saved.model_type!r} ({', '.join(offered[:8]) or 'none'}); if the checkpoint holds "
        "a class of your own, pass model= (an instance of it) to export_pretrained"
    )
