"""DDP's gradient buckets: their layout recorded at save and put back into the live DDP at load.

DDP all-reduces gradients in flat buckets. It lays them out at construction in parameter
order and, after its first synchronised backward, lays them out once more in the order the
gradients became ready (rank 0's order), for good. Where an element sits in its bucket
decides in which order the ranks' values are added (a ring all-reduce starts each chunk at
another rank), and float addition is not associative: from 3 ranks on, a restarted process,
back on the construction-time layout, computes its first gradients a few ulp away from the
uninterrupted run's, and the runs drift apart. With 1 or 2 ranks the layout changes nothing.

What a save records (:class:`~ddpckpt._format.sections.DDPBuckets`, in the model's section):

* ``"rebuilt"``: the layout, each bucket's parameters by canonical name. It comes from DDP's
  own logging data, or, in the one step between the rebuild and that data's next update,
  from the reducer's buckets (which allocates zeros the size of the gradients, once).
* ``"initial"``: DDP has not laid the buckets out again, and a new DDP is in the same
  position: nothing reduced yet, or ``find_unused_parameters=True`` without ``static_graph``
  (DDP then keeps its first layout for good).
* ``"unsettled"``: DDP has reduced but not yet rebuilt (a checkpoint of the first step, or of
  the first two with ``static_graph``). Its rebuild will follow a gradient order that torch
  does not expose, so a resume from here cannot be made exact.
* ``"none"``: no reducer (no DDP, or a DDP that reduces without one).

A load gives a DDP whose layout differs from the record a new reducer, built by DDP's own
``_ddp_init_helper`` (as torch does when it unpickles a DDP) with the recorded buckets as its
construction-time layout, static graph and Python communication hooks carried over. Such a
reducer rebuilds once more after its first synchronised backward, from the same gradient
order, hence into the same layout; the next save checks that it did and warns otherwise.
What cannot be put back (a built-in communication hook, ``mixed_precision``, optimizers in
backward, parameters that do not match the record, an unsettled or unrecorded checkpoint) is
said in a warning at load when the job has 3 ranks or more.

Every function here is local to the calling rank; DDP keeps the layout identical on every
rank, and every rank installs the same one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpckpt._format.sections import DDPBuckets
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._state.model import canonical_key
from ddpckpt._training.wrappers import wrappers

_log = get_logger(__name__)
_INEXACT = (
    "from 3 ranks on, the resumed run's gradients are summed in another order than an "
    "uninterrupted run's and differ from them in the last bits"
)


@dataclass(frozen=True)
class _Installed:
    """A reducer this module built, and the layout it was given (parameter indices)."""

    reducer_id: int
    layout: list[list[int]]


# The reducers installed at load, per DDP: until DDP logs their rebuild, their layout is known
# only from here.
_installed: weakref.WeakKeyDictionary[nn.Module, _Installed] = weakref.WeakKeyDictionary()
_misfits: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # DDPs warned about at a save


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP in ``model``'s chain of wrappers (DDP, DataParallel, torch.compile), if any."""
    return next((m for m in wrappers(model) if isinstance(m, DistributedDataParallel)), None)


def _reducer(ddp: DistributedDataParallel) -> Any:
    """DDP's C++ reducer, or ``None`` where it reduces without one (compiled autograd's
    Python reducer, or every parameter's all-reduce delayed)."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(
        ddp, "_delay_all_reduce_all_params", False
    ):
        return None
    return getattr(ddp, "reducer", None)


def _reducer_params(ddp: DistributedDataParallel) -> tuple[list[torch.Tensor], list[str]]:
    """The parameters as the reducer indexes them, and their canonical names."""
    params, _ = ddp._build_params_for_reducer()
    named: dict[int, str] = {}
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):  # as DDP: first name of a tied one
            named.setdefault(id(p), f"{module_name}.{name}" if module_name else name)
    return params, [canonical_key(ddp.module, named[id(p)]) for p in params]


def _logged_layout(data: dict[str, Any]) -> list[list[int]] | None:
    """The rebuilt layout from DDP's logging data, once DDP has logged it there."""
    text = data.get("rebuilt_per_bucket_param_indices")
    if not data.get("has_rebuilt_buckets") or not isinstance(text, str):
        return None
    try:
        return [[int(i) for i in bucket.split()] for bucket in text.split(",")]
    except ValueError:  # written otherwise by another torch: the buckets themselves say it
        return None


def _bucket_layout(ddp: DistributedDataParallel, params: list[torch.Tensor]) -> list[list[int]]:
    """The reducer's current buckets, read from the buckets themselves."""
    index = {id(p): i for i, p in enumerate(params)}
    buckets = _reducer(ddp)._get_zeros_like_grad_buckets()
    return [[index.get(id(p), -1) for p in bucket.parameters()] for bucket in buckets]


def _rebuilds(ddp: DistributedDataParallel) -> bool:
    """Whether DDP lays its buckets out again after its first reduction."""
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def _live_layout(
    ddp: DistributedDataParallel, params: list[torch.Tensor]
) -> tuple[str, list[list[int]] | None]:
    """``(state, layout)`` of ``ddp``'s reducer now, as :class:`DDPBuckets` states it."""
    data = ddp._get_ddp_logging_data()
    logged = _logged_layout(data)
    installed = _installed.get(ddp)
    if installed is not None and installed.reducer_id == id(_reducer(ddp)):
        if logged is not None and logged != installed.layout:
            if _world_size(ddp) >= 3:
                _log.warning(
                    "DDP laid out its gradient buckets differently after the resume than the "
                    "checkpoint recorded (its gradients became ready in another order in the "
                    "first step after the resume); %s",
                    _INEXACT,
                    extra=same_on_every_rank(),
                )
            _installed.pop(ddp)
            return "rebuilt", logged
        return "rebuilt", installed.layout
    if ddp._has_rebuilt_buckets:
        return "rebuilt", logged if logged is not None else _bucket_layout(ddp, params)
    if _rebuilds(ddp) and _has_reduced(ddp):
        return "unsettled", None
    return "initial", None


def _has_reduced(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` has run a synchronised backward: the reducer's per-parameter timings
    are set from the first one on (a static graph's first backward leaves them alone)."""
    if ddp.static_graph and getattr(ddp, "_static_graph_delay_allreduce_enqueued", False):
        return True
    return any(_reducer(ddp).get_backward_stats())


def record_buckets(model: nn.Module) -> DDPBuckets:
    """What a checkpoint of ``model`` records of its DDP's bucket layout (reads, changes nothing)."""
    ddp = find_ddp(model)
    if ddp is None or _reducer(ddp) is None:
        return DDPBuckets("none")
    params, names = _reducer_params(ddp)
    state, layout = _live_layout(ddp, params)
    if layout is not None and sorted(i for b in layout for i in b) != list(range(len(params))):
        if ddp not in _misfits:
            _misfits.add(ddp)
            _log.warning(
                "DDP's gradient buckets do not hold the parameters of the module it wraps (were "
                "parameters added or frozen after wrapping it?): their layout is not recorded, "
                "and from 3 ranks on a run resumed from this checkpoint sums its gradients in "
                "another order than an uninterrupted run and differs from it in the last bits",
                extra=same_on_every_rank(),
            )
        return DDPBuckets("none")
    buckets = [[names[i] for i in bucket] for bucket in layout or []]
    views = ddp.gradient_as_bucket_view and all(
        p.grad is not None and p.grad._is_view() for p in params
    )
    return DDPBuckets(state, buckets, views)


def _world_size(ddp: DistributedDataParallel) -> int:
    return dist.get_world_size(ddp.process_group)


def _warn_inexact(ddp: DistributedDataParallel, where: str, label: str, why: str) -> None:
    if _world_size(ddp) >= 3:
        _log.warning(
            "%s: DDP's gradient bucket layout of %s cannot be restored: %s; %s",
            where,
            label,
            why,
            _INEXACT,
            extra=same_on_every_rank(),
        )


def _unsupported(ddp: DistributedDataParallel) -> str | None:
    """Why a new reducer could not be set up as the current one is, if it could not."""
    if not all(hasattr(ddp, name) for name in _DDP_API) or not hasattr(dist, _ASSIGNMENT):
        return f"this version of torch ({torch.__version__}) builds DDP's reducer differently"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "the DDP uses mixed_precision"
    if any(hasattr(p, "_in_backward_optimizers") for p in ddp._module_parameters):
        return "optimizers run in backward (apply_optimizer_in_backward)"
    if ddp._get_ddp_logging_data().get("comm_hook") and not ddp._comm_hooks:
        return "a built-in communication hook is registered (register_comm_hook() hooks are fine)"
    return None


def _layout_indices(
    saved: list[list[str]], params: list[torch.Tensor], names: list[str]
) -> list[list[int]] | None:
    """The saved layout as indices of the reducer's parameters, or ``None`` when it does not
    fit them (other parameters, or a bucket mixing dtypes or devices)."""
    index = {name: i for i, name in enumerate(names)}
    if sorted(n for bucket in saved for n in bucket) != sorted(names):
        return None
    layout = [[index[n] for n in bucket] for bucket in saved]
    for bucket in layout:
        if len({(params[i].dtype, params[i].device) for i in bucket}) != 1:
            return None
    return layout


# What _install uses of DDP besides the reducer's own methods (torch >= 2.4 has all of them).
_DDP_API = ("_ddp_init_helper", "_build_params_for_reducer", "_build_debug_param_to_name_mapping",
            "_comm_hooks", "_module_parameters")  # fmt: skip
_ASSIGNMENT = "_compute_bucket_assignment_by_size"


@contextmanager
def _assignment(layout: list[list[int]], cap: int) -> Iterator[list[bool]]:
    """DDP's bucket assignment at construction answers ``layout`` while this runs; the list
    yielded holds True once it was asked."""
    original = getattr(dist, _ASSIGNMENT)
    asked: list[bool] = []

    def assigned(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        asked.append(True)
        # _ddp_init_helper reverses what it gets, to approximate the gradient-ready order.
        return [list(b) for b in reversed(layout)], [cap] * len(layout)

    setattr(dist, _ASSIGNMENT, assigned)
    try:
        yield asked
    finally:
        setattr(dist, _ASSIGNMENT, original)


def _install(ddp: DistributedDataParallel, layout: list[list[int]] | None) -> bool:
    """Give ``ddp`` a new reducer laid out as ``layout`` (``None``: DDP's own construction-time
    layout), set up like the current one; False if DDP did not take the layout. The old
    reducer's hooks go once the new one is built (both sets of buckets exist meanwhile)."""
    old = ddp.reducer
    params, expect_sparse = ddp._build_params_for_reducer()
    debug_names = ddp._build_debug_param_to_name_mapping(params)
    asked = [True]
    if layout is None:
        ddp._ddp_init_helper(params, expect_sparse, debug_names, ddp.static_graph)
    else:
        with _assignment(layout, ddp.bucket_bytes_cap) as asked:
            ddp._ddp_init_helper(params, expect_sparse, debug_names, ddp.static_graph)
    old._remove_autograd_hooks()
    # _ddp_init_helper (above) always sets ddp.logger, which torch types as Optional
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        cast("dist.Logger", ddp.logger)._set_static_graph()
        ddp._static_graph_delay_allreduce_enqueued = False
    for hook, state in ddp._comm_hooks:
        cast("dist.Logger", ddp.logger)._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
    _installed.pop(ddp, None)
    if layout is not None and asked:
        _installed[ddp] = _Installed(id(ddp.reducer), layout)
    return bool(asked)


def restore_buckets(model: nn.Module, saved: DDPBuckets, where: str, label: str) -> None:
    """Lay out the gradient buckets of ``model``'s DDP as the checkpoint recorded (see the
    module docstring); a layout that cannot be restored is warned about at 3 ranks or more.
    ``where`` (the checkpoint) and ``label`` (the model) name them in the warning.

    Gradients that were views into the buckets at save time (``grad_views``) become zero
    views again: DDP divides a gradient that already lives in its bucket in place, and
    multiplies one it copies in by the reciprocal, which rounds differently."""
    ddp = find_ddp(model)
    if ddp is None or _reducer(ddp) is None or saved.state == "none":
        return
    if saved.state == "unrecorded":
        _warn_inexact(ddp, where, label, "the checkpoint does not record it (written by an "
                      "older ddpckpt, or imported)")  # fmt: skip
        return
    if saved.state == "unsettled":
        _warn_inexact(ddp, where, label, "the checkpoint was saved in DDP's first steps, "
                      "between its first reduction and its rebuild of the buckets")  # fmt: skip
    params, names = _reducer_params(ddp)
    live, live_layout = _live_layout(ddp, params)
    wanted: list[list[int]] | None = None  # None: the construction-time layout
    if saved.state == "rebuilt":
        wanted = _layout_indices(saved.buckets, params, names)
        if wanted is None:
            _warn_inexact(ddp, where, label, "the recorded buckets do not fit the model's "
                          "parameters")  # fmt: skip
            return
    missing_views = (
        saved.grad_views and ddp.gradient_as_bucket_view and any(p.grad is None for p in params)
    )
    if not missing_views and live == ("rebuilt" if wanted else "initial") and live_layout == wanted:
        return
    why = _unsupported(ddp)
    if why is not None:
        _warn_inexact(ddp, where, label, why)
        return
    if missing_views:
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # the new reducer makes it a view
    if not _install(ddp, wanted):
        _warn_inexact(ddp, where, label, f"this version of torch ({torch.__version__}) builds "
                      "DDP's reducer differently")  # fmt: skip
        return
    _log.debug("%s: DDP's gradient buckets of %s restored as saved", where, label)
