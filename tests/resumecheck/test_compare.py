"""Finding the first divergence and choosing kill points, on recorded events (no processes)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ddpckpt._resumecheck.check import default_kill_points, step_offset
from ddpckpt._resumecheck.compare import compare_point
from ddpckpt._resumecheck.runner import KillPoint, parse_kill


def _state(step: int) -> dict[str, Any]:
    return {
        "model.parameters": {"w": f"w{step}"},
        "optimizer": {"entries": 1, "state": f"o{step}"},
        "rng.torch": f"t{step}",
        "rng.python": "never-drawn",  # unseeded and unused: differs between runs harmlessly
    }


def _step(step: int) -> dict[str, Any]:
    return {
        "event": "step",
        "step": step,
        "start": {"rng.torch": f"t{step - 1}", "rng.python": "never-drawn"},
        "end": {**_state(step), "inputs": {"forwards": 1, "digest": f"i{step}"}},
    }


def _save(step: int, epoch_end: bool = False) -> dict[str, Any]:
    return {"event": "save", "step": step, "n": 1, "epoch_end": epoch_end, "state": _state(step)}


def _start() -> dict[str, Any]:
    return {"event": "start", "world": 1}


def _run(steps: int, saves: dict[int, bool]) -> list[dict[str, Any]]:
    events = [_start(), {"event": "resume", "step": None, "state": {}}]
    for step in range(1, steps + 1):
        events.append(_step(step))
        if step in saves:
            events.append(_save(step, saves[step]))
    return events


def _killed(kill: int, resumed: int, steps: int) -> list[list[dict[str, Any]]]:
    before = _run(kill, {4: False})
    after = [_start(), {"event": "resume", "step": resumed, "state": _state(resumed)}]
    after += [_step(s) for s in range(resumed + 1, steps + 1)]
    return [before, after]


def _other_python_seed(processes: list[list[dict[str, Any]]]) -> None:
    for events in processes:
        for event in events:
            for part in ("start", "end", "state"):
                if event.get(part) and "rng.python" in event[part]:
                    event[part]["rng.python"] = "another-seed"


def test_identical_runs_are_identical_and_an_unused_generator_is_not_compared() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    _other_python_seed(killed)
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.identical and result.divergence is None
    assert result.resumed_from == 4 and result.steps_compared == 4
    assert result.unused == ["rng.python"]


def test_a_computation_that_varies_between_uninterrupted_runs_cannot_be_judged() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    killed[0][3]["end"]["model.parameters"]["w"] = "other"  # step 2 of the first process
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.verdict == "cannot-judge" and not result.identical
    found = result.nondeterminism
    assert (found.step, found.phase, found.component) == (2, "before-kill", "model.parameters")
    assert "use_deterministic_algorithms" in found.fix
    assert result.not_judged == [7, 8]  # after the replayed steps 5 and 6


def test_runs_that_start_apart_are_judged_by_the_replayed_steps_alone() -> None:
    """An unseeded script: the killed run starts elsewhere than the reference, but its
    restart must repeat the steps it took after its checkpoint, bit for bit."""
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    for events in killed:
        for event in events:
            for part in ("start", "end", "state"):
                if event.get(part) and "model.parameters" in event[part]:
                    event[part]["model.parameters"] = {"w": "unseeded"}
                if event.get(part) and "rng.torch" in event[part]:
                    event[part]["rng.torch"] += "-unseeded"
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.verdict == "exact", result.divergence
    assert (result.steps_compared, result.replayed, result.not_judged) == (2, 2, [7, 8])
    assert result.nondeterminism.component == "rng.torch"
    killed[1][3]["end"]["rng.torch"] = "reseeded"  # the resumed run's step 6 ends elsewhere
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.verdict == "different"
    assert (result.divergence.step, result.divergence.component) == (6, "rng.torch")


def test_a_resumed_run_that_stops_early_differs_in_its_steps() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    killed[1] = killed[1][:-2]  # steps 7 and 8 never ran
    divergence = compare_point(reference, {0: killed}, kill="6", victim=0).divergence
    assert (divergence.step, divergence.phase, divergence.component) == (7, "steps", "steps")


def test_the_first_cause_in_step_order_is_blamed_over_its_effects() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    later = copy.deepcopy(killed)
    later[1][2]["start"]["rng.torch"] = "reseeded"  # step 5 starts from another state
    later[1][2]["end"]["model.parameters"]["w"] = "other"  # ... so it ends elsewhere too
    divergence = compare_point(reference, {0: later}, kill="6", victim=0).divergence
    assert (divergence.step, divergence.phase, divergence.component) == (5, "start", "rng.torch")
    assert "torch.manual_seed" in divergence.cause


def test_default_kill_points_inside_an_epoch_and_after_an_epoch_end_save() -> None:
    events = _run(12, {4: False, 6: True, 8: False, 12: True})
    points, notes = default_kill_points(events)
    assert points == [KillPoint(10), KillPoint(6, after_save=True, saves=1)]
    assert notes == []


def test_without_epoch_end_saves_only_a_mid_epoch_point_is_chosen_and_said() -> None:
    points, notes = default_kill_points(_run(12, {5: False, 10: False}))
    assert points == [KillPoint(11)]
    assert "only a kill inside an epoch" in notes[0]


def test_no_save_before_the_last_step_is_an_error_that_says_what_to_change() -> None:
    with pytest.raises(RuntimeError, match="save more often"):
        default_kill_points(_run(6, {6: True}))


def test_a_plain_loop_is_numbered_as_its_saves_number_their_steps() -> None:
    """The README's recipe saves step=9 after its 10th optimizer step: step 9 it is. A save
    of the initial weights (before any step) does not count; saves that disagree leave the
    optimizer steps' count."""

    def saves(*pairs: tuple[int, int]) -> list[dict[str, Any]]:
        return [{"event": "save", "step": count, "label": label} for count, label in pairs]

    assert step_offset(saves((10, 9), (20, 19))) == -1
    assert step_offset(saves((0, 0), (10, 9))) == -1
    assert step_offset(saves((10, 9), (20, 1))) == 0
    assert step_offset(saves((4, 4), (8, 8))) == 0  # a Checkpointer's own numbering


def test_kill_at_accepts_a_step_or_a_step_after_its_save() -> None:
    assert parse_kill("12") == KillPoint(12)
    assert parse_kill("12:after-save") == KillPoint(12, after_save=True)
    with pytest.raises(ValueError, match="K:after-save"):
        parse_kill("twelve")


def test_a_restarted_run_that_trains_without_resuming_is_not_called_exact() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    killed[1] = [_start(), *[_step(s) for s in range(1, 9)]]  # started over: no resume()
    divergence = compare_point(reference, {0: killed}, kill="6", victim=0).divergence
    assert (divergence.phase, divergence.component) == ("resume", "checkpoint")
    assert "did not resume" in divergence.what


def test_a_resume_from_a_step_the_reference_did_not_save_compares_with_its_end_state() -> None:
    reference = {0: [_run(8, {4: False})]}  # a clock-driven policy saved step 3 in the other run
    killed = _killed(6, 3, 8)
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.identical and result.resumed_from == 3


def _buffers_after_resume(value: str) -> tuple[dict[int, Any], list[list[dict[str, Any]]]]:
    """BatchNorm statistics in every state, the same in both runs except right after
    resume(), where the killed run holds ``value``."""
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    for events in [*reference[0], *killed]:
        for event in events:
            for part in ("start", "end", "state"):
                if event.get(part) is not None and event["event"] != "start":
                    event[part]["model.buffers"] = {"bn.running_var": "own"}
    killed[1][1]["state"]["model.buffers"] = {"bn.running_var": value}
    return reference, killed


def test_buffers_ddp_overwrites_at_the_first_forward_after_resume_are_not_a_difference() -> None:
    # DDP(broadcast_buffers=True): rank 1 ends each step with its own statistics, saves rank
    # 0's, and gets rank 0's again at every forward; right after resume() they differ.
    reference, killed = _buffers_after_resume("rank 0's")
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert result.identical and result.divergence is None


def test_buffers_wrong_after_resume_and_at_the_next_forward_are_named_at_the_resume() -> None:
    reference, killed = _buffers_after_resume("rank 0's")
    killed[1][2]["start"]["model.buffers"] = {"bn.running_var": "rank 0's"}  # step 5 reads them
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    divergence = result.divergence
    assert divergence is not None and not result.identical
    assert (divergence.phase, divergence.step, divergence.component) == (
        "resume",
        4,
        "model.buffers",
    )


def test_parameters_changed_after_resume_are_blamed_on_the_script_not_nondeterminism() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    for process in [*reference[0], *killed]:  # each step starts from the previous one's end
        for event in process:
            if event["event"] == "step":
                event["start"]["model.parameters"] = {"w": f"w{event['step'] - 1}"}
    killed[1][2]["start"]["model.parameters"]["w"] = "rescaled"  # step 5, right after resume()
    for event in killed[1][2:]:
        event["end"]["model.parameters"]["w"] = "other"
        event["end"]["loss"] = [1.0]
    divergence = compare_point(reference, {0: killed}, kill="6", victim=0).divergence
    assert (divergence.step, divergence.phase, divergence.component) == (
        5,
        "start",
        "model.parameters",
    )
    assert "between resume() and the first step" in divergence.cause
    assert "if info is None" in divergence.fix
    assert "use_deterministic_algorithms" not in divergence.fix


def test_a_part_recorded_in_one_run_only_is_never_called_identical() -> None:
    reference = {0: [_run(8, {4: False})]}
    killed = _killed(6, 4, 8)
    killed[1][3]["start"] = None  # step 6 of the resumed run recorded no start of the step
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert not result.identical
    assert (result.divergence.step, result.divergence.phase) == (6, "start")


def test_a_generator_drawn_from_only_after_the_resume_is_compared() -> None:
    reference = {0: [_run(8, {4: False})]}  # never draws from Python's random
    killed = _killed(6, 4, 8)
    for number, event in enumerate(killed[1][2:], 7):
        event["end"]["rng.python"] = f"drawn{number}"  # the resumed run does, from step 5 on
    result = compare_point(reference, {0: killed}, kill="6", victim=0)
    assert not result.identical and result.unused == []
    assert (result.divergence.step, result.divergence.component) == (5, "rng.python")
