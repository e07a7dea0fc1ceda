# jupyter-gpu-lease: everything installs from nothing (a .venv, npm's configurable-http-proxy).
# `make demo` runs the system on 127.0.0.1; `make test` runs every check CI runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CHP    := node_modules/.bin/configurable-http-proxy
PYTEST_ARGS ?=

.PHONY: install demo test lint typecheck unit bench clean chromium

install: $(STAMP) $(CHP) chromium

# Debian's chromium for the browser tests (Playwright drives it; nothing is downloaded by Playwright)
chromium:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	fi

$(STAMP): pyproject.toml requirements-test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-test.txt -e .
	touch $@

$(CHP): package.json
	npm install --no-audit --no-fund --loglevel=error
	touch $@

demo: install
	$(BIN)/python -m provisioner.demo

lint: $(STAMP)
	$(BIN)/ruff check provisioner tests benchmarks examples hub_config
	$(BIN)/ruff format --check provisioner tests benchmarks examples hub_config

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: install lint typecheck unit

bench: install
	$(BIN)/python benchmarks/broker_throughput.py
	$(BIN)/python benchmarks/simulate.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache .demo
