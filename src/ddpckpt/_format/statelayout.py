"""Where each part of the training state sits in a manifest's ``state``, in both layouts.

* **Single-model layout** (format versions 1 to 3, and what the keyword shorthand still
  writes): one section per role, ``state["model"]``, ``state["optimizer"]``,
  ``state["scheduler"]``, ``state["scaler"]``; model tensors are ``model/<key>``,
  optimizer state ``optimizer/...``; optimizer state is keyed by the model's parameter
  names; per-rank buffers are ``ranks[r]["model_buffers"]`` (from format 3 in rank ``r``'s file).
* **Named layout** (format version 4): ``state["models"]``, ``state["optimizers"]``,
  ``state["schedulers"]``, ``state["scalers"]`` map each object's name to its section;
  model tensors are ``model/<name>/<key>``, an optimizer's ``optimizer/<name>/...``;
  optimizer state is keyed by ``<model name>/<parameter name>``; per-rank buffers are
  ``ranks[r]["models_buffers"][<name>]``.

``state["extra"]`` is the same in both. The name a single-model section reads back
under is the shorthand's (``"model"``, ``"optimizer"`` ...). A checkpoint of one nested dict
(:mod:`ddpckpt._io.dict_checkpoint`, format version 4) holds only ``state["dict"]``: the
encoded tree and the device each tensor was saved from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# role -> (single-model section key and name, named-layout section key)
ROLE_KEYS = {
    "models": ("model", "models"),
    "optimizers": ("optimizer", "optimizers"),
    "schedulers": ("scheduler", "schedulers"),
    "scalers": ("scaler", "scalers"),
}
DICT_KEY = "dict"
SINGLE_VERSION = 2
NAMED_VERSION = 4


@dataclass(frozen=True)
class Layout:
    """How names become section keys and tensor names (see the module docstring)."""

    named: bool

    @property
    def version(self) -> int:
        return NAMED_VERSION if self.named else SINGLE_VERSION

    def model_prefix(self, name: str) -> str:
        """What a model's tensor names start with (the model file holds what follows
        ``model/``)."""
        return f"model/{name}/" if self.named else "model/"

    def model_extra_prefix(self, name: str) -> str:
        """The tensor prefix of a model's non-tensor extra state."""
        return f"model_extra_state/{name}" if self.named else "model_extra_state"

    def prefix(self, role: str, name: str) -> str:
        """The tensor prefix of an optimizer's, scheduler's or scaler's state."""
        single = ROLE_KEYS[role][0]
        return f"{single}/{name}" if self.named else single

    def param_name(self, model: str, key: str) -> str:
        """How optimizer state names a parameter of ``model`` under the canonical ``key``."""
        return f"{model}/{key}" if self.named else key

    def buffers_prefix(self, name: str) -> str:
        """The per-rank tensor prefix of a model's buffers kept per rank."""
        return f"model_buffers/{name}" if self.named else "model_buffers"

    @property
    def buffers_key(self) -> str:
        """The per-rank key of buffers kept per rank (``broadcast_buffers=False``)."""
        return "models_buffers" if self.named else "model_buffers"

    def rank_buffers(self, rank_state: Mapping[str, Any], name: str) -> Any:
        """The encoded per-rank buffers of model ``name`` in ``rank_state``, or ``None``."""
        if self.named:
            return rank_state.get(self.buffers_key, {}).get(name)
        return rank_state.get(self.buffers_key)


SINGLE = Layout(named=False)
NAMED = Layout(named=True)


def layout_of(state: Mapping[str, Any]) -> Layout:
    """The layout of a manifest's ``state``."""
    return NAMED if any(named in state for _, named in ROLE_KEYS.values()) else SINGLE


def layout_version(state: Mapping[str, Any]) -> int:
    """The format version a manifest with this ``state`` is written with: the oldest that
    describes it, so that checkpoints in the single-model layout stay readable by
    versions of ddpckpt that know nothing of the named one."""
    return NAMED_VERSION if DICT_KEY in state else layout_of(state).version


def named_sections(state: Mapping[str, Any], role: str) -> dict[str, Any]:
    """The sections of ``role`` by name, in either layout."""
    single, named = ROLE_KEYS[role]
    if named in state:
        return dict(state[named])
    return {single: state[single]} if single in state else {}
