"""What a divergence means: the likely cause and the fix, in plain words.

A divergence is described by a :class:`Situation` (where the runs first differ, in which
component, and the :class:`~ddpckpt._resumecheck.evidence.Evidence` of what the runs did and
said). Each rule is a function ``rule(situation) -> Explanation | None``; :data:`RULES` lists
them from the most specific to the most general and :func:`explain` returns the first answer.
To add a rule: write the function next to the rules it refines (here: rules about how the
runs started, resumed and stepped; in :mod:`.explain_state`: rules about one component of the
state) and put it in :data:`RULES` before them. A rule puts first the cause the evidence
shows (a seeding call after the resume, a warning the run logged), and quotes the run's own
words in ``quoted``.
"""

from __future__ import annotations

from ddpckpt._resumecheck.evidence import seed_call, where
from ddpckpt._resumecheck.explain_state import (
    anything_else,
    buffers,
    changed_before_step,
    extra,
    gradients_summed_differently,
    inputs,
    loader_position,
    loss,
    optimizer_state,
    parameters_after_step,
    samples,
    scaler,
    scheduler_position,
    unsaved_optimizer,
)
from ddpckpt._resumecheck.situation import (
    DETERMINISM_FIX,
    EPOCH_FIX,
    GENERATORS,
    NONDETERMINISM,
    Explanation,
    Rule,
    Situation,
    quote,
    seeds_of,
)


def uninterrupted_runs_differ(s: Situation) -> Explanation | None:
    """Two runs never interrupted differ: say why they do, from how they were seeded."""
    if s.phase != "before-kill":
        return None
    what = (
        f"{s.component} differs at step {s.step} {s.on} between two runs that were never "
        "interrupted (the uninterrupted run, and the killed run before its kill), so the "
        "uninterrupted run does not show what a resumed run should do"
    )
    if s.component not in GENERATORS or not s.initial:
        if s.initial:
            cause = (
                "the two runs start from different states: something built before the first "
                "step is not seeded or reads the wall clock, the pid or files"
            )
            return Explanation(what, cause, DETERMINISM_FIX)
        return Explanation(what, NONDETERMINISM, DETERMINISM_FIX)
    name, call = GENERATORS[s.component]
    ours = seeds_of(s.evidence.seeds_reference, s.component)
    theirs = seeds_of(s.evidence.seeds_killed, s.component)
    fix = f"seed it with a constant ({call}) before any ddpckpt call that resumes"
    if not ours and not theirs and s.component in s.evidence.initial_differs:
        cause = (
            f"{name} is never seeded ({call} is called in neither run), so every process "
            "starts it from a different state and draws other numbers (initial weights, "
            "dropout, shuffling)"
        )
    elif [x["value"] for x in ours] != [x["value"] for x in theirs]:
        cause = (
            f"{name} is seeded from a value that changes between runs (the wall clock, the "
            f"process id): the uninterrupted run called {seed_call(ours[0]) if ours else 'none'}, "
            f"the killed run {seed_call(theirs[0]) if theirs else 'none'}"
        )
        fix = f"seed it with a constant ({call}), not the time or the pid"
    else:
        seeded = f" ({seed_call(ours[0])})" if ours else " (before ddpckpt was imported)"
        cause = (
            f"{name} is seeded the same way in both runs{seeded}, yet differs at the first "
            "step: something draws from it a varying number of times before training (a "
            "loop on the wall clock, a thread, a file listing in another order)"
        )
        fix = "draw the same numbers in every run before the first step; " + DETERMINISM_FIX
    return Explanation(what, cause, fix)


def did_not_resume(s: Situation) -> Explanation | None:
    if s.component != "checkpoint":
        return None
    if s.got is None:
        return Explanation(
            "the restarted script did not resume: it found no checkpoint, or it trained "
            "without resuming",
            "resume() or ddpckpt.latest() found nothing: no checkpoint was committed before "
            "the kill, the checkpoint directory changes between runs (a timestamp in its "
            "name), the script finds its checkpoints itself (glob, os.listdir: during a check "
            "they are in the check's directory, which only ddpckpt's calls see), or it resumes "
            "only behind a flag (pass it with --resume-args)",
            "resume with ckpt.resume() or ddpckpt.latest(dir) + ddpckpt.load() on every start, "
            "keep the directory fixed, and kill after a save (--kill-at)",
        )
    return Explanation(
        f"the restarted script resumed from step {s.got}, which the uninterrupted run never "
        f"saved (it saved {s.expected})",
        "the step numbers given to save() differ between the runs",
        "number steps the same way in every run (from info.step after resuming)",
    )


def steps_out_of_order(s: Situation) -> Explanation | None:
    if s.phase != "steps":
        return None
    e, g = s.expected, s.got
    if g is None:
        what = f"the resumed run stopped before step {e}; the uninterrupted run went on"
    elif e is None:
        what = f"the resumed run took a step {g} that the uninterrupted run never took"
    else:
        what = (
            f"after resuming from step {s.resumed_from} the run's next step was {g}, expected {e}"
        )
    warnings = s.evidence.loader_warnings()
    return Explanation(
        what,
        "the loop does not restart where the checkpoint left off: it counts steps or epochs "
        "from another place than the saved step and epoch"
        + ("; the resumed run said so (below)" if warnings else ""),
        "start the step counter at info.step (the step saved) and the epoch loop at "
        "info.epoch, with the epoch convention you save with (epoch=epoch + 1 after the loop, "
        "or epoch=epoch and restart at info.epoch + 1)",
        [quote(w) for w in warnings],
    )


def generator_not_restored(s: Situation) -> Explanation | None:
    if s.phase != "resume" or not s.component.startswith("rng."):
        return None
    return Explanation(
        f"{GENERATORS.get(s.component, (s.component,))[0]} differs right after the resume "
        f"from what step {s.resumed_from} saved {s.on}",
        "the checkpoint does not hold the random generators (rng=False)",
        "drop rng=False: resuming then restores every generator on every rank",
    )


def loaded_into_other_objects(s: Situation) -> Explanation | None:
    if s.phase != "resume":
        return None
    return Explanation(
        f"{s.component} right after the resume differs {s.on} from what the run saved at "
        f"step {s.resumed_from}",
        "the restarted script builds this object differently before resuming (another "
        "shape, setting or order), so the checkpoint is loaded into something else; if it is "
        "built the same way, this is a ddpckpt bug",
        "build every object exactly as in the first run before resuming; if it already is, "
        "report it with report.json",
    )


def generator_after_resume(s: Situation) -> Explanation | None:
    """A generator differs at the first step after the resume: who touched it?"""
    if s.phase != "start" or s.component not in GENERATORS or not s.first_step_after_resume:
        return None
    name, seed = GENERATORS[s.component]
    what = f"{name} differs {s.after}, {s.on}"
    seeded = seeds_of(s.evidence.seeds_after_resume, s.component)
    if seeded:
        return Explanation(
            what,
            f"the script seeds it after resuming: {seed_call(seeded[0])}, "
            f"{where(seeded[0])}; that overwrites the state the resume restored",
            f"seed before resuming (or only on a fresh start: if info is None: {seed}); "
            "the resume restores the generator on every rank",
        )
    warnings = s.evidence.loader_warnings()
    if s.component == "rng.torch" and warnings:
        return Explanation(
            what,
            "the loop restarted at another epoch than the one the checkpoint was saved in, "
            "so the DataLoader began a new pass (its iter() draws a seed from torch's "
            "generator) and skipped or repeated data, as the resumed run said",
            EPOCH_FIX,
            [quote(w) for w in warnings],
        )
    if s.component == "rng.torch" and not s.loader_saved:
        return Explanation(
            what,
            "no DataLoader is saved with the checkpoint (none is in the Checkpointer's "
            "extra), so after the restart the loop starts a new pass over it: its iter() "
            "draws a seed from torch's generator and its epoch starts over from the first "
            f"batch. Or the script seeds torch after resume() ({seed})",
            "pass the DataLoader to the Checkpointer: extra={'loader': loader} (created "
            "before resume(); any torch DataLoader), and seed only before resume()",
        )
    if s.component == "rng.torch":
        return Explanation(
            what,
            "the loop restarted at another epoch than the one the checkpoint was saved in, "
            "so the DataLoader began a new pass (its iter() draws a seed from torch's "
            "generator) and skipped or repeated data: the restarted run's log then has a "
            f"DataLoader WARNING naming the epochs; or the script seeds it after resume() "
            f"({seed} after ckpt.resume()), which overwrites the state resume() restored",
            f"{EPOCH_FIX}; seed before resume() (or only on a fresh start: if info is None: "
            f"{seed}), restart at info.epoch",
        )
    return Explanation(
        what,
        f"the script seeds it after resume() ({seed} after ckpt.resume()), which overwrites "
        "the state resume() restored",
        f"seed before resume() (or only on a fresh start: if info is None: {seed}); resume() "
        "restores the generator on every rank",
    )


def generator_between_steps(s: Situation) -> Explanation | None:
    if s.phase != "start" or s.component not in GENERATORS:
        return None
    return Explanation(
        f"{GENERATORS[s.component][0]} differs {s.after} {s.on}, although it matched after "
        "the previous step",
        "something between two steps reseeds it or draws from it differently after a resume "
        "(seeding at each epoch start, or a DataLoader the checkpoint does not hold drawing "
        "its shuffle order)",
        "seed only once, before resume(); pass every DataLoader in extra={'loader': loader}",
    )


RULES: list[Rule] = [
    uninterrupted_runs_differ,
    did_not_resume,
    steps_out_of_order,
    generator_not_restored,
    loaded_into_other_objects,
    generator_after_resume,
    generator_between_steps,
    scheduler_position,
    changed_before_step,
    buffers,
    samples,
    loader_position,
    inputs,
    loss,
    gradients_summed_differently,
    unsaved_optimizer,
    optimizer_state,
    scaler,
    parameters_after_step,
    extra,
    anything_else,
]


def explain(situation: Situation) -> Explanation:
    """The first answer of :data:`RULES`."""
    for rule in RULES:
        found = rule(situation)
        if found is not None:
            return found
    return anything_else(situation)
