"""What a divergence means: the likely cause and the fix, in plain words, per component."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

NONDETERMINISM = (
    "the computation itself is not repeatable: nondeterministic GPU kernels (atomics in "
    "index_add_, scatter_add_, some cuDNN and cuBLAS algorithms), code that reads the wall "
    "clock, generators seeded from the time or the pid, or files and services that change "
    "between runs"
)
_DETERMINISM_FIX = (
    "make two uninterrupted runs identical first: seed every generator before resume(), "
    "set torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8) on "
    "GPUs, and keep wall-clock time out of the computation"
)
_GENERATORS = {
    "rng.python": ("Python's random module", "random.seed(...)"),
    "rng.numpy": ("numpy's global generator (np.random)", "np.random.seed(...)"),
    "rng.torch": ("torch's CPU generator", "torch.manual_seed(...)"),
    "rng.cuda": ("the CUDA generators", "torch.cuda.manual_seed(...)"),
}
_BN = ("running_mean", "running_var", "num_batches_tracked")


def _ranks(differences: Sequence[Any], component: str) -> list[int]:
    return sorted({d.rank for d in differences if d.component == component})


def _first(differences: Sequence[Any], component: str) -> Any:
    return next(d for d in differences if d.component == component)


def _changed(expected: Any, got: Any) -> list[str]:
    """The entries of two name -> digest maps that differ."""
    if not isinstance(expected, dict) or not isinstance(got, dict):
        return []
    return [k for k in {**expected, **got} if expected.get(k) != got.get(k)]


def _samples(batches: Any) -> str:
    if not isinstance(batches, list):
        return "(too many to list)"
    flat = [i for batch in batches for i in batch]
    shown = ", ".join(str(i) for i in flat[:8])
    return f"[{shown}{', ...' if len(flat) > 8 else ''}]"


def _on(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "on every rank"
    return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def explain(
    *,
    phase: str,
    component: str,
    step: int | None,
    resumed_from: int | None,
    differences: Sequence[Any],
    world: int,
    first_step_after_resume: bool,
    samples_matched: bool = False,
    loader_saved: bool = True,
) -> tuple[str, str, str]:
    """``(what differs, likely cause, fix)`` for the first divergence.

    ``samples_matched``: a tracked DataLoader recorded the step's sample indices, and they
    were the same in both runs. ``loader_saved``: the Checkpointer holds a DataLoader.
    """
    diff = _first(differences, component)
    on = _on(_ranks(differences, component), world)
    e, g = diff.expected, diff.got

    if phase == "before-kill":
        return (
            f"{component} differs at step {step} {on} before any rank was killed: two runs "
            "of the script without any interruption already differ",
            NONDETERMINISM,
            _DETERMINISM_FIX,
        )
    if component == "checkpoint":
        if g is None:
            return (
                "the restarted script did not resume: resume() found no checkpoint, or it "
                "trained without calling resume()",
                "no checkpoint was committed before the kill, the script's checkpoint directory "
                "changes between runs (a timestamp in its name), or resume() is not called "
                "(or only behind a flag: pass it with --resume-args)",
                "call ckpt.resume() on every start before training, keep the directory fixed, "
                "and kill after a save (--kill-at)",
            )
        return (
            f"the restarted script resumed from step {g}, which the uninterrupted run never "
            f"saved (it saved {e})",
            "the step numbers given to save() differ between the runs",
            "number steps the same way in every run (from info.step after resume())",
        )
    if phase == "steps":
        if g is None:
            what = f"the resumed run stopped before step {e}; the uninterrupted run went on"
        elif e is None:
            what = f"the resumed run took a step {g} that the uninterrupted run never took"
        else:
            what = (
                f"after resuming from step {resumed_from} the run's next step was {g}, expected {e}"
            )
        return (
            what,
            "the loop does not restart where the checkpoint left off: it counts steps or "
            "epochs from another place than the saved step and epoch",
            "start the step counter at info.step (the step saved) and the epoch loop at "
            "info.epoch, with the epoch convention you save with (epoch=epoch + 1 after the "
            "loop, or epoch=epoch and restart at info.epoch + 1)",
        )
    if phase == "resume":
        if component.startswith("rng."):
            return (
                f"{_GENERATORS.get(component, (component,))[0]} differs right after resume() "
                f"from what step {resumed_from} saved {on}",
                "the Checkpointer does not save the random generators (rng=False)",
                "drop rng=False: resume() then restores every generator on every rank",
            )
        return (
            f"{component} right after resume() differs {on} from what the uninterrupted run "
            f"saved at step {resumed_from}",
            "the restarted script builds this object differently before resume() (another "
            "shape, setting or order), so the checkpoint is loaded into something else; if "
            "it is built the same way, this is a ddpckpt bug",
            "build every object exactly as in the first run before resume(); if it already "
            "is, report it with report.json",
        )

    after = (
        f"at the start of step {step}, the first step after the resume from step {resumed_from}"
        if first_step_after_resume
        else f"at the start of step {step}"
    )
    if phase == "start" and component in _GENERATORS:
        name, seed = _GENERATORS[component]
        if first_step_after_resume and component == "rng.torch" and not loader_saved:
            return (
                f"{name} differs {after}, {on}",
                "no DataLoader is saved with the checkpoint (none is in the Checkpointer's "
                "extra), so after the restart the loop starts a new pass over it: its iter() "
                "draws a seed from torch's generator and its epoch starts over from the first "
                f"batch. Or the script seeds torch after resume() ({seed})",
                "pass the DataLoader to the Checkpointer: extra={'loader': loader} (created "
                "before resume(); any torch DataLoader), and seed only before resume()",
            )
        if first_step_after_resume and component == "rng.torch":
            return (
                f"{name} differs {after}, {on}",
                f"the script seeds it after resume() ({seed} after ckpt.resume()), which "
                "overwrites the state resume() restored; or the loop restarted at another "
                "epoch than the one the checkpoint was saved in, so the DataLoader began a new "
                "pass (its iter() draws a seed from torch's generator) and skipped or repeated "
                "data: the restarted run's log then has a DataLoader WARNING naming the epochs",
                f"seed before resume() (or only on a fresh start: if info is None: {seed}); "
                "restart the epoch loop at the epoch the checkpoint was saved in (a save inside "
                "an epoch records that epoch: epoch=epoch inside the loop, epoch=epoch + 1 "
                "after it, restart at info.epoch)",
            )
        if first_step_after_resume:
            return (
                f"{name} differs {after}, {on}",
                f"the script seeds it after resume() ({seed} after ckpt.resume()), which "
                "overwrites the state resume() restored",
                f"seed before resume() (or only on a fresh start: if info is None: {seed}); "
                "resume() restores the generator on every rank",
            )
        return (
            f"{name} differs {after} {on}, although it matched after the previous step",
            "something between two steps reseeds it or draws from it differently after a "
            "resume (seeding at each epoch start, or a DataLoader the checkpoint does not "
            "hold drawing its shuffle order)",
            "seed only once, before resume(); pass every DataLoader in extra={'loader': loader}",
        )
    if phase == "start" and component in ("scheduler", "lr"):
        scheduler = _first(differences, "scheduler") if component == "scheduler" else None
        lr_diff = next((d for d in differences if d.component == "lr"), None)
        lrs = f" (learning rate {lr_diff.got}, expected {lr_diff.expected})" if lr_diff else ""
        counts = [getattr(scheduler, side, None) for side in ("got", "expected")]
        if all(isinstance(c, dict) and isinstance(c.get("last_epoch"), int) for c in counts):
            extra = scheduler.got["last_epoch"] - scheduler.expected["last_epoch"]
            what = (
                f"the scheduler has stepped {scheduler.got['last_epoch']} times {after}, the "
                f"uninterrupted run {scheduler.expected['last_epoch']} times{lrs} {on}"
            )
            if extra > 0:
                return (
                    what,
                    f"the script steps the scheduler {extra} more time{'s' if extra > 1 else ''} "
                    "after resume() (a scheduler.step() at start-up, or fast-forwarding it to "
                    "the resumed step) on top of the position resume() restored",
                    "remove those calls: resume() restores the scheduler's position",
                )
            return (
                what,
                "the scheduler's position is not restored (it is not passed as scheduler=, or "
                "is re-created after resume())",
                "create the scheduler before resume() and pass it: Checkpointer(..., scheduler=scheduler)",
            )
        return (
            f"the learning rate differs {after}{lrs} {on}",
            "something after resume() sets the learning rate: a scheduler the Checkpointer does "
            "not hold (not passed as scheduler=, or created after resume()), or lr set by hand",
            "create the scheduler before resume() and pass it as scheduler= (a second one in extra)",
        )
    if phase == "start" and (component == "model.parameters" or component.startswith("optimizer")):
        return _changed_before_step(component, e, g, after, on, first_step_after_resume)
    if component == "model.buffers":
        names = _changed(e, g)
        ranks = _ranks(differences, component)
        batchnorm = names and all(n.endswith(_BN) for n in names)
        if batchnorm and 0 not in ranks:
            return (
                f"BatchNorm statistics ({', '.join(names[:4])}) differ {after} {on}; rank 0's match",
                "with DDP(broadcast_buffers=False) every rank keeps its own BatchNorm "
                "statistics; resume() restored each rank's own, and something after it replaced "
                "them with rank 0's (a broadcast of the model's state, or loading one rank's "
                "state into every rank)",
                "do not broadcast or copy the model's state after resume(): it already holds "
                "each rank's own buffers",
            )
        where = after if phase == "start" else f"after step {step}"
        return (
            f"the model's buffers ({', '.join(names[:4])}) differ {where} {on}",
            "something changes the buffers between resume() and the training step, or "
            "computes them from different inputs",
            "leave the model's state alone after resume()",
        )
    if component.startswith("loader.") and component.endswith(".samples"):
        return (
            f"step {step} consumed samples {_samples(g)}, expected {_samples(e)} {on}",
            "the restarted loop iterates the DataLoader from another place: the epoch loop "
            "restarts at another epoch than the one saved, or set_epoch is not called with it",
            "restart the epoch loop at info.epoch and call sampler.set_epoch(epoch) before "
            "iterating; resume() restores the position inside the epoch",
        )
    if component.startswith("loader."):
        return (
            f"the DataLoader {component[7:]!r} is at {g}, expected {e}, after step {step} {on}",
            "the restarted loop iterates the DataLoader from another place (another epoch)",
            "restart the epoch loop at info.epoch and call sampler.set_epoch(epoch) first",
        )
    if component == "inputs":
        if samples_matched:
            return (
                f"the model received different input tensors in step {step} {on}, from the "
                "same samples (their indices match)",
                "random augmentation runs in DataLoader workers and draws from each worker's "
                "own global generator, whose position depends on how many samples that worker "
                "had produced before, which a resume changes",
                "wrap the dataset in ddpckpt.SeededDataset(dataset, seed) (or use "
                "ddpckpt.resumable_loader): each sample's randomness then depends only on "
                "(seed, epoch, index)",
            )
        return (
            f"the model received different inputs in step {step} {on}",
            "no DataLoader is saved with the checkpoint, so after resume() the epoch starts "
            "over from its first batch (a plain DistributedSampler keeps no position)",
            "pass the DataLoader to the Checkpointer: extra={'loader': loader} (created "
            "before resume(); any torch DataLoader)",
        )
    if component == "loss":
        return (
            f"the loss of step {step} differs ({g} vs {e}) {on} although its inputs and the "
            "state it started from match",
            NONDETERMINISM + ", or the forward pass reads state the checkpoint does not hold "
            "(a module or torch.Generator outside the model and extra)",
            "pass such state in extra; " + _DETERMINISM_FIX,
        )
    if phase == "end" and _summed_differently(component, differences, world):
        return _gradient_order(component, step, resumed_from, first_step_after_resume)
    if component.startswith("optimizer:unsaved"):
        return (
            f"the optimizer that steps the model ({g.get('type') if isinstance(g, dict) else g}) "
            f"holds other state after step {step} {on} ({_entries(g)} vs {_entries(e)} entries)",
            "this optimizer is not the one the Checkpointer saves: it was created after "
            "resume() (or never passed), so after a restart it starts with empty state "
            "(no momentum, no Adam moments, step count 0)",
            "create the optimizer before resume() and pass it: Checkpointer(..., "
            "optimizer=optimizer); a second one goes in extra={'optimizer2': opt2}",
        )
    if component.startswith("optimizer"):
        return (
            f"{component}'s state differs after step {step} {on} "
            f"({_entries(g)} vs {_entries(e)} entries)",
            "the optimizer that steps is not the one resume() restored, or its state is "
            "reset or replaced after resume()",
            "create the optimizer once, before resume(), and pass that object",
        )
    if component == "scaler":
        return (
            f"the GradScaler differs after step {step}: {g}, expected {e} {on}",
            "the GradScaler is not the one the Checkpointer saves (not passed as scaler=, or "
            "re-created after resume()), so its scale starts over",
            "create the GradScaler before resume() and pass it: Checkpointer(..., scaler=scaler)",
        )
    if component == "model.parameters":
        names = _changed(e, g)
        return (
            f"parameters ({', '.join(names[:4])}) differ after step {step} {on} while the "
            "data, learning rate and random state of the step matched",
            "an optimizer the Checkpointer does not see updates them, something rewrites "
            "them after resume(), or " + NONDETERMINISM,
            "pass every optimizer (optimizer= or extra); " + _DETERMINISM_FIX,
        )
    if component.startswith("extra."):
        return (
            f"extra[{component[6:]!r}] differs after step {step} {on}",
            "its state_dict() does not hold everything its updates depend on, or it is "
            "replaced or changed after resume()",
            "make its state_dict()/load_state_dict() complete, and create it before resume()",
        )
    return (
        f"{component} differs after step {step} {on}",
        "state that the checkpoint does not restore, or " + NONDETERMINISM,
        "pass that state to the Checkpointer (extra=); " + _DETERMINISM_FIX,
    )


def _entries(state: Any) -> Any:
    return state.get("entries") if isinstance(state, dict) else state


def _changed_before_step(
    component: str, expected: Any, got: Any, after: str, on: str, first_after_resume: bool
) -> tuple[str, str, str]:
    """Parameters or optimizer state that differ before the step ran: the script changed them."""
    if component == "model.parameters":
        names = ", ".join(_changed(expected, got)[:4])
        what = f"the model's parameters ({names}) differ {after} {on}"
        kind = "the model (re-initialising, rescaling or loading weights)"
    else:
        what = f"{component}'s state differs {after} {on}"
        kind = "the optimizer (resetting its state, changing its groups or hyper-parameters)"
    if first_after_resume:
        return (
            what + "; right after resume() it matched",
            f"state changed between resume() and the first step: something in your script "
            f"changes {kind} after resume()",
            "move it before resume(), or guard it with `if info is None:` so that it runs only "
            "on a fresh start; resume() already restores this state",
        )
    return (
        what + ", although the previous step ended the same in both runs",
        f"something between two steps changes {kind} differently after a resume (code that "
        "runs at an epoch start or on a step count kept outside the checkpoint)",
        "drive such changes from the saved step and epoch (info.step, info.epoch), or pass "
        "the state they depend on in extra",
    )


def _summed_differently(component: str, differences: Sequence[Any], world: int) -> bool:
    """The signature of gradients all-reduced in another order: from 3 ranks on, the step
    began from the same state and inputs (else a component read earlier would be named) and
    ended with other parameters or optimizer state on every rank alike."""
    updated = component == "model.parameters" or (
        component.startswith("optimizer") and not component.startswith("optimizer:unsaved")
    )
    return updated and world >= 3 and len(_ranks(differences, component)) == world


def _gradient_order(
    component: str, step: int | None, resumed_from: int | None, first_after_resume: bool
) -> tuple[str, str, str]:
    when = (
        f"step {step}, the first step after the resume from step {resumed_from}"
        if first_after_resume
        else f"step {step}"
    )
    return (
        f"{component} differs on every rank after {when}, although the step began from the "
        "same state (parameters, optimizer, learning rate, random generators) and read the "
        "same inputs",
        "the gradients were all-reduced in another order than in the uninterrupted run: DDP "
        "groups them into buckets, which it lays out anew after its first step, and from 3 "
        "ranks on where a gradient sits in its bucket changes the rounding of its sum. "
        "ddpckpt restores the layout the checkpoint recorded; the restarted run's log says "
        "with a ddpckpt WARNING when it could not (a checkpoint saved in DDP's first steps or "
        "by an older ddpckpt, a built-in communication hook, mixed_precision). Without such a "
        "warning: " + NONDETERMINISM,
        "resume from a checkpoint this version of ddpckpt saved after DDP's first steps (or "
        "do what the warning says); if there was no warning, " + _DETERMINISM_FIX,
    )
