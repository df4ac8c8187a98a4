"""The fast tier of a :class:`~ddpckpt.Checkpointer`: a checkpoint in every node's host
memory, as often as every step, that a restarted job resumes from.

With ``Checkpointer(..., fast_tier="/dev/shm/<job>")`` (or a
:class:`~ddpckpt._run.options.FastTier`) a Checkpointer keeps two tiers:

* the **fast tier** (:class:`FastSaves`): a run directory of its own on every node, in
  memory that outlives the worker processes (a tmpfs), written by every ``save()``.
  ``should_save(step)`` says True at every ``FastTier.every_steps``-th step, for the fast
  tier alone unless the durable schedule is due too. Each node keeps a complete copy,
  written as on node-local storage (:mod:`ddpckpt._io.writing`): the replicated state
  (model, optimizer) is split among the node's ranks and written from their own memory,
  never sent between nodes; each rank's own file (RNG streams, data position, state that
  is not replicated) and rank 0's buffers and shared state go to the other nodes point to
  point (:mod:`ddpckpt._io.settling`), so any one node can restore every rank. Saves are
  always asynchronous (``"overlap"`` when an optimizer is saved): the training thread only
  copies its share, and the next fast save waits for the one in flight. The tier keeps
  ``FastTier.keep`` steps. A fast save that fails (a full tmpfs) is an ERROR on stderr
  and training goes on, whatever ``on_error`` says.
* the **durable tier**, the run directory, as without a fast tier: written when its own
  schedule (``every_steps``, ``every_seconds``, preemption) is due, or when ``save()`` is
  called without ``should_save`` having asked for the fast tier alone. Retention,
  ``latest``, the queries and ``export`` only ever see the durable tier.

``Checkpointer.resume()`` (collective) lists both tiers on every rank and tries the steps
newest first, the durable tier first on a tie (:meth:`FastSaves.resume`). A fast-tier step
is taken from the copy most ranks hold; nodes that lack it (a replaced node, a wiped
tmpfs) first receive it from a node that has it, verified against its checksums
(:func:`~ddpckpt._coord.replicate.repair_copies`). A step that cannot be restored on every
rank is reported and the next is tried; a WARNING says when the durable tier serves in
place of a newer fast-tier step, or because no node holds one. Whichever tier served, the
fast tier then keeps nothing newer than the step resumed from (:meth:`FastSaves.keep_up_to`).

Collective methods are called by the Checkpointer on every rank at the same points.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from ddpckpt._coord.comm import Comm
from ddpckpt._coord.replicate import repair_copies
from ddpckpt._format.runfiles import FAST_TIER_OWNER, RUN_IDENTITY
from ddpckpt._io.async_saver import AsyncSaver
from ddpckpt._io.reader import CheckpointInfo
from ddpckpt._log import get_logger, same_on_every_rank
from ddpckpt._run.options import (
    Asynchronous,
    CheckpointerOptions,
    FailureHandling,
    FastTier,
    Keeping,
    Schedule,
    Storage,
)
from ddpckpt._run.rundir import remove_checkpoint, scan
from ddpckpt._run.saving import RunSaves, run_storage_errors
from ddpckpt._state.capture import Snapshot
from ddpckpt.errors import CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from ddpckpt.policies import EverySteps, KeepLast
from ddpckpt.storage import storage_for

_log = get_logger(__name__)
_SHARING = "auto"  # each node's memory is its own: probed, whatever $DDPCKPT_STORAGE says
# A fast-tier step failing so is reported, and the next step (or the durable tier) serves.
_CANNOT_SERVE = (CorruptCheckpointError, CheckpointNotFoundError, CheckpointWriteError)
_Held = dict[str, dict[str, list[int]]]  # step: checkpoint id: the ranks whose node holds it
Loaded = tuple[int, CheckpointInfo]


def fast_options(
    config: FastTier, durable: CheckpointerOptions, overlap: bool
) -> CheckpointerOptions:
    """The options of the fast tier's saves: every ``config.every_steps`` steps, the
    ``config.keep`` newest, asynchronous, never raising a storage failure, probed storage."""
    storage = durable.storage
    return CheckpointerOptions(
        schedule=Schedule(EverySteps(config.every_steps), None),
        keeping=Keeping(KeepLast(config.keep), durable.keeping.mode),
        failures=FailureHandling("warn", 0, 0.0),  # a full tmpfs is not transient
        asynchronous=Asynchronous(True, overlap),
        storage=Storage(_SHARING, storage.timeout, storage.lock_stale_after, False),
    )


class FastSaves:
    """The fast tier of one Checkpointer on this rank (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        config: FastTier,
        durable: CheckpointerOptions,
        overlap: bool,
        run: str,
    ) -> None:
        self.directory = directory
        self.run = run  # the durable run directory whose steps this tier holds
        self.every = config.every_steps
        self.saver = AsyncSaver()  # its own host buffer and background writer
        options = fast_options(config, durable, overlap)
        self.saves = RunSaves(directory, options, self.saver, tier=f"fast tier {directory}")
        self._held: _Held = {}  # known once listed, with this job's number of ranks
        self._world = 1
        self._owner = ""  # the durable run's identity, known once listed

    @property
    def latest(self) -> int | None:
        """The newest step saved to the fast tier (maybe still in flight)."""
        return self.saves.latest

    def due(self, step: int) -> bool:
        """Local: whether the fast tier's schedule asks for ``step``."""
        latest = self.saves.latest
        return step % self.every == 0 and (latest is None or step > latest)

    def save(
        self,
        step: int,
        header: dict[str, Any],
        capture: Callable[[], Snapshot],
        borrow: AsyncSaver | None = None,
    ) -> str | None:
        """Collective: start saving ``step`` to the fast tier; its path, or ``None`` when the
        save failed (logged; training goes on). ``borrow``: the durable tier's saver, when
        it has just staged the same snapshot (copied once for both tiers). The first save of
        a job that did not resume marks the tier as this run's first (:meth:`_claim`)."""
        if not self._owner and not self._claim(step):
            return None
        return self.saves.save(step, header, capture, synchronous=False, borrow=borrow)

    def _claim(self, step: int) -> bool:
        """Collective, at the first fast save of a job that did not call ``resume()``: set
        the tier up and mark it as this run's, as a resume does, so that a restarted job
        resumes from it; its steps of another run, and this run's steps newer than
        ``step``, are deleted with a WARNING. False (the save's failure reported) if that
        failed; the next save tries again."""
        try:
            with self.saves.comm("Checkpointer.save (fast tier set-up)") as comm:
                self.saves.prepare(comm)
                self._owner = self._agree_owner(comm)
            self.keep_up_to(step, resumed=False)
        except CheckpointWriteError as exc:
            self._owner = ""
            self.saves.failed(step, exc)
            return False
        return True

    def _agree_owner(self, comm: Comm) -> str:
        """Collective: the durable run's identity (:func:`_owner`), read or made by rank 0."""

        def leader() -> str | None:
            if comm.rank != 0:
                return None
            with run_storage_errors(self.run, "reading the run's identity for the fast tier"):
                return _owner(self.run)

        return str(comm.run_reduce("owner", leader, lambda found: found[0]))

    def settle(self) -> None:
        """Collective: wait for the fast save in flight; log its failure on every rank."""
        self.saves.settle()

    def report_locally(self) -> None:
        """Local: wait for the fast save in flight; log its failure here."""
        self.saves.report_locally()

    def close(self) -> None:
        """Local: wait for the save in flight, free the host buffer, release the node's lock.
        The steps stay in host memory for the next start of the job."""
        self.saves.close()

    # ------------------------------------------------------------------ resume

    def list(self) -> list[int]:
        """Collective: set the tier up (each node's lock, leftovers) and learn which node
        holds which step; the steps held anywhere, newest first."""
        with self.saves.comm("Checkpointer.resume (fast tier)") as comm:
            self.saves.prepare(comm)
            owner = self._owner = self._agree_owner(comm)
            self._held = comm.run_reduce(
                "held", lambda: _held_here(self.directory, owner), _by_step
            )
            self._world = comm.world_size
        return sorted((int(s) for s in self._held), reverse=True)

    def resume(
        self,
        fast: list[int],
        durable: list[int],
        load: Callable[[str], CheckpointInfo],
        load_durable: Callable[[list[int]], Loaded | None],
        failures: list[str],
    ) -> Loaded | None:
        """Collective: restore the newest step of either tier that every rank can restore.

        ``fast`` and ``durable``: the steps each tier may serve, newest first (from
        :meth:`list` and the run directory); ``load`` restores a fast-tier checkpoint by
        path, ``load_durable`` the first of some durable steps that loads. A fast-tier step
        that cannot be restored is reported and added to ``failures``. Returns the step
        and its info, or ``None`` when nothing loads.
        """
        fast, tried = list(fast), []
        loaded: Loaded | None = None
        while loaded is None and (fast or durable):
            if fast and (not durable or fast[0] > durable[0]):
                step = fast.pop(0)
                tried.append(step)
                loaded = self._try(step, load, failures, more=bool(fast or durable))
                if loaded is not None:
                    _log.info(
                        "resumed from the fast tier: %s (step %d; the durable tier's newest is %s)",
                        loaded[1].path,
                        step,
                        f"step {max(durable)}" if durable else "none",
                    )
                    self._say_world_changed(loaded[1])
                    return loaded
            else:
                upto = [s for s in durable if not fast or s >= fast[0]]
                durable = durable[len(upto) :]
                loaded = load_durable(upto)
        if loaded is not None:
            self._say_durable_served(loaded[0], tried)
        return loaded

    def _try(
        self, step: int, load: Callable[[str], CheckpointInfo], failures: list[str], more: bool
    ) -> Loaded | None:
        """Restore fast-tier ``step``, first copying it to the nodes that lack it; ``None``
        (reported) if that fails."""
        path = self.saves.path(step)
        copies = self._held[str(step)]
        ranks = max(copies.values(), key=len)  # the copy most nodes hold
        try:
            with self.saves.comm("Checkpointer.resume (fast tier copies)", path) as comm:
                if len(ranks) < comm.world_size:
                    have = [rank in ranks for rank in range(comm.world_size)]
                    repair_copies(comm, path, have, _SHARING)
            return step, load(path)
        except _CANNOT_SERVE as exc:
            _log.warning(
                "the fast tier cannot restore step %d on every rank: %s; trying %s",
                step,
                exc,
                "an older step" if more else "nothing else: no older checkpoint is left",
                extra=same_on_every_rank(exc),
            )
            failures.append(f"{path}: {exc}")
            return None

    def _say_durable_served(self, step: int, tried: list[int]) -> None:
        """Say why the durable tier served step ``step``, where the fast tier might have."""
        held = sorted((int(s) for s in self._held), reverse=True)
        if tried:
            _log.warning(
                "the fast tier %s could not serve every rank (see above); resumed from the "
                "durable tier at step %d: the %d step(s) after it that the fast tier held "
                "are lost",
                self.directory,
                step,
                max(tried) - step,
            )
        elif not held:
            _log.warning(
                "the fast tier %s holds no checkpoint on any node (lost with the nodes' "
                "memory, or never written); resumed from the durable tier at step %d",
                self.directory,
                step,
            )
        elif held[0] < step:
            _log.warning(
                "the fast tier %s holds step %d at newest, older than the durable tier's step "
                "%d (its save of a later step had not committed when the job stopped, its "
                "saves failed, or it was left by an earlier run): resumed from the durable "
                "tier at step %d, so no step is lost",
                self.directory,
                held[0],
                step,
                step,
            )
        else:
            _log.info(
                "resumed from the durable tier at step %d: the fast tier holds the same step",
                step,
            )

    def _say_world_changed(self, info: CheckpointInfo) -> None:
        """Warn when the fast-tier checkpoint restored was saved by another number of ranks."""
        world = self._world
        if info.world_size != world:
            _log.warning(
                "%s was saved by %d ranks and this job has %d: it is restored as a durable "
                "checkpoint would be (replicated state exactly; each rank's own state as the "
                "messages above say)",
                info.path,
                info.world_size,
                world,
            )

    def keep_up_to(self, step: int | None, resumed: bool = True) -> None:
        """Collective, after a resume from ``step`` (``None``: a fresh start), or before
        the first save, of ``step``, of a job that did not resume (``resumed=False``): each
        node deletes its fast-tier steps newer than it (those of an abandoned run, or that
        failed to load; with a WARNING when not resumed), those of another run and what is
        not committed; later fast saves follow on."""
        domains = self.saves.domains or []
        with self.saves.comm("Checkpointer.resume (fast tier tidy)") as comm:
            leader = any(domain[0] == comm.rank for domain in domains)

            def tidy() -> int | None:
                if not leader:
                    return None
                with run_storage_errors(self.directory, "removing newer fast-tier steps"):
                    owner = self._owner
                    found = _read_owner(self.directory)
                    ours = found == owner
                    newest, newer = _keep_up_to(self.directory, step if ours else None)
                    if newer and not resumed:
                        _say_dropped(self.directory, newer, step, found, ours)
                    if not ours:
                        storage_for(self.directory).replace(
                            os.path.join(self.directory, FAST_TIER_OWNER), owner.encode()
                        )
                    return newest

            newest = comm.run_reduce(
                "tidy", tidy, lambda found: max((s for s in found if s is not None), default=None)
            )
        self.saves.latest = self.saves.committed = newest


def _owner(run: str) -> str:
    """On rank 0: the identity of the durable run directory ``run``, a random token kept
    in it (made by the first resume with a fast tier), so that a run directory deleted and
    made anew is another run."""
    store, path = storage_for(run), os.path.join(run, RUN_IDENTITY)
    try:
        return store.read(path).decode()
    except FileNotFoundError:
        token = f"{run}#{uuid.uuid4().hex}"
        store.make_dirs(run)  # a job that saves the fast tier before the durable one
        store.replace(path, token.encode())
        return token


def _read_owner(directory: str) -> str | None:
    try:
        return storage_for(directory).read(os.path.join(directory, FAST_TIER_OWNER)).decode()
    except FileNotFoundError:
        return None


def _held_here(directory: str, owner: str) -> dict[str, str]:
    """The committed steps this rank's node holds for the run ``owner``, with their
    checkpoint ids; none, with a WARNING, if its steps belong to another run."""
    held = {str(e.step): e.manifest.id for e in scan(directory) if e.manifest is not None}
    found = _read_owner(directory)
    if held and found != owner:
        _log.warning(
            "the fast tier %s holds steps %s of another run (%s, not %s): not resumed from, "
            "and deleted; give each job a fast-tier directory of its own",
            directory,
            ", ".join(sorted(held, key=int)),
            found or "unknown",
            owner,
        )
        return {}
    return held


def _by_step(views: list[dict[str, str]]) -> _Held:
    """On rank 0: every rank's holdings by step and checkpoint id."""
    held: _Held = {}
    for rank, view in enumerate(views):
        for step, ident in view.items():
            held.setdefault(step, {}).setdefault(ident, []).append(rank)
    return held


def _keep_up_to(directory: str, step: int | None) -> tuple[int | None, list[int]]:
    """Delete the steps of ``directory`` newer than ``step`` (all for ``None``) and those
    not committed; the newest left, and the committed steps deleted."""
    newest, newer = None, []
    for entry in scan(directory):
        if entry.status != "committed":
            why = entry.problem
        elif step is None or entry.step > step:
            why = "newer than the step resumed from" if step is not None else "not resumed from"
            newer.append(entry.step)
        else:
            newest = entry.step
            continue
        remove_checkpoint(entry.path)
        _log.info("removed %s from the fast tier (%s)", entry.path, why)
    return newest, newer


def _say_dropped(
    directory: str, steps: list[int], step: int | None, found: str | None, ours: bool
) -> None:
    """Warn that the first save of a job that did not resume deleted the fast tier's
    ``steps``: this run's steps newer than ``step``, or (not ``ours``) another run's."""
    listed = ", ".join(str(s) for s in sorted(steps))
    if ours:
        _log.warning(
            "the fast tier %s held step(s) %s of this run, newer than step %s, the first this "
            "job saves without having called resume(): deleted, so that a restart cannot "
            "resume from them",
            directory,
            listed,
            step,
        )
    else:
        _log.warning(
            "the fast tier %s held step(s) %s of another run (%s): deleted; give each job a "
            "fast-tier directory of its own",
            directory,
            listed,
            found or "unknown",
        )
