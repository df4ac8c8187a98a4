"""The explanation rules about one component of the training state (see :mod:`.explain`)."""

from __future__ import annotations

from typing import Any, cast

from ddpckpt._resumecheck.situation import (
    BATCHNORM,
    DETERMINISM_FIX,
    NONDETERMINISM,
    Explanation,
    Situation,
    changed,
    entries,
    listed,
    quote,
)


def scheduler_position(s: Situation) -> Explanation | None:
    if s.phase != "start" or not (s.component.startswith("scheduler") or s.component == "lr"):
        return None
    scheduler = next((d for d in s.differences if d.component.startswith("scheduler")), None)
    lr = next((d for d in s.differences if d.component == "lr"), None)
    lrs = f" (learning rate {lr.got}, expected {lr.expected})" if lr else ""
    counts = [getattr(scheduler, side, None) for side in ("got", "expected")]
    if s.component == "lr" or not all(
        isinstance(c, dict) and isinstance(c.get("last_epoch"), int) for c in counts
    ):
        return Explanation(
            f"the learning rate differs {s.after}{lrs} {s.on}",
            "something after resume() sets the learning rate: a scheduler the checkpoint does "
            "not hold (not passed as scheduler=, or created after resume()), or lr set by hand",
            "create the scheduler before resume() and pass it as scheduler= (a second one in extra)",
        )
    states = cast("list[dict[str, Any]]", counts)  # dicts: checked above (all() can't narrow)
    got, expected = states[0]["last_epoch"], states[1]["last_epoch"]
    what = (
        f"the scheduler has stepped {got} times {s.after}, the uninterrupted run {expected} "
        f"times{lrs} {s.on}"
    )
    if got > expected:
        extra = got - expected
        return Explanation(
            what,
            f"the script steps the scheduler {extra} more time{'s' if extra > 1 else ''} after "
            "resume() (a scheduler.step() at start-up, or fast-forwarding it to the resumed "
            "step) on top of the position resume() restored",
            "remove those calls: resume() restores the scheduler's position",
        )
    return Explanation(
        what,
        "the scheduler's position is not restored (it is not passed as scheduler=, or is "
        "re-created after resume())",
        "create the scheduler before resume() and pass it: Checkpointer(..., scheduler=scheduler)",
    )


def changed_before_step(s: Situation) -> Explanation | None:
    """Parameters or optimizer state that differ before the step ran: the script changed them."""
    parameters = s.component.startswith("model") and s.component.endswith(".parameters")
    if s.phase != "start" or not (parameters or s.component.startswith("optimizer")):
        return None
    if parameters:
        names = ", ".join(changed(s.expected, s.got)[:4])
        what = f"the model's parameters ({names}) differ {s.after} {s.on}"
        kind = "the model (re-initialising, rescaling or loading weights)"
    else:
        what = f"{s.component}'s state differs {s.after} {s.on}"
        kind = "the optimizer (resetting its state, changing its groups or hyper-parameters)"
    if s.first_step_after_resume:
        return Explanation(
            what + "; right after the resume it matched",
            f"state changed between resume() and the first step: something in your script "
            f"changes {kind} after resume()",
            "move it before resume(), or guard it with `if info is None:` so that it runs only "
            "on a fresh start; resume() already restores this state",
        )
    return Explanation(
        what + ", although the previous step ended the same in both runs",
        f"something between two steps changes {kind} differently after a resume (code that "
        "runs at an epoch start or on a step count kept outside the checkpoint)",
        "drive such changes from the saved step and epoch (info.step, info.epoch), or pass "
        "the state they depend on in extra",
    )


def buffers(s: Situation) -> Explanation | None:
    if not (s.component.startswith("model") and s.component.endswith(".buffers")):
        return None
    names = changed(s.expected, s.got)
    if names and all(n.endswith(BATCHNORM) for n in names) and 0 not in s.ranks():
        return Explanation(
            f"BatchNorm statistics ({', '.join(names[:4])}) differ {s.after} {s.on}; rank 0's match",
            "with DDP(broadcast_buffers=False) every rank keeps its own BatchNorm statistics; "
            "resume() restored each rank's own, and something after it replaced them with "
            "rank 0's (a broadcast of the model's state, or loading one rank's state into "
            "every rank)",
            "do not broadcast or copy the model's state after resume(): it already holds each "
            "rank's own buffers",
        )
    when = s.after if s.phase == "start" else f"after step {s.step}"
    return Explanation(
        f"the model's buffers ({', '.join(names[:4])}) differ {when} {s.on}",
        "something changes the buffers between resume() and the training step, or computes "
        "them from different inputs",
        "leave the model's state alone after resume()",
    )


def samples(s: Situation) -> Explanation | None:
    if not (s.component.startswith("loader") and s.component.endswith(".samples")):
        return None
    warnings = s.evidence.loader_warnings()
    return Explanation(
        f"step {s.step} consumed samples {listed(s.got)}, expected {listed(s.expected)} {s.on}",
        "the restarted loop iterates the DataLoader from another place: the epoch loop "
        "restarts at another epoch than the one saved, or set_epoch is not called with it"
        + (", as the resumed run said" if warnings else ""),
        "restart the epoch loop at info.epoch and call sampler.set_epoch(epoch) before "
        "iterating; the resume restores the position inside the epoch",
        [quote(w) for w in warnings],
    )


def loader_position(s: Situation) -> Explanation | None:
    if not s.component.startswith("loader"):
        return None
    name = s.component.partition(":")[2] or "loader"
    return Explanation(
        f"the DataLoader {name!r} is at {s.got}, expected {s.expected}, after step {s.step} {s.on}",
        "the restarted loop iterates the DataLoader from another place (another epoch)",
        "restart the epoch loop at info.epoch and call sampler.set_epoch(epoch) first",
        [quote(w) for w in s.evidence.loader_warnings()],
    )


def inputs(s: Situation) -> Explanation | None:
    if s.component != "inputs":
        return None
    if s.samples_matched:
        return Explanation(
            f"the model received different input tensors in step {s.step} {s.on}, from the "
            "same samples (their indices match)",
            "random augmentation runs in DataLoader workers and draws from each worker's own "
            "global generator, whose position depends on how many samples that worker had "
            "produced before, which a resume changes",
            "wrap the dataset in ddpckpt.data.SeededDataset(dataset, seed): each sample's "
            "randomness then depends only on (seed, epoch, index)",
        )
    return Explanation(
        f"the model received different inputs in step {s.step} {s.on}",
        "no DataLoader is saved with the checkpoint, so after the resume the epoch starts over "
        "from its first batch (a plain DistributedSampler keeps no position)",
        "pass the DataLoader to the Checkpointer: extra={'loader': loader} (created before "
        "resume(); any torch DataLoader)",
    )


def loss(s: Situation) -> Explanation | None:
    if s.component != "loss":
        return None
    return Explanation(
        f"the loss of step {s.step} differs ({s.got} vs {s.expected}) {s.on} although its "
        "inputs and the state it started from match",
        NONDETERMINISM + ", or the forward pass reads state the checkpoint does not hold (a "
        "module or torch.Generator outside the model and extra)",
        "pass such state in extra; " + DETERMINISM_FIX,
    )


def gradients_summed_differently(s: Situation) -> Explanation | None:
    """From 3 ranks on, a step that began from the same state and inputs (else a component
    read earlier would be named) and ended with other parameters or optimizer state on every
    rank alike: the gradients were all-reduced in another order."""
    updated = (s.component.startswith("model") and s.component.endswith(".parameters")) or (
        s.component.startswith("optimizer") and not s.component.startswith("optimizer:unsaved")
    )
    if s.phase != "end" or not updated or s.world < 3 or len(s.ranks()) != s.world:
        return None
    when = (
        f"step {s.step}, the first step after the resume from step {s.resumed_from}"
        if s.first_step_after_resume
        else f"step {s.step}"
    )
    return Explanation(
        f"{s.component} differs on every rank after {when}, although the step began from the "
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
        "do what the warning says); if there was no warning, " + DETERMINISM_FIX,
    )


def unsaved_optimizer(s: Situation) -> Explanation | None:
    if not s.component.startswith("optimizer:unsaved"):
        return None
    kind = s.got.get("type") if isinstance(s.got, dict) else s.got
    return Explanation(
        f"the optimizer that steps the model ({kind}) holds other state after step {s.step} "
        f"{s.on} ({entries(s.got)} vs {entries(s.expected)} entries)",
        "this optimizer is not the one the checkpoint saves: it was created after resume() "
        "(or never passed), so after a restart it starts with empty state (no momentum, no "
        "Adam moments, step count 0)",
        "create the optimizer before resume() and pass it: Checkpointer(..., "
        "optimizer=optimizer); a second one goes in extra={'optimizer2': opt2}",
    )


def optimizer_state(s: Situation) -> Explanation | None:
    if not s.component.startswith("optimizer"):
        return None
    return Explanation(
        f"{s.component}'s state differs after step {s.step} {s.on} "
        f"({entries(s.got)} vs {entries(s.expected)} entries)",
        "the optimizer that steps is not the one the resume restored, or its state is reset "
        "or replaced after resume()",
        "create the optimizer once, before resume(), and pass that object",
    )


def scaler(s: Situation) -> Explanation | None:
    if not s.component.startswith("scaler"):
        return None
    return Explanation(
        f"the GradScaler differs after step {s.step}: {s.got}, expected {s.expected} {s.on}",
        "the GradScaler is not the one the checkpoint saves (not passed as scaler=, or "
        "re-created after resume()), so its scale starts over",
        "create the GradScaler before resume() and pass it: Checkpointer(..., scaler=scaler)",
    )


def parameters_after_step(s: Situation) -> Explanation | None:
    if not (s.component.startswith("model") and s.component.endswith(".parameters")):
        return None
    names = changed(s.expected, s.got)
    return Explanation(
        f"parameters ({', '.join(names[:4])}) differ after step {s.step} {s.on} while the "
        "data, learning rate and random state of the step matched",
        "an optimizer the checkpoint does not hold updates them, something rewrites them "
        "after resume(), or " + NONDETERMINISM,
        "pass every optimizer (optimizer= or extra); " + DETERMINISM_FIX,
    )


def extra(s: Situation) -> Explanation | None:
    if not s.component.startswith("extra."):
        return None
    return Explanation(
        f"extra[{s.component[6:]!r}] differs after step {s.step} {s.on}",
        "its state_dict() does not hold everything its updates depend on, or it is replaced "
        "or changed after resume()",
        "make its state_dict()/load_state_dict() complete, and create it before resume()",
    )


def anything_else(s: Situation) -> Explanation:
    return Explanation(
        f"{s.component} differs after step {s.step} {s.on}",
        "state that the checkpoint does not restore, or " + NONDETERMINISM,
        "pass that state to the Checkpointer (extra=); " + DETERMINISM_FIX,
    )
