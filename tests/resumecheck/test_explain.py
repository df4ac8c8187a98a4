"""The likely cause and fix named for a divergence (ddpckpt._resumecheck.explain)."""

from __future__ import annotations

from types import SimpleNamespace

from ddpckpt._resumecheck.explain import explain


def _first_step_after_resume(component: str) -> tuple[str, str, str]:
    differences = [
        SimpleNamespace(component=component, rank=rank, expected="a", got="b") for rank in (0, 1)
    ]
    return explain(
        phase="start",
        component=component,
        step=21,
        resumed_from=20,
        differences=differences,
        world=2,
        first_step_after_resume=True,
        loader_saved=True,
    )


def test_torch_generator_after_resume_names_a_restart_at_another_epoch_too() -> None:
    """A mid-epoch checkpoint resumed at info.epoch + 1 shifts torch's generator through the
    DataLoader's new pass: the report must not blame seeding alone."""
    _, cause, fix = _first_step_after_resume("rng.torch")
    assert "seeds it after resume()" in cause and "another epoch" in cause
    assert "DataLoader WARNING" in cause and "restart at info.epoch" in fix


def test_numpy_generator_after_resume_is_blamed_on_seeding() -> None:
    _, cause, fix = _first_step_after_resume("rng.numpy")
    assert "seeds it after resume()" in cause and "epoch" not in cause
    assert "np.random.seed" in fix


def _after_the_first_resumed_step(component: str, world: int, ranks: list[int]) -> tuple:
    differences = [
        SimpleNamespace(component=component, rank=rank, expected="a", got="b") for rank in ranks
    ]
    return explain(
        phase="end",
        component=component,
        step=21,
        resumed_from=20,
        differences=differences,
        world=world,
        first_step_after_resume=True,
        loader_saved=True,
    )


def test_a_step_that_ends_apart_on_every_rank_of_three_names_the_gradient_order() -> None:
    """Same state, same inputs, same loss, and every rank's update differs: from 3 ranks on,
    gradients summed in another order (DDP's bucket layout), not the user's optimizer."""
    for component in ("optimizer", "model.parameters"):
        what, cause, fix = _after_the_first_resumed_step(component, 3, [0, 1, 2])
        assert "the first step after the resume from step 20" in what
        assert "all-reduced in another order" in cause and "buckets" in cause
        assert "ddpckpt WARNING" in cause and "create the optimizer" not in fix
    _, cause, fix = _after_the_first_resumed_step("optimizer", 2, [0, 1])  # sums are exact
    assert "buckets" not in cause and "create the optimizer once" in fix
    _, cause, _ = _after_the_first_resumed_step("optimizer", 3, [2])  # one rank: no reduction
    assert "buckets" not in cause
