# Two commands that do all their own set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := constraints.txt
export OMP_NUM_THREADS ?= 2

.PHONY: demo test bench install clean test-latest lock fuzz gpu-wheels

# torch first and pinned, by pip (it takes the CPU build on this disk; an unpinned torch pulls
# several GB of CUDA wheels). Then every package at the version constraints.txt locks (the build
# tools too: --no-build-isolation builds with them), by uv: the same set pip installs (compared:
# `pip freeze` equal), in ~5 s instead of ~50 s; pip does it where uv cannot.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q $(shell grep -E '^(pip|uv)==' $(LOCK))
	$(1)/bin/python -m pip install -q torch==2.13.0
endef
UV_INSTALL = $(PY) -m uv pip install -q --python $(PY) -c $(LOCK)
PIP_INSTALL = $(PY) -m pip install -q -c $(LOCK)

$(STAMP): setup.py $(LOCK)
	$(call make_venv,$(VENV))
	$(UV_INSTALL) setuptools || $(PIP_INSTALL) setuptools
	$(UV_INSTALL) --no-build-isolation -e '.[test]' || $(PIP_INSTALL) --no-build-isolation -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m splitlearn.apps.demo

# Two phases: most tests on $(TEST_WORKERS) pytest-xdist workers (a test file stays on one worker,
# so its module-scoped servers are shared), the slowest files handed out first (tests/slowfirst.py;
# --no-loadscope-reorder keeps that order), then the tests that measure time or fairness alone
# (collected from the files that mark some: collecting every file costs ~17 s).
TEST_WORKERS ?= 2
SERIAL_FILES = $(shell grep -l "pytest.mark.serial" tests/test_*.py)
test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=15 $(PYTEST_ARGS)
	$(PY) -m pytest $(SERIAL_FILES) -m serial --durations=5 $(PYTEST_ARGS)

# The tests that reach into transformers, peft, accelerate and datasets (the model classes, the
# remote cache, generation, drafts, Trainer, LoRA), on the newest releases setup.py admits, in a
# throw-away venv: a release that breaks splitlearn shows here before a user meets it.
LATEST ?= .venv-latest
INTERNALS_TESTS := tests/test_hf_modeling.py tests/test_hf_cache.py tests/test_hf_generation.py \
	tests/test_hf_draft.py tests/test_hf_lora.py tests/test_hf_pipeline.py tests/test_client_generation.py \
	tests/test_client_lora.py tests/test_segments.py tests/test_partition.py tests/test_packed.py \
	tests/test_lora.py tests/test_examples.py tests/test_localserver.py tests/test_hf_eval.py
test-latest:
	rm -rf $(LATEST)
	$(call make_venv,$(LATEST))
	$(LATEST)/bin/python -m pip install -q --upgrade setuptools
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager --no-build-isolation -e '.[test]'
	$(LATEST)/bin/python tools/lockdiff.py $(LOCK) $(LATEST)
	$(LATEST)/bin/python -m pytest $(INTERNALS_TESTS) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -p no:cacheprovider $(PYTEST_ARGS)

# Refresh the lock: the newest releases setup.py admits, frozen into constraints.txt. Then run
# `make clean test` and commit constraints.txt with what made it pass.
lock: test-latest
	$(LATEST)/bin/python tools/lockdiff.py $(LOCK) $(LATEST) --write

# the workloads side by side (benchmarks/run.py), across an emulated WAN (benchmarks/wan.py), then
# owners generating and training at once under Locust (benchmarks/load.py)
bench: $(STAMP)
	$(PY) benchmarks/run.py
	$(PY) benchmarks/wan.py
	$(PY) benchmarks/load.py --json benchmarks/results/cpu/load.json

# the wheels a lent GPU machine lacks (.whl/, gitignored), which benchmarks/gpu_session.sh
# installs there; benchmarks/README.md, 'On a GPU'
gpu-wheels: $(STAMP)
	PY=$(PY) sh tools/gpu_wheels.sh

# schemathesis against a real server of each shape, from its own /v1/openapi.json (2,000+ requests)
fuzz: $(STAMP)
	$(PY) benchmarks/fuzz.py --json benchmarks/results/cpu/fuzz.json

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info
