"""A divergence as the explanation rules see it (:class:`Situation`), what they answer
(:class:`Explanation`), and the words and helpers several rules share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpckpt._resumecheck.evidence import Evidence

NONDETERMINISM = (
    "the computation itself is not repeatable: nondeterministic GPU kernels (atomics in "
    "index_add_, scatter_add_, some cuDNN and cuBLAS algorithms), code that reads the wall "
    "clock, generators seeded from the time or the pid, or files and services that change "
    "between runs"
)
DETERMINISM_FIX = (
    "make two uninterrupted runs identical first: seed every generator before resume(), "
    "set torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8) on "
    "GPUs, and keep wall-clock time out of the computation"
)
GENERATORS = {
    "rng.python": ("Python's random module", "random.seed(...)"),
    "rng.numpy": ("numpy's global generator (np.random)", "np.random.seed(...)"),
    "rng.torch": ("torch's CPU generator", "torch.manual_seed(...)"),
    "rng.cuda": ("the CUDA generators", "torch.cuda.manual_seed(...)"),
}
BATCHNORM = ("running_mean", "running_var", "num_batches_tracked")
EPOCH_FIX = (
    "restart the epoch loop at the epoch the checkpoint was saved in (a save inside an epoch "
    "records that epoch: epoch=epoch inside the loop, epoch=epoch + 1 after it, restart at "
    "info.epoch)"
)


@dataclass
class Explanation:
    what: str
    cause: str
    fix: str
    quoted: list[str] = field(default_factory=list)  # the run's own words, as evidence


@dataclass
class Situation:
    """The first divergence: ``phase`` is ``before-kill`` (two uninterrupted runs),
    ``resume`` (right after it), ``start`` or ``end`` (of ``step``), or ``steps`` (the step
    sequence); ``recorded`` the components recorded there; ``initial`` that it is at the
    start of a run's first step."""

    phase: str
    component: str
    step: int | None
    resumed_from: int | None
    differences: Sequence[Any]
    world: int
    first_step_after_resume: bool
    recorded: frozenset[str] = frozenset()
    initial: bool = False
    evidence: Evidence = field(default_factory=Evidence)

    def differs(self, component: str) -> bool:
        return any(d.component == component for d in self.differences)

    def ranks(self, component: str | None = None) -> list[int]:
        component = component or self.component
        return sorted({d.rank for d in self.differences if d.component == component})

    @property
    def expected(self) -> Any:
        return next(d for d in self.differences if d.component == self.component).expected

    @property
    def got(self) -> Any:
        return next(d for d in self.differences if d.component == self.component).got

    @property
    def on(self) -> str:
        ranks = self.ranks()
        if len(ranks) == self.world and self.world > 1:
            return "on every rank"
        return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    @property
    def after(self) -> str:
        if self.first_step_after_resume:
            return (
                f"at the start of step {self.step}, the first step after the resume from step "
                f"{self.resumed_from}"
            )
        return f"at the start of step {self.step}"

    @property
    def loader_saved(self) -> bool:
        return any(c.startswith("loader") for c in self.recorded)

    @property
    def samples_matched(self) -> bool:
        """A tracked DataLoader recorded the step's sample indices, the same in both runs."""
        recorded = any(c.endswith(".samples") for c in self.recorded)
        return recorded and not any(d.component.endswith(".samples") for d in self.differences)


Rule = Callable[[Situation], "Explanation | None"]


def changed(expected: Any, got: Any) -> list[str]:
    """The entries of two name -> digest maps that differ."""
    if not isinstance(expected, dict) or not isinstance(got, dict):
        return []
    return [k for k in {**expected, **got} if expected.get(k) != got.get(k)]


def listed(batches: Any) -> str:
    if not isinstance(batches, list):
        return "(too many to list)"
    flat = [i for batch in batches for i in batch]
    shown = ", ".join(str(i) for i in flat[:8])
    return f"[{shown}{', ...' if len(flat) > 8 else ''}]"


def entries(state: Any) -> Any:
    return state.get("entries") if isinstance(state, dict) else state


def quote(warning: dict[str, Any]) -> str:
    ranks = ", ".join(map(str, warning["ranks"]))
    return f"rank {ranks}, {warning['where']}: {warning['text']}"


def seeds_of(seeds: list[dict[str, Any]], generator: str) -> list[dict[str, Any]]:
    kinds = {generator, "rng.torch"} if generator == "rng.cuda" else {generator}
    return [s for s in seeds if s["generator"] in kinds]
