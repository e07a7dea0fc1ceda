# jupyter-gpu-lease: everything installs from nothing (a .venv, npm's configurable-http-proxy;
# `pip install -e .` builds the JupyterLab extension from src/ with npm).
# `make demo` runs the system on 127.0.0.1; `make test` runs every check CI runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CHP    := node_modules/.bin/configurable-http-proxy
PYTEST_ARGS ?=

# Python writes its bytecode caches here, even where the environment says not to (this
# project's machines set PYTHONDONTWRITEBYTECODE=1): every pytest process (three workers,
# the upstream shards) would otherwise rewrite the test modules' and its plugins' asserts
# again, about 9 s of CPU each, and each process the tests start would compile again
# whatever module has no cache yet
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo demo-install test fast lint typecheck unit unit-js upstream bench clean debs

install: $(STAMP) $(CHP) debs

# Debian's packages the tests use, after one `apt-get update` (make test runs this beside
# pip's and npm's installs, make -j):
# chromium for the browser tests (Playwright drives it; nothing is downloaded by Playwright);
# prometheus for promtool (tests/test_metrics.py lints a live broker's /metrics with it);
# slurm-wlm for the Slurm tests (slurmctld and two slurmd on this machine,
# provisioner/devtools/slurmcluster.py; no daemon is started here); sudo, with which the
# Slurm test's root hub submits each student's job as the student (batchspawner's
# `sudo -E -u USER sbatch`), as an HPC site's hub does
DEBS := promtool:prometheus slurmctld:slurm-wlm sudo:sudo

debs:
	@missing=""; for pair in $(DEBS); do \
		command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	if { [ -n "$$missing" ] || [ ! -x /usr/bin/chromium ]; } && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q >/dev/null; \
		if [ ! -x /usr/bin/chromium ]; then \
			echo "apt-get install chromium"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; \
		fi; \
		if [ -n "$$missing" ]; then \
			echo "apt-get install$$missing"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; \
		fi; \
	fi

# the package build (hatch-jupyter-builder) runs `npm install` and `npm run build:prod` when
# src/ is newer than provisioner/labextension; the extension is then copied into the venv
LAB_SOURCES := package.json tsconfig.json $(wildcard src/*.ts schema/*.json style/*)

# (after npm's install: the package build runs npm in the same folder)
$(STAMP): pyproject.toml requirements-test.txt $(LAB_SOURCES) | $(CHP)
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
# keeps a module's shared fixture, a hub or a Slurm cluster, on one worker), then the tests
# marked `alone` (they restart the shared PostgreSQL server) by themselves. Serial, the
# unit tests keep 2 cores only 41 % busy (they mostly wait for kernels, servers, TTLs):
# 3 workers fill them (docs/developers.md, Tests). WORKERS=0: one process, no xdist.
WORKERS ?= 3

unit: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) $(PYTEST_ARGS)
	@if [ "$(WORKERS)" != "0" ]; then \
		$(BIN)/python -m pytest -m alone $(PYTEST_ARGS) $$(grep -l "mark.alone" tests/test_*.py); \
	fi

# jupyter_client's and jupyter_server's own kernel and session tests, from the sdists of
# the installed versions (fetched once into .upstream/), with our provisioner as the default;
# three pytest processes at once (about 4 min on 2 shared cores; --serial: one at a time)
upstream: $(STAMP)
	$(BIN)/python tests/upstream/run_upstream.py

# what CI runs (.ci/run): the installs at once (pip's, npm's, apt-get's), the checks, then
# the unit tests with the upstream suites beside them (they wait for kernels, about 20 % of
# a core): the upstream output follows the unit tests' (.upstream/make-upstream.log), and
# the run fails if either failed
test:
	@$(MAKE) --no-print-directory -j3 install
	@$(MAKE) --no-print-directory lint typecheck unit-js
	@mkdir -p .upstream; \
	$(MAKE) --no-print-directory upstream > .upstream/make-upstream.log 2>&1 & upstream=$$!; \
	$(MAKE) --no-print-directory unit; unit=$$?; \
	wait $$upstream; up=$$?; \
	cat .upstream/make-upstream.log; \
	echo "make test: unit tests exit $$unit, upstream suites exit $$up"; \
	[ $$unit = 0 ] && [ $$up = 0 ]

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
