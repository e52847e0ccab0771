# Two entry points: `make demo` and `make test`. Both build .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of this exact torch version is on local disk; a looser range would pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: venv install demo test lint bench bench-all clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[examples,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m examples.demo

# Two pytest-xdist workers: each test runs torch on one thread (tests/conftest.py), so one process leaves the
# second core idle. worksteal hands each worker a contiguous half (a file's module fixtures built once) and
# moves tests to a worker that runs dry. TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The headline table (benchmarks/headline.py): plain, each callback alone, the shipped suite, a random subset and
# InfoBatch on three workloads, 5 seeds; about 30 minutes on 2 CPU cores. Writes benchmarks/results/headline.*
bench: install
	$(PY) -m benchmarks.headline

# The per-method benchmarks at their committed settings (benchmarks/README.md), one after the other: several
# hours on 2 CPU cores; each writes benchmarks/results/<name>.{json,md}. Not here: the GPU scripts
# (benchmarks/gpu_headline.py, benchmarks/gpu_energy_check.py: they need an NVIDIA GPU) and the finished
# studies (benchmarks/studies/).
bench-all: install
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.clients
	$(PY) -m benchmarks.energy_overhead --epochs 20 --charlm-epochs 1 --seeds 0 1 2
	$(PY) -m benchmarks.stability_guard --only overhead
	$(PY) -m benchmarks.stability_guard --only faults
	$(PY) -m benchmarks.hard_sample_replay --workloads mnist1d-cnn --seeds 0 1 2
	$(PY) -m benchmarks.gradient_cache
	$(PY) -m benchmarks.scheduled_prune
	$(PY) -m benchmarks.mhc_stability
	$(PY) -m benchmarks.mhc_overhead --widths 128 256 512 --seeds 0 1 2
	$(PY) -m benchmarks.example_accuracy --seeds 0 1 2 --workloads mnist1d-cnn mnist1d-mlp digits charlm

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache *.egg-info
