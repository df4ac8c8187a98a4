"""An optimizer's part of a checkpoint: state and param groups keyed by parameter name.

State is keyed by the *canonical name* of each parameter (a tied one by whichever of its
names the checkpoint knows), with shapes, so reordered module definitions restore the
right moments or fail with a clear error. In the single-model layout parameters outside
the model are named by position; in the named layout (several models, see
:mod:`ddpckpt._format.statelayout`) names are ``<model>/<parameter>`` and a parameter outside
every model is an error. Each state tensor is replicated, per rank or to be verified as its parameter
is, and restoring puts every tensor back on the device and in the dtype it had when saved.

Here: the parameters' names, and checking and restoring stored state; capturing it is
:mod:`ddpckpt._state.optimizer_capture`. Every function here is local to the calling rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ddpckpt._format.codec import TensorRef, decode_refs
from ddpckpt._format.sections import OptimizerSection, ParamGroup
from ddpckpt._format.statelayout import SINGLE, Layout
from ddpckpt._log import get_logger
from ddpckpt._state.dtensor import is_dtensor, local_tensor, new_dtensor_like, restore_dtensor
from ddpckpt._state.model import canonical_key, mismatch_report, read_region, unwrap_model
from ddpckpt._state.snapshot import TensorSource, restoring
from ddpckpt._state.zero import after_restore, is_zero
from ddpckpt.errors import CorruptCheckpointError, StateMismatchError

ParamNames = dict[int, list[str]]  # id(parameter) -> every name it has in the models

_log = get_logger(__name__)


def param_names(models: Mapping[str, nn.Module], layout: Layout = SINGLE) -> ParamNames:
    """Every name of each parameter of ``models``, by ``id`` (tied weights have several),
    as optimizer state in ``layout`` names it."""
    names: ParamNames = {}
    for model_name, model in models.items():
        root = unwrap_model(model)
        for name, param in root.named_parameters(remove_duplicate=False):
            key = layout.param_name(model_name, canonical_key(root, name))
            names.setdefault(id(param), []).append(key)
    return names


def group_param_names(
    names: ParamNames,
    optimizer: torch.optim.Optimizer,
    stored: list[set[str]] | None = None,
    label: str | None = None,
) -> list[list[str]]:
    """Each param group's parameter names.

    A tied parameter has several names: it takes whichever of them ``stored`` lists for
    its group (so state saved as ``emb.weight`` reaches a model that now defines ``head``
    first), else its first name in the module's definition order. A parameter outside
    the models is named by its position, or, given the optimizer's ``label`` (the named
    layout), is an error.
    """
    result = []
    for g, group in enumerate(optimizer.param_groups):
        known = stored[g] if stored is not None and g < len(stored) else set()
        group_names = []
        for i, p in enumerate(group["params"]):
            if id(p) in names:
                group_names.append(next((n for n in names[id(p)] if n in known), names[id(p)][0]))
            elif label is None:
                group_names.append(f"@group{g}.{i}")
            else:
                raise StateMismatchError(
                    f"{label}: parameter {i} of param group {g} (shape {list(p.shape)}) belongs "
                    "to no model of the TrainingState; add the module that owns it to the state"
                )
        result.append(group_names)
    return result


def _live_names(
    section: OptimizerSection, names: ParamNames, optimizer: torch.optim.Optimizer
) -> list[list[str]]:
    """Names to match stored state against: parameter names, or positions for imports."""
    if section.by_position:
        return [
            [f"@group{g}.{i}" for i in range(len(group["params"]))]
            for g, group in enumerate(optimizer.param_groups)
        ]
    stored = [set(group.params) for group in section.groups]
    if section.groups_rebuilt:  # matched by parameters, not position: a tie's name from any
        every = set().union(*stored)
        stored = [every] * len(optimizer.param_groups)
    return group_param_names(names, optimizer, stored)


def _stored_groups(
    section: OptimizerSection, live_names: list[list[str]]
) -> tuple[list[ParamGroup], str | None]:
    """The stored param groups, one per live group in the live order, and why not, if they
    cannot be. Groups an import rebuilt (``groups_rebuilt``) are cut to the live groups by
    their parameters: each live group takes the hyperparameters of the stored group holding
    its parameters, when one holds all of them and every stored parameter goes to exactly
    one live group; other groups are matched by position."""
    if not section.groups_rebuilt:
        return section.groups, None
    home = {name: g for g, group in enumerate(section.groups) for name in group.params}
    regrouped = []
    for g, names in enumerate(live_names):
        found = [home.get(name) for name in names]
        if None in found:
            name = names[found.index(None)]
            why = f"live param group {g} holds {name!r}, which it has no group for"
            return section.groups, why
        owners = [o for o in found if o is not None]  # all of them
        if len(set(owners)) > 1:
            other = next(n for n, o in zip(names, owners, strict=True) if o != owners[0])
            first = names[0]
            return section.groups, (
                f"live param group {g} holds {first!r} and {other!r}, which it gave different "
                "hyperparameters"
            )
        if owners:
            regrouped.append(ParamGroup(list(names), section.groups[owners[0]].hyper))
    left = sorted(set(home) - {name for names in live_names for name in names})
    if left or len(regrouped) != len(live_names):
        what = f"{left[0]!r} is in no live param group" if left else "a live group is empty"
        return section.groups, what
    return regrouped, None


def rebuilt_group_hyper(
    optimizer: torch.optim.Optimizer, names: ParamNames, section: OptimizerSection
) -> list[Any] | None:
    """For groups an import rebuilt (``groups_rebuilt``): the encoded hyperparameters each
    live group takes, in the live order (``None`` otherwise, or if they cannot be matched,
    which :func:`check_optimizer` reports)."""
    if not section.groups_rebuilt:
        return None
    groups, why = _stored_groups(section, _live_names(section, names, optimizer))
    return None if why is not None else [group.hyper for group in groups]


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    names: ParamNames,
    section: OptimizerSection,
    where: str,
    label: str = "optimizer",
    source: TensorSource | None = None,
) -> None:
    """Raise :class:`StateMismatchError` unless the stored state fits ``optimizer`` by name
    (``names`` from :func:`param_names`; ``label`` names the optimizer in messages), and,
    given the ``source`` of its tensors, :class:`CorruptCheckpointError` if a moment of a
    ``torch.optim`` optimizer is not of its parameter's recorded shape."""
    if source is not None and type(optimizer).__module__.startswith("torch.optim"):
        _check_moment_shapes(section, source, where, label)
    shapes = section.shapes
    live_names = _live_names(section, names, optimizer)
    stored_groups, why = _stored_groups(section, live_names)
    if why is not None:
        raise StateMismatchError(
            f"{where}: the checkpoint's {label} was imported with the hyperparameters of each "
            "parameter (torchtitan's flattened state, which keeps no group order), and is "
            f"matched to the live {type(optimizer).__qualname__}'s param groups by their "
            f"parameters: {why}. Group the parameters as the run that saved it did"
        )
    if len(stored_groups) != len(live_names):
        raise StateMismatchError(
            f"{where}: the checkpoint's {label} has {len(stored_groups)} param group(s), "
            f"the live {type(optimizer).__qualname__} has {len(live_names)}"
        )
    problems = []
    for g, (stored, group_names, group) in enumerate(
        zip(stored_groups, live_names, optimizer.param_groups, strict=True)
    ):
        live_shapes = {n: list(p.shape) for n, p in zip(group_names, group["params"], strict=True)}
        missing = [n for n in group_names if n not in stored.params]
        unexpected = [n for n in stored.params if n not in live_shapes]
        wrong = [
            f"{n}: checkpoint {recorded}, model {live_shapes[n]}"
            for n in stored.params
            if n in live_shapes
            and (recorded := shapes[n]) is not None
            and list(recorded) != live_shapes[n]
        ]
        if missing or unexpected or wrong:
            problems.append(f" param group {g}:\n{mismatch_report(missing, unexpected, wrong)}")
    if source is not None and not problems:
        _check_regions(section, source, live_names, optimizer)
    if problems:
        outside = [n for names in live_names for n in names if n.startswith("@")]
        if outside and not section.by_position:
            problems.append(
                f" {len(outside)} of the {label}'s parameters are not parameters of the model "
                "passed; pass the model the optimizer was built over"
            )
        raise StateMismatchError(
            f"{where}: the checkpoint's {label} state does not match the live "
            f"{type(optimizer).__qualname__}'s parameters (matched by name):\n"
            + "\n".join(problems)
        )


# The state torch.optim's optimizers keep in their parameter's shape (LBFGS and Adafactor
# keep others under other names).
_PARAM_SHAPED = frozenset({
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "sum",
    "square_avg", "acc_delta", "grad_avg", "prev", "step_size", "ax",
})  # fmt: skip


def _check_regions(
    section: OptimizerSection, source: TensorSource, live_names: list[list[str]], optimizer: Any
) -> None:
    """Have ``source`` locate what the load will read of each parameter's stored state (a
    sharded tensor's index files and data files), so damage there is found before anything
    is written."""
    live = {
        name: param
        for names, group in zip(live_names, optimizer.param_groups, strict=True)
        for name, param in zip(names, group["params"], strict=True)
    }
    state = section.state if isinstance(section.state, dict) else {}
    for name, values in state.items():
        param = live.get(name)
        if param is None or not isinstance(values, dict):
            continue
        for ref in values.values():
            if isinstance(ref, dict) and isinstance(ref.get("$tensor"), str) and len(ref) == 1:
                source.meta(ref["$tensor"], read_region(param, name))


def _check_moment_shapes(
    section: OptimizerSection, source: TensorSource, where: str, label: str
) -> None:
    """A checkpoint whose ``exp_avg`` of a [3, 4] parameter is [2**29] loads, and the next
    ``optimizer.step()`` fails far from the cause: refused here, before anything changes."""
    state = section.state if isinstance(section.state, dict) else {}
    for name, values in state.items():
        recorded = section.shapes.get(name)
        if not isinstance(recorded, list) or not isinstance(values, dict):
            continue
        for key in _PARAM_SHAPED & values.keys():
            ref = values[key]
            if isinstance(ref, dict) and isinstance(ref.get("$tensor"), str) and len(ref) == 1:
                shape = list(source.meta(ref["$tensor"])[1])
                if shape != list(recorded):
                    raise CorruptCheckpointError(
                        f"{where}: the checkpoint's {label} state {key!r} of {name!r} has shape "
                        f"{shape}, its parameter {list(recorded)}: the checkpoint is damaged"
                    )


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    names: ParamNames,
    section: OptimizerSection,
    source: TensorSource,
    where: str,
) -> None:
    """Load optimizer state matched by parameter name (call :func:`check_optimizer` first).

    A ``ZeroRedundancyOptimizer`` loads into its local optimizer the state of the
    parameters it owns now, and nothing else.
    """
    if is_zero(optimizer):
        if section.groups_rebuilt:  # cut to the wrapper's groups, which its local one follows
            groups, why = _stored_groups(section, _live_names(section, names, optimizer))
            if why is not None:
                raise StateMismatchError(f"{where}: {why}")
            section = replace(section, groups=groups, groups_rebuilt=False)
        restore_optimizer(optimizer.optim, names, section, source, where)  # type: ignore[attr-defined]
        after_restore(optimizer)
        return
    live_names = _live_names(section, names, optimizer)
    array = lambda name: source.get(name).numpy().copy()  # noqa: E731
    stored_state = decode_refs(section.state, array, where=where)
    if section.by_position:
        _log.warning(
            "%s: optimizer state was imported from a torch.save file, which keys it by "
            "position: it is matched to the live parameters in order (shapes checked)",
            where,
        )
    stored_groups, why = _stored_groups(section, live_names)
    if why is not None:  # check_optimizer refused it already, unless it was not called
        raise StateMismatchError(f"{where}: {why}")
    param_groups, state, index = [], {}, 0
    for stored, group_names, group in zip(
        stored_groups, live_names, optimizer.param_groups, strict=True
    ):
        indices = []
        hyper = decode_refs(stored.hyper, array, where=where)
        fused = bool(hyper.get("fused")) or bool(hyper.get("capturable"))
        kept = _Kept(fused, section.placement or {}, set(section.own_dtype or ()))
        for name, param in zip(group_names, group["params"], strict=True):
            if name in stored_state:
                live = optimizer.state.get(param, {})
                state[index] = {
                    key: _materialize(value, key, param, kept, source, live.get(key))
                    for key, value in stored_state[name].items()
                }
            indices.append(index)
            index += 1
        param_groups.append({**_cloned(hyper, source), "params": indices})
    with restoring(f"{type(optimizer).__qualname__}.load_state_dict", where):
        optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    # load_state_dict moves every value beside its parameter; put back those kept elsewhere.
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, values in state.items():
        optimizer.state[params[index]].update(values)


@dataclass
class _Kept:
    """Where a param group's optimizer state goes: its flags and what the save recorded."""

    fused: bool  # fused or capturable: torch wants ``step`` as float32 beside the parameter
    placement: Mapping[str, str]  # key -> "param" or "host", from a save off the CPU
    own_dtype: set[str]  # keys whose dtype differed from their parameter's

    def target(self, key: str, param: torch.Tensor, stored: torch.dtype) -> tuple[Any, Any]:
        """Device and dtype of the state tensor ``key`` of ``param``."""
        where = self.placement.get(key)
        if key == "step":
            if self.fused:
                return param.device, torch.float32
            return (param.device if where == "param" else torch.device("cpu")), stored
        if where == "host":
            return torch.device("cpu"), stored
        keep = key in self.own_dtype or not param.is_floating_point()
        return param.device, (stored if keep else param.dtype)


def _materialize(
    value: Any, key: str, param: torch.Tensor, kept: _Kept, source: TensorSource, live: Any = None
) -> Any:
    """Read a stored optimizer value straight onto the device and dtype it had when saved.

    Follows ``Optimizer._process_value_according_to_param_policy`` (state beside its
    parameter, in its dtype; ``step`` on the host unless fused or capturable), corrected by
    what the save recorded (see :func:`~ddpckpt._state.placement.note_placement`), so that ``load_state_dict`` has
    nothing left to copy and the state never shares memory with the checkpoint file.

    ``live`` is the optimizer's current value under ``key`` (on a resume: the state of the
    steps since): a tensor of the same shape, dtype and device (a DTensor: also the same
    global shape) is overwritten in place, so a load never holds the optimizer's state
    twice; otherwise (a fresh optimizer) the value is read into a new tensor. A checksum
    failure found while reading in place leaves the optimizer partly updated (see
    :func:`ddpckpt._io.load.load`).
    """
    if isinstance(value, TensorRef):
        stored_dtype, shape = source.meta(str(value))
        device, dtype = kept.target(key, param, stored_dtype)
        if is_dtensor(param) and shape == tuple(param.shape) and key != "step":
            if _fits(live, shape, dtype, device, sharded=True):
                restore_dtensor(live, str(value), source)
                return live
            return new_dtensor_like(param, str(value), dtype, device, source)
        fits = _fits(live, shape, dtype, device, sharded=False)
        target = live if fits else torch.empty(shape, dtype=dtype, device=device)
        got = source.get(str(value), like=target)
        if got is not target:
            with torch.no_grad():
                target.copy_(got)
        return target
    if isinstance(value, dict):
        return {k: _materialize(v, k, param, kept, source) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v, key, param, kept, source) for v in value)
    return value


def _fits(
    live: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, sharded: bool
) -> bool:
    """Whether the live state value ``live`` can take a stored tensor of ``shape`` in place
    (``sharded``: as a DTensor, its local shard)."""
    if not isinstance(live, torch.Tensor) or is_dtensor(live) != sharded:
        return False
    local = local_tensor(live)
    return (
        tuple(live.shape) == tuple(shape)
        and live.dtype == dtype
        and local.device == torch.device(device)
        and not live.requires_grad
    )


def _cloned(value: Any, source: TensorSource) -> Any:
    """``value`` with every unread tensor reference replaced by a private CPU copy."""
    if isinstance(value, TensorRef):
        return source.get(str(value)).clone()
    if isinstance(value, dict):
        return {k: _cloned(v, source) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v, source) for v in value)
    return value
