# jupyter-gpu-lease: everything installs from nothing (a .venv, npm's configurable-http-proxy;
# `pip install -e .` builds the JupyterLab extension from src/ with npm).
# `make demo` runs the system on 127.0.0.1; `make test` runs every check CI runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CHP    := node_modules/.bin/configurable-http-proxy
PYTEST_ARGS ?=

.PHONY: install demo demo-install test fast lint typecheck unit unit-js upstream bench clean chromium promtool slurm sudo

install: $(STAMP) $(CHP) chromium promtool slurm sudo

# Debian's chromium for the browser tests (Playwright drives it; nothing is downloaded by Playwright)
chromium:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	fi

# Debian's prometheus for promtool: tests/test_metrics.py lints a live broker's /metrics with it
promtool:
	@if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; \
	fi

# Debian's slurm-wlm for the Slurm variant's test (tests/test_slurm.py): slurmctld and two
# slurmd run on this machine (provisioner/devtools/slurmcluster.py); no daemon is started here
slurm:
	@if ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm; \
	fi

# Debian's sudo: the Slurm test's root hub submits each student's job as the student
# (batchspawner's `sudo -E -u USER sbatch`), as an HPC site's hub does
sudo:
	@if ! command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends sudo; \
	fi

# the package build (hatch-jupyter-builder) runs `npm install` and `npm run build:prod` when
# src/ is newer than provisioner/labextension; the extension is then copied into the venv
LAB_SOURCES := package.json tsconfig.json $(wildcard src/*.ts schema/*.json style/*)

$(STAMP): pyproject.toml requirements-test.txt $(LAB_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-test.txt -e .
	touch $@

# npm's packages: configurable-http-proxy, and the extension's build, unit test and lint tools
$(CHP): package.json package-lock.json
	npm install --no-audit --no-fund --loglevel=error
	touch $@

# `make demo` installs only what the demo runs: the package with its runtime dependencies
# (and its JupyterLab extension, built by the package build), JupyterLab for the students,
# and configurable-http-proxy; not the test toolchain (tensorflow, torch, playwright, mypy,
# chromium). DEMO_ARGS: options of python -m provisioner.devtools.demo (e.g. --port 8001).
DEMO_STAMP := $(VENV)/.demo-stamp
DEMO_ARGS ?=

demo-install: $(DEMO_STAMP) $(CHP)

$(DEMO_STAMP): pyproject.toml requirements-demo.txt $(LAB_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements-demo.txt -e .
	touch $@

demo: demo-install
	$(BIN)/python -m provisioner.devtools.demo $(DEMO_ARGS)

lint: $(STAMP) $(CHP)
	$(BIN)/ruff check provisioner tests benchmarks examples hub_config
	$(BIN)/ruff format --check provisioner tests benchmarks examples hub_config
	npm run -s lint

typecheck: $(STAMP) $(CHP)
	$(BIN)/mypy
	npx tsc --noEmit -p .
	npx tsc --noEmit -p tsconfig.test.json

# the JupyterLab extension's model and text (test/unit/*.spec.ts): jest, with ts-jest
unit-js: $(CHP)
	npm run -s test:unit

# the unit tests in one pytest session. The broker's API, authorization, fuzzing, crash,
# failover, kernel and hub tests also run with HTTP served by a front process
# (--http-processes 1): tests/conftest.py's FRONTS_MODULES, the [sqlite-fronts] and [fronts]
# variants. WORKERS=N runs them on N pytest-xdist workers (tests/conftest.py's scheduler
# keeps a module's shared fixture, a hub or a Slurm cluster, on one worker): on this
# project's 2-core machines 3 workers saved only 13 % and loaded the machine enough for two
# load-sensitive tests to fail (docs/developers.md, Tests), so CI runs one (0: no workers)
WORKERS ?= 0

unit: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) $(PYTEST_ARGS)
	@if [ "$(WORKERS)" != "0" ]; then $(BIN)/python -m pytest -m alone $(PYTEST_ARGS); fi

# jupyter_client's and jupyter_server's own kernel and session tests, from the sdists of
# the installed versions (fetched once into .upstream/), with our provisioner as the default;
# three pytest processes at once (about 4 min on 2 shared cores; --serial: one at a time)
upstream: $(STAMP)
	$(BIN)/python tests/upstream/run_upstream.py

test: install lint typecheck unit-js unit upstream

# the fast tier: every test not marked slow; it starts no process (tests/conftest.py fails
# a test that does), so it runs in well under a minute. `make test` runs it with the rest.
fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python benchmarks/broker_throughput.py
	$(BIN)/python benchmarks/simulate.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache .demo \
		lib provisioner/labextension tsconfig.tsbuildinfo .upstream
