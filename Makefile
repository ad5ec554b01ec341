# floatguard — two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs, runs the main job
#   make test   creates .venv, installs, runs ruff, mypy --strict and pytest
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint typecheck pytest demo bench gpu-check clean

# Every install goes through constraints.txt, the development and CI lock (README,
# "Pinned test tools"). The editable install builds with the pinned hatchling, not an
# isolated build environment that would take whatever hatchling PyPI serves that day.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt pip

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -c constraints.txt hatchling editables
	$(PY) -m pip install -c constraints.txt --no-build-isolation -e ".[dev,hf,lightning,tensorboard]"
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict src

pytest: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck pytest

# The inner loop: no test that starts ranks or another program, none of the slow ones
# (tests/conftest.py fails a test that starts a process without its marker).
test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not ranks and not subprocess and not slow" --durations=5

demo: $(STAMP)
	$(VENV)/bin/floatguard demo --out floatguard-demo --force

bench: $(STAMP)
	$(PY) benchmarks/bench_quantize.py
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_monitor.py
	$(PY) benchmarks/bench_guard.py
	$(PY) benchmarks/bench_fp8_emulation.py
	$(PY) benchmarks/bench_repro.py

# One table of what only a CUDA device can show (README, "GPU check"); without CUDA
# it says so and exits 0. ARGS=--quick: the same models, fewer steps.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
