# hf_posenc: every target sets up its own virtual environment (.venv) on first use.
#
#   make test     the fast tier of the test suite (a few minutes; docs/testing.md)
#   make test-all  every test CI runs: the fast tier and the `slow` one
#   make test-soak  the opt-in `soak` tier (tens of minutes to hours: training soak, L = 4096, compile matrices)
#   make test-real  the real tier: tests/test_real.py and test_export.py on SmolLM2-135M-Instruct (built once into
#                 $HF_POSENC_CACHE or ~/.cache/hf_posenc; skips without network and says "NOT RUN", fails if
#                 every test skipped while the package index answers; docs/real-checkpoint.md)
#   make test-oldest  a subset of the suite against the oldest supported versions (.venv-oldest), and
#                 checkpoints saved under each end of the version range loaded under the other
#   make demo     the default `hf-posenc study`, 2 models at a time (DEMO_JOBS; 12 models, 1x-8x; out/study)
#   make quickstart  run examples/quickstart.py (train a tiny ALiBi Llama, save, reload)
#   make bench    run benchmarks/bench_forward.py (writes benchmarks/results/forward_<device>.json)
#   make matrix   rewrite the README's support matrix from hf_posenc.support_matrix()
#   make docs     build the documentation site (mkdocs.yml, docs/) into site/ with mkdocs build --strict
#   make gpu-check  on a CUDA machine: hf-posenc doctor + every GPU benchmark (benchmarks/results/gpu_check_<gpu>.*);
#                 GPU_CHECK_ARGS=--pytest adds pytest -m gpu
#   make compile-check  compile every Triton kernel for sm_90 and sm_80 without a GPU (ptxas from Triton)
#   make test-triton36  the kernel tests in the interpreter with Triton 3.6 and numpy < 2.4 (a venv in $(VENV36))
#
# Setup: python3 -m venv .venv, then torch, then `pip install -e ".[test,study]"`. Torch comes first so that
# the dependency on torch in pyproject.toml is already satisfied. Where pip gets it is TORCH_INDEX_URL: on a
# machine without nvidia-smi, PyTorch's index of CPU wheels (torch==$(TORCH_CPU_VERSION), the CPU build; a plain
# `pip install torch` on Linux pulls the CUDA build, several GB); with nvidia-smi, pip's default index (the
# CUDA build). A torch already importable in .venv is kept. A stamp file in .venv records a finished setup; it
# is redone when pyproject.toml changes.
#
# Extra arguments: make demo DEMO_ARGS="--steps 50"   make bench BENCH_ARGS="--lengths 512"
#                  make test PYTEST_ARGS="-k alibi"  make quickstart QUICKSTART_ARGS="--steps 50"
#                  make test PYTEST_WORKERS=0 (one process, no pytest-xdist)
#                  make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (torch from another index)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV ?= .venv
TORCH_CPU_VERSION ?= 2.13.0
# Where pip installs torch from (`pip install --index-url $(TORCH_INDEX_URL) torch`). Default: without nvidia-smi,
# PyTorch's index of CPU wheels, and the torch installed is torch==$(TORCH_CPU_VERSION); with nvidia-smi, empty
# (pip's default index: its CUDA build of the newest torch). Set it for another build, e.g.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128, or empty (TORCH_INDEX_URL=) for pip's own configuration
# alone, e.g. a wheel folder named in pip.conf (as on this project's CI machines, .ci/run).
TORCH_CPU_INDEX_URL := https://download.pytorch.org/whl/cpu
HAS_NVIDIA_SMI := $(shell command -v nvidia-smi 2>/dev/null)
TORCH_INDEX_URL ?= $(if $(HAS_NVIDIA_SMI),,$(TORCH_CPU_INDEX_URL))
# Which torch: the newest on a GPU machine, the version the suite is measured with on a CPU-only one.
TORCH_SPEC ?= $(if $(HAS_NVIDIA_SMI),torch,torch==$(TORCH_CPU_VERSION))
# Extra pip arguments for the torch install.
TORCH_PIP_ARGS ?=
TORCH_PIP = $(if $(strip $(TORCH_INDEX_URL)),--index-url $(TORCH_INDEX_URL)) $(TORCH_PIP_ARGS)
# Extras of the package to install. The test extra includes Triton: its interpreter runs the kernel tests on CPU.
# The study extra (matplotlib, scikit-learn) is what `make demo` (hf-posenc study) needs.
EXTRAS ?= test,study
PY := $(VENV)/bin/python
comma := ,
STAMP := $(VENV)/.hf_posenc-setup-$(subst $(comma),-,$(EXTRAS))

PYTEST_ARGS ?=
# Test tiers (docs/testing.md): markers registered in pyproject.toml, whose pytest addopts deselect `slow`
# and `soak`, so a plain `pytest` or `make test` runs the fast tier. test-all runs TEST_ALL_MARKERS (a new
# opt-in tier adds "and not <marker>" here and in pyproject's addopts, and a target of its own like test-soak).
# A -m in PYTEST_ARGS comes later on the command line and replaces the tier's.
TEST_ALL_MARKERS ?= not soak and not real
# pytest-xdist workers (the test extra installs it). The suite runs torch on one thread per process
# (tests/conftest.py), so two workers use both cores of a 2-core machine; 0 runs one process without xdist.
# loadgroup keeps the tests marked xdist_group (one shared subprocess run) on one worker.
PYTEST_WORKERS ?= 2
# The soak tier runs in one process by default: its L = 4096 tests peak at 6-7 GiB of memory each.
SOAK_WORKERS ?= 0
xdist = $(if $(filter 0,$(1)),-p no:xdist,-n $(1) --dist loadgroup)
DEMO_ARGS ?=
# make demo trains its models two at a time (worker processes, one torch thread each; the same numbers as
# --jobs 1): on 2 cores the default study then takes about half the time (docs/study.md).
DEMO_JOBS ?= 2
QUICKSTART_ARGS ?=
BENCH_ARGS ?=
GPU_CHECK_ARGS ?=
COMPILE_CHECK_ARGS ?=
# gpu-check uses the machine's own Python, which already has CUDA torch, Triton and transformers (nothing is
# installed: GPU machines may have no internet); the package is imported from this checkout.
GPU_PYTHON ?= python3
# test-triton36: the oldest Triton that pyproject allows, and numpy < 2.4 (Triton 3.6's interpreter fails
# with numpy >= 2.4: "only 0-dimensional arrays can be converted to Python scalars").
VENV36 ?= .venv-triton36
KERNEL_TESTS ?= tests/test_kernel_attention.py tests/test_kernel_rotary.py tests/test_kernel_sba_cope.py tests/test_kernel_errors.py tests/test_aot_compile.py

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

# The oldest versions the project supports (pyproject.toml's floors; raised to what passes) and the
# subset of tests run against them. The subset (about 2 minutes on 2 idle cores) covers what depends on
# the versions: the public API, save/load and validation (test_api), PEFT, accelerate, the Trainer, DDP and
# torch.compile (test_ecosystem), the KV-cache arguments and generate's static cache (test_chunked_prefill),
# and a common-test slice: save/reload, cache == full forward and generate (greedy and beam, padded
# prompts) for one encoding of each kind. It leaves out Triton (not installed there: the kernels are
# version-independent and run in the main job), the study (matplotlib) and the long per-encoding suites.
OLDEST_VENV ?= .venv-oldest
OLDEST_PINS ?= "transformers==5.17.0" "accelerate==1.3.0" "peft==0.15.0"
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.hf_posenc-oldest
OLDEST_TESTS ?= tests/test_api.py tests/test_ecosystem.py tests/test_chunked_prefill.py tests/test_common.py tests/test_recipes.py \
	tests/test_export.py tests/test_remap.py
# Mistral with a StaticCache is left out: transformers 5.17's StaticCache keeps only min(window, max_cache_len)
# of a model whose every layer slides, so the length hf_posenc needs is lost and the patch refuses that cache
# with a ValueError (a DynamicCache works; transformers 5.2x records the length and works).
OLDEST_K ?= (not test_common or ((save_and_reload or cache_matches_full or (test_generate and padded and not unpadded \
	and not sample)) and (-rope- or -alibi- or -fox- or -cope- or -t5- or -learned- or -tape-))) \
	and not (mistral and (static or chunked_prefill)) \
	and (not test_remap or (cache_equals and llama) or save_and_load or left_padded or generate_past)
# test_remap: the remap engine through transformers 5.17's cache, padding, generate and save/load (its engine and
# oracle tests do not touch transformers).
# test_api's Triton check needs Triton (not installed in the oldest job); the DDP test launches two
# processes (the slowest test here) to test torch's DDP, and torch is the same at both ends.
OLDEST_DESELECT ?= --deselect tests/test_api.py::test_backend_override_is_validated \
	--deselect tests/test_ecosystem.py::test_ddp_two_cpu_processes_keep_encoding_in_sync
CROSS_DIR ?= $(OLDEST_VENV)/cross-version

.PHONY: help setup test test-all test-soak test-real test-oldest demo quickstart bench matrix docs clean-venv \
	gpu-check compile-check test-triton36

help:
	@sed -n '2,/^$$/p' Makefile | sed 's/^# *//'

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') is already installed in $(VENV)"; \
	else \
		echo "$(if $(HAS_NVIDIA_SMI),nvidia-smi,no nvidia-smi): $(TORCH_SPEC) from $(or $(TORCH_INDEX_URL),pip's index)"; \
		$(PY) -m pip install $(TORCH_PIP) "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -rs $(call xdist,$(PYTEST_WORKERS)) --durations=10 $(PYTEST_ARGS) tests/

test-all: $(STAMP)
	$(PY) -m pytest -q -rs $(call xdist,$(PYTEST_WORKERS)) -m "$(TEST_ALL_MARKERS)" --durations=25 $(PYTEST_ARGS) tests/

test-soak: $(STAMP)
	$(PY) -m pytest -q -rs $(call xdist,$(SOAK_WORKERS)) -m soak --durations=25 $(PYTEST_ARGS) tests/

# The real tier (marker `real`): about 55 tests on SmolLM2-135M-Instruct, one model loaded and shared. `-m real`
# comes after any `-m` in pytest's addopts, so it selects the tier even where the default run deselects it.
# pytest exits 0 when every test skipped (no checkpoint could be built); .ci/real_tier_gate.py then reads the report
# and fails the target if the package index answers (the build should have worked), or prints "real tier: NOT RUN"
# with pip's reason if it does not. -rs prints each skip's reason.
REAL_REPORT ?= $(VENV)/real-tier-junit.xml
test-real: $(STAMP)
	@rm -f $(REAL_REPORT)
	$(PY) -m pytest -q -rs $(call xdist,$(PYTEST_WORKERS)) --durations=10 -m real --junitxml=$(REAL_REPORT) \
		$(PYTEST_ARGS) tests/test_real.py \
		tests/test_export.py
	$(PY) .ci/real_tier_gate.py $(REAL_REPORT)

$(OLDEST_PY):
	$(PYTHON) -m venv $(OLDEST_VENV)

$(OLDEST_STAMP): pyproject.toml Makefile | $(OLDEST_PY)
	@if ! $(OLDEST_PY) -c "import torch" >/dev/null 2>&1; then \
		$(OLDEST_PY) -m pip install $(TORCH_PIP) "torch==$(TORCH_CPU_VERSION)"; fi
	$(OLDEST_PY) -m pip install -e . $(OLDEST_PINS) "pytest>=8" "hypothesis>=6" "pytest-xdist>=3.5"
	@touch $(OLDEST_STAMP)

test-oldest: $(STAMP) $(OLDEST_STAMP)
	@rm -rf $(CROSS_DIR)
	@echo "== checkpoints: saved with the newest versions, loaded with the oldest, and the other way round"
	$(PY) tests/_cross_version.py save $(CROSS_DIR)/newest >/dev/null
	$(OLDEST_PY) tests/_cross_version.py load $(CROSS_DIR)/newest
	$(OLDEST_PY) tests/_cross_version.py save $(CROSS_DIR)/oldest >/dev/null
	$(PY) tests/_cross_version.py load $(CROSS_DIR)/oldest
	@echo "== tests with the oldest versions: $$($(OLDEST_PY) -m pip list 2>/dev/null | grep -E '^(torch|transformers|accelerate|peft) ' | tr -s ' ' | tr '\n' ' ')"
	$(OLDEST_PY) -m pytest -q -p no:cacheprovider $(call xdist,$(PYTEST_WORKERS)) -m "$(TEST_ALL_MARKERS)" \
		$(OLDEST_DESELECT) -k "$(OLDEST_K)" \
		$(OLDEST_TESTS)

demo: $(STAMP)
	$(VENV)/bin/hf-posenc study --jobs $(DEMO_JOBS) $(DEMO_ARGS)

quickstart: $(STAMP)
	$(PY) examples/quickstart.py $(QUICKSTART_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_forward.py $(BENCH_ARGS)

matrix: $(STAMP)
	$(PY) -c 'import re, pathlib, hf_posenc; p = pathlib.Path("README.md"); \
		s, e = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"; \
		t = re.sub(re.escape(s) + ".*?" + re.escape(e), lambda m: s + "\n" + hf_posenc.support_matrix() + "\n" + e, \
		p.read_text(), count=1, flags=re.S); p.write_text(t); print("README.md support matrix updated")'

# The docs extra (mkdocs, mkdocs-material, mkdocstrings) on top of the setup. The API pages read the package's
# source (griffe); the encoding catalogue (encodings.md) is generated from the registry by a build hook
# (docs/hooks/catalogue.py), which imports the package. --strict: a broken link or anchor, a page missing from
# the nav or a docstring mkdocstrings cannot render fails the build. The site goes to site/ (gitignored).
DOCS_STAMP := $(VENV)/.hf_posenc-setup-docs
$(DOCS_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install -e ".[docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)

gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

compile-check: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m hf_posenc.kernels.compile_check $(COMPILE_CHECK_ARGS)

$(VENV36)/.done: pyproject.toml
	$(PYTHON) -m venv $(VENV36)
	$(VENV36)/bin/python -m pip install $(TORCH_PIP) "torch==$(TORCH_CPU_VERSION)"
	$(VENV36)/bin/python -m pip install "triton==3.6.0" "numpy<2.4"
	$(VENV36)/bin/python -m pip install -e ".[test]" "triton==3.6.0" "numpy<2.4"
	@touch $@

test-triton36: $(VENV36)/.done
	$(VENV36)/bin/python -m pytest -q -rs -p no:cacheprovider -m "$(TEST_ALL_MARKERS)" $(PYTEST_ARGS) $(KERNEL_TESTS)
