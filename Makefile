# Two entry points: `make demo` and `make test`. Both build .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of this exact torch version is on local disk; a looser range would pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: venv install demo test lint bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[examples,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m examples.demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache *.egg-info
