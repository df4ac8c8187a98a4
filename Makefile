# The two commands the README opens with: `make demo` and `make test`; `make bench` runs the
# benchmark (benchmarks/bench.py, kept in the source tree, not in the package), `make docs`
# builds the documentation site into docs/_build/html.
# Both build a virtual environment first (torch==2.13.0 first, then this project).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Tests run in parallel worker processes (pytest-xdist), dealt one by one to whichever worker
# is free; tests sharing a module-scoped fixture stay on one worker (tests/support/tiers.py).
# Three on two cores: many tests wait on their processes, a timeout or Ray with a core idle
# (the tests took 520 s on 2 workers, 456 s on 3, 472 s on 4: docs/architecture.md). With
# more cores: make test TEST_WORKERS=N.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

.PHONY: demo bench docs test test-fast test-scale lint style fuzz clean
FUZZ_SECONDS ?= 1800

# Installed without compiling every module to bytecode (a minute of one core, most of it for
# modules nothing imports); Python writes it for the modules the commands below import, the
# first time they import them, so this Makefile's commands never run with it disabled.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ddpckpt demo --out demo-output

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py --out bench-output

docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

lint: style
	$(BIN)/mypy

# The linters that take seconds (the type check takes half a minute of one core).
style: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks docs
	$(BIN)/ruff format --check src tests examples benchmarks docs
	$(BIN)/lint-imports

# Every tier: unit, processes and long (tests/support/tiers.py). The type check runs beside
# the tests, on the CPU time they leave idle while they wait on their processes; either
# failing fails the target (pytest's status first).
test: style
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typecheck=$$!; \
	$(PYTEST); tests=$$?; \
	wait $$typecheck; typed=$$?; \
	echo "$(BIN)/mypy"; cat $(VENV)/mypy.log; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$typed

# The long-running fuzz target (outside CI, which runs tests/test_fuzz.py): coverage-guided,
# each target for FUZZ_SECONDS; a violation leaves its input as crash-* in fuzz-output/.
fuzz: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[fuzz]'
	mkdir -p fuzz-output/checkpoint fuzz-output/torchfile fuzz-output/dcp fuzz-output/deepspeed
	cd fuzz-output && ../$(BIN)/python ../tests/fuzz/fuzz_checkpoints.py checkpoint -max_total_time=$(FUZZ_SECONDS) checkpoint
	cd fuzz-output && ../$(BIN)/python ../tests/fuzz/fuzz_checkpoints.py torchfile -max_total_time=$(FUZZ_SECONDS) torchfile
	cd fuzz-output && ../$(BIN)/python ../tests/fuzz/fuzz_checkpoints.py dcp -max_total_time=$(FUZZ_SECONDS) dcp
	cd fuzz-output && ../$(BIN)/python ../tests/fuzz/fuzz_checkpoints.py deepspeed -max_total_time=$(FUZZ_SECONDS) deepspeed

# The quick loop while developing: the unit tier (no test in it starts a process or a
# server); `make test` (what CI runs) is the whole suite.
test-fast: $(STAMP)
	$(PYTEST) -m "not processes and not long" -q

# The protocol at 32 real processes (2 simulated nodes of 16; about 5 minutes on 2 cores):
# outside `make test`, which it would take past its time budget.
test-scale: $(STAMP)
	DDPCKPT_SCALE_TEST=1 $(PYTEST) tests/run/test_fast_tier.py -k thirty_two -q

clean:
	rm -rf $(VENV) demo-output bench-output fuzz-output .pytest_cache docs/_build
