# dapo-kernels: `make demo` runs the main job, `make test` the whole test suite.
# Both create the virtual environment inside the checkout (.venv), install the pinned
# dependencies and build the C++ extension first; nothing needs installing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Tests run in parallel on the 2 cores; interpreted Triton is CPU-bound Python.
TEST_WORKERS ?= 2

.PHONY: all install demo test bench bench-deps clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install when a requirements file changes.
$(VENV)/.deps: requirements.txt requirements-dev.txt | $(PY)
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	touch $@

# Re-build the extension when the C++ sources or setup.py change.
$(VENV)/.ext: $(VENV)/.deps setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.ext

demo: install
	$(PY) -m dapo_kernels.demo

test: install
	$(PY) -m pytest tests -n $(TEST_WORKERS) --timeout=600

# Benchmark-only peers (never dependencies of the library itself).
$(VENV)/.bench-deps: requirements-bench.txt requirements-bench-nodeps.txt $(VENV)/.deps
	$(PIP) install -q -r requirements-bench.txt
	$(PIP) install -q --no-deps -r requirements-bench-nodeps.txt
	touch $@

bench-deps: install $(VENV)/.bench-deps

bench: bench-deps
	$(PY) -m pytest benchmarks --benchmark-only -p no:xdist

clean:
	rm -rf $(VENV) build *.egg-info dapo_kernels/_C*.so
