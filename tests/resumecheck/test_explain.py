"""The likely cause and fix named for a divergence (ddpckpt._resumecheck.explain): the
cause the runs' own evidence shows comes first."""

from __future__ import annotations

from types import SimpleNamespace

from ddpckpt._resumecheck.evidence import Evidence
from ddpckpt._resumecheck.explain import RULES, explain
from ddpckpt._resumecheck.situation import Explanation, Situation


def _situation(component: str, evidence: Evidence | None = None, **fields) -> Situation:
    differences = [
        SimpleNamespace(component=component, rank=rank, expected="a", got="b") for rank in (0, 1)
    ]
    defaults = {"phase": "start", "step": 21, "resumed_from": 20, "world": 2,
                "first_step_after_resume": True, "recorded": frozenset({"loader", "rng.torch"})}  # fmt: skip
    defaults.update(fields)
    return Situation(component=component, differences=differences,
                     evidence=evidence or Evidence(), **defaults)  # fmt: skip


def test_torch_generator_after_resume_without_evidence_names_both_usual_causes() -> None:
    """A mid-epoch checkpoint resumed at info.epoch + 1 shifts torch's generator through the
    DataLoader's new pass: without evidence the report must not blame seeding alone."""
    found = explain(_situation("rng.torch"))
    assert "seeds it after resume()" in found.cause and "another epoch" in found.cause
    assert "DataLoader WARNING" in found.cause and "restart at info.epoch" in found.fix


def test_a_seeding_call_after_the_resume_is_named_with_its_place() -> None:
    seed = {"generator": "rng.numpy", "value": "0", "where": "train.py:57", "after_step": 20,
            "resumed_from": 20}  # fmt: skip
    found = explain(_situation("rng.numpy", Evidence(seeds_after_resume=[seed])))
    assert "np.random.seed(0) at train.py:57" in found.cause
    assert "another epoch" not in found.cause and "np.random.seed" in found.fix


def test_the_loader_warning_of_the_resumed_run_is_the_cause_and_is_quoted() -> None:
    warning = {"text": "DataLoader: ... so the remaining 4 batches of epoch 1 are skipped",
               "logger": "ddpckpt._training.loader_checks", "level": "WARNING",
               "where": "after the resume from step 20", "ranks": [0, 1]}  # fmt: skip
    found = explain(_situation("rng.torch", Evidence(warnings=[warning])))
    assert found.cause.startswith("the loop restarted at another epoch")
    assert "seeds" not in found.cause
    assert found.quoted == [f"rank 0, 1, after the resume from step 20: {warning['text']}"]


def test_two_runs_never_seeded_cannot_be_judged_and_the_seeding_is_named() -> None:
    found = explain(
        _situation(
            "rng.torch",
            Evidence(initial_differs=["rng.torch"]),
            phase="before-kill",
            step=1,
            initial=True,
            first_step_after_resume=False,
        )
    )
    assert "never interrupted" in found.what
    assert "never seeded" in found.cause and "torch.manual_seed" in found.fix


def test_a_seed_from_the_clock_is_told_from_a_missing_seed() -> None:
    def seed(value: str) -> dict:
        return {"generator": "rng.torch", "value": value, "where": "train.py:9"}

    evidence = Evidence(seeds_reference=[seed("1764031000")], seeds_killed=[seed("1764031042")],
                        initial_differs=["rng.torch"])  # fmt: skip
    found = explain(_situation("rng.torch", evidence, phase="before-kill", step=1, initial=True))
    assert "changes between runs" in found.cause
    assert "torch.manual_seed(1764031000) at train.py:9" in found.cause


def test_every_rule_answers_none_or_an_explanation_and_the_last_answers_all() -> None:
    situation = _situation("something.new", phase="end", first_step_after_resume=False)
    answers = [rule(situation) for rule in RULES]
    assert answers[-1] is not None and all(a is None for a in answers[:-1])


def _after_the_first_resumed_step(component: str, world: int, ranks: list[int]) -> Explanation:
    differences = [
        SimpleNamespace(component=component, rank=rank, expected="a", got="b") for rank in ranks
    ]
    return explain(
        Situation(phase="end", component=component, step=21, resumed_from=20,
                  differences=differences, world=world, first_step_after_resume=True)
    )  # fmt: skip


def test_a_step_that_ends_apart_on_every_rank_of_three_names_the_gradient_order() -> None:
    """Same state, same inputs, same loss, and every rank's update differs: from 3 ranks on,
    gradients summed in another order (DDP's bucket layout), not the user's optimizer."""
    for component in ("optimizer", "model.parameters", "optimizer:opt_D", "model:G.parameters"):
        found = _after_the_first_resumed_step(component, 3, [0, 1, 2])
        assert "the first step after the resume from step 20" in found.what
        assert "all-reduced in another order" in found.cause and "buckets" in found.cause
        assert "ddpckpt WARNING" in found.cause and "create the optimizer" not in found.fix
    found = _after_the_first_resumed_step("optimizer", 2, [0, 1])  # sums are exact
    assert "buckets" not in found.cause and "create the optimizer once" in found.fix
    found = _after_the_first_resumed_step("optimizer", 3, [2])  # one rank: no reduction
    assert "buckets" not in found.cause
