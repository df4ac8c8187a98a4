"""The long-running fuzz target, outside CI: the mutations and the property of
``tests/support/mutations.py`` (which the CI tests in ``tests/test_fuzz.py`` run for a few
hundred examples), driven for as long as you let it run.

With atheris (``pip install 'ddpckpt[fuzz]'``), coverage-guided::

    make fuzz                                    # every target, 30 minutes each
    python tests/fuzz/fuzz_checkpoints.py checkpoint -max_total_time=3600 corpus/
    python tests/fuzz/fuzz_checkpoints.py torchfile -atheris_runs=100000

A violation (an undocumented exception, a call over its time or memory bound, a file opened
outside the checkpoint, a process started) stops the run and leaves the input that caused
it as ``crash-<hash>``; ``python tests/fuzz/fuzz_checkpoints.py checkpoint crash-<hash>``
replays it. Without atheris the same property runs on seeded random choices, example after
example (``--examples N``, ``--seed S``), printing each failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))


class FuzzedChooser:
    """A mutation's choices from atheris' bytes (the fuzzer learns which ones matter)."""

    def __init__(self, provider) -> None:
        self._provider = provider

    def integer(self, lo: int, hi: int) -> int:
        return self._provider.ConsumeIntInRange(lo, hi)

    def raw(self, at_most: int) -> bytes:
        return self._provider.ConsumeBytes(self._provider.ConsumeIntInRange(0, at_most))


def _with_atheris(kind: str, root: Path, argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["ddpckpt"]):
        from mutations import example

        one = example(kind, root)

    def test_one_input(data: bytes) -> None:
        one(FuzzedChooser(atheris.FuzzedDataProvider(data)))

    atheris.Setup([sys.argv[0], *argv], test_one_input)
    atheris.Fuzz()


def _without_atheris(kind: str, root: Path, examples: int, seed: int) -> int:
    from mutations import RandomChooser, example

    one = example(kind, root)
    failures, started = 0, time.monotonic()
    for index in range(seed, seed + examples):
        try:
            one(RandomChooser(index))
        except Exception as exc:  # report every violation and go on
            failures += 1
            print(f"example {index}: {type(exc).__name__}: {exc}"[:2000], flush=True)
    rate = examples / (time.monotonic() - started)
    print(f"{kind}: {examples} examples ({rate:.1f}/s), {failures} violations")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["checkpoint", "torchfile", "dcp", "deepspeed"])
    parser.add_argument("--examples", type=int, default=10_000, help="without atheris")
    parser.add_argument("--seed", type=int, default=0, help="without atheris")
    args, rest = parser.parse_known_args()
    logging.getLogger("ddpckpt").setLevel(logging.CRITICAL)  # damaged inputs warn by design
    warnings.simplefilter("ignore")  # torch's notes on old pickle protocols
    with tempfile.TemporaryDirectory(prefix="ddpckpt-fuzz-") as tmp:
        try:
            import atheris  # noqa: F401
        except ImportError:
            print("atheris is not installed (pip install 'ddpckpt[fuzz]'): random examples")
            return _without_atheris(args.kind, Path(tmp), args.examples, args.seed)
        _with_atheris(args.kind, Path(tmp), rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
