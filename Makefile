# Two commands that do all their own set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 2

.PHONY: demo test bench install clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m splitlearn.demo

# Two phases: most tests on $(TEST_WORKERS) pytest-xdist workers (a test file stays on one worker,
# so its module-scoped servers are shared), then the tests that measure time or fairness alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS)
	$(PY) -m pytest tests -m serial $(PYTEST_ARGS)

# the workloads side by side (benchmarks/run.py), then across an emulated WAN (benchmarks/wan.py)
bench: $(STAMP)
	$(PY) benchmarks/run.py
	$(PY) benchmarks/wan.py

clean:
	rm -rf $(VENV) build *.egg-info
