# The two set-up commands of the README. Each creates .venv with the machine's python3
# and installs the package into it, so a fresh clone needs nothing but Python and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

# JAX's CUDA plugin (pyproject's gpu-compile pins) goes apart from the venv's packages, in
# .venv/gpu-compile: JAX loads every plugin on its path at start-up, and this one logs
# that no CUDA driver is found; automap._verify._gpu loads it from there to compile for a
# GPU without one. libtpu (the tpu-compile pins) goes apart alike, in .venv/tpu-compile:
# automap._verify._tpu loads it from there to compile for a TPU topology without one.
# The third-party models (pyproject's thirdparty pins: transformers, keras-hub and what
# they import) go into the venv itself, with --no-deps: keras-hub declares TensorFlow,
# which it never imports and which would fight JAX's numpy and ml_dtypes pins.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $$($(BIN)/python -c \
		"import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['thirdparty'])")
	$(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/gpu-compile $$($(BIN)/python -c \
		"import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu-compile'])")
	$(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/tpu-compile $$($(BIN)/python -c \
		"import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['tpu-compile'])")
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/automap plan --model bert-large --cluster a100 --devices 16 --budget 20

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# Every test at the full count of generated cases (tests/_cases.py): what CI runs. Two
# pytest-xdist workers, one per core, a test file to a worker (its module fixtures are
# built once), the longest files first (tests/conftest.py's SECONDS; xdist's own order,
# by number of tests, hands out files of a few long tests near the end, where one can
# leave the other worker idle); the slowest tests are listed at the end, to keep the
# suite in its budget. Both cores are busy nearly throughout (at ad28835: tests summing
# to 2,970 s in 1,506 s on two idle cores), so the suite's time is its work over two: cut
# work to cut it.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP) lint
	AUTOMAP_TEST_CASES=full $(PYTEST) --durations=30

# The development tier, a few minutes: no `slow` test (pyproject's markers), a few of each
# test's generated cases. `make test` still runs everything.
test-fast: $(STAMP) lint
	AUTOMAP_TEST_CASES=quick $(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
