"""What a checkpoint holds, taken from live training objects and put back into them.

The entry points :mod:`ddpckpt._io` uses: :func:`capture` takes a
:class:`~ddpckpt._state.training_state.TrainingState`. Capture is local to a process;
:mod:`ddpckpt._io.writing` decides which rank writes what, :mod:`ddpckpt._io.load` restores
each part through the restore functions of the modules below.

Each object is stored in the layout :mod:`ddpckpt._format.statelayout` describes (one model,
or several by name).

* **Model** (:mod:`ddpckpt._state.model`): canonical keys, tied weights, what DDP keeps
  replicated; restored through the module's own ``load_state_dict``. Its DDP's gradient
  bucket layout (:mod:`ddpckpt._state.ddp_buckets`), which an exact resume needs.
* **Optimizer** (:mod:`ddpckpt._state.optimizer`, captured by
  :mod:`ddpckpt._state.optimizer_capture`): state and param groups keyed by
  *parameter name*, with shapes.
* **Scheduler, GradScaler, extras** (:mod:`ddpckpt._state.objects`): their
  ``state_dict()``, encoded without pickle.
* **Per rank**: RNG states (see :mod:`ddpckpt._state.rng`).
* **Sharded state**: DTensors (FSDP2, HSDP, ``replicate()``; :mod:`ddpckpt._state.dtensor`)
  and ZeRO-1's optimizer state (:mod:`ddpckpt._state.zero`), each shard written once.
"""

from __future__ import annotations

from ddpckpt._format.codec import encode
from ddpckpt._format.sections import StateSections
from ddpckpt._format.statelayout import NAMED, SINGLE, Layout
from ddpckpt._state.ddp_buckets import record_buckets
from ddpckpt._state.dtensor import split_sharded
from ddpckpt._state.inplace import record_forward_writers
from ddpckpt._state.model import Replication, capture_model
from ddpckpt._state.objects import capture_extra, capture_stateful
from ddpckpt._state.optimizer import param_names
from ddpckpt._state.optimizer_capture import capture_optimizer, record_steppers
from ddpckpt._state.partial import refuse_marked
from ddpckpt._state.rng import capture_rng
from ddpckpt._state.snapshot import Snapshot
from ddpckpt._state.training_state import TrainingState


def layout_for(state: TrainingState) -> Layout:
    """The layout ``state`` is written in: the single-model one when it fits."""
    return SINGLE if state.single_model_layout else NAMED


def capture(state: TrainingState) -> Snapshot:
    """Capture the training state of this process (no I/O, no communication).

    Tensors in the snapshot are the live tensors themselves (detached), not copies.
    Raises :class:`~ddpckpt.errors.PartiallyRestoredError` first if a failed load left an
    object of ``state`` partly restored (:mod:`ddpckpt._state.partial`).
    """
    refuse_marked(state)
    layout = layout_for(state)
    snapshot = Snapshot()
    sections = StateSections(layout)
    replication = Replication()
    for name, model in state.models.items():
        captured = capture_model(model, snapshot, name, layout)
        captured.section.ddp_buckets = record_buckets(model)
        sections.models[name] = captured.section
        replication.synced |= captured.replication.synced
        replication.ignored |= captured.replication.ignored
        if captured.rank_buffers is not None:
            if layout.named:
                buffers = snapshot.rank_state.setdefault(layout.buffers_key, {})
                buffers[name] = captured.rank_buffers
            else:
                snapshot.rank_state[layout.buffers_key] = captured.rank_buffers
    names = param_names(state.models, layout)
    for name, optimizer in state.optimizers.items():
        prefix = layout.prefix("optimizers", name)
        label = f"optimizer {name!r}" if layout.named else None
        section = capture_optimizer(optimizer, names, replication, snapshot, prefix, label)
        sections.optimizers[name] = section
    for role in ("schedulers", "scalers"):
        for name, obj in getattr(state, role).items():
            stateful = capture_stateful(layout.prefix(role, name), obj, snapshot)
            sections.place(role, name, stateful)
    if state.extra:
        sections.extra = capture_extra(state.extra, snapshot)
    if state.rng:
        snapshot.rank_state["rng"] = encode(capture_rng(), "rng", snapshot.rank_tensors)
    split_sharded(snapshot)
    record_steppers(state.all_optimizers(), snapshot)
    record_forward_writers(list(state.models.values()), snapshot)
    snapshot.state = sections.to_json()
    return snapshot
