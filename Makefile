# llmgw — `make run` starts it, `make test` checks it. Everything installs from the pinned files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two install steps: `make run` needs only the runtime (requirements.txt); the test tools
# (requirements-dev.txt) come with the first `make test`. Each step has its stamp.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

# Checks and tests run with a throwaway key; `make run` keeps a generated one under var/.
typecheck migrations-check pytest-sqlite pytest-postgres bench bench-fleet bench-accounting bench-usage: export SECRET_KEY = llmgw-checks-only-not-a-secret

.PHONY: proto run test lint typecheck migrations-check pytest pytest-sqlite pytest-postgres bench bench-fleet bench-accounting bench-usage clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(TEST_STAMP): $(RUN_STAMP) requirements-dev.txt
	# llama-cpp-python (the real llama.cpp server in the agent tests) compiles from source.
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $@

venv: $(TEST_STAMP)

# Plain http on loopback: cookies without the Secure flag unless LLMGW_HTTPS says otherwise.
run: $(RUN_STAMP)
	@mkdir -p var; test -s var/secret_key || $(PY) -c 'import secrets; print(secrets.token_urlsafe(50))' > var/secret_key
	SECRET_KEY=$$(cat var/secret_key) LLMGW_HTTPS=$${LLMGW_HTTPS:-false} $(PY) manage.py run

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Which app may import which: the contracts in pyproject.toml (README: how the code is layered).
	$(VENV)/bin/lint-imports --no-logo

typecheck: $(TEST_STAMP)
	$(VENV)/bin/mypy

migrations-check: $(TEST_STAMP)
	$(PY) manage.py makemigrations --check --dry-run

# Each pass runs its modules in TEST_WORKERS processes (pytest-xdist; a module's tests stay in
# one, as they share its cluster): most of a test's time is spent waiting on the processes it
# started, so modules side by side fill the cores. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

pytest-sqlite: $(TEST_STAMP)
	DATABASE_URL=sqlite:///var/test.sqlite3 $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

pytest-postgres: $(TEST_STAMP)
	@$(PY) -m tests.harness.require_postgres; rc=$$?; \
	if [ $$rc = 0 ]; then \
	  DATABASE_URL=$${TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/llmgw} $(PY) -m pytest $(XDIST) --store-tests-only $(PYTEST_ARGS); \
	elif [ $$rc != 3 ]; then exit $$rc; fi

# Everything at once, each target's output kept together: most of a test pass is spent
# waiting on the processes it starts, so the checks and both passes share two cores well.
test: $(TEST_STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=target lint typecheck migrations-check pytest-sqlite pytest-postgres

bench: $(RUN_STAMP)
	$(PY) -m bench

# The control plane at fleet scale (1,000 simulated nodes, PostgreSQL + Redis); about 15
# minutes with the default hour-slope sample of 10 minutes. BENCH_FLEET_ARGS=--duration 60 ...
# It reuses the cluster tests' harness (the invariant checker, task events): the test tools.
bench-fleet: $(TEST_STAMP)
	$(PY) -m bench.fleet $(BENCH_FLEET_ARGS)

# What usage accounting costs per request (on vs off), alone and quickly.
bench-accounting: $(RUN_STAMP)
	$(PY) -m bench.accounting

# Usage at volume: 10 million rows in PostgreSQL (BENCH_POSTGRES_URL, a database it may drop and
# create), then the dashboard JSON, /account/ and a budget check, timed.
bench-usage: $(RUN_STAMP)
	$(PY) -m bench.usage_volume

clean:
	rm -rf $(VENV) var/*.sqlite3*

# The gRPC frames (agents/agent_pb2.py) from agents/agent.proto. grpcio-tools is a build tool
# only (it pulls a newer setuptools), so it lives in a throwaway environment under var/.
PROTO_VENV := var/proto-venv
proto:
	test -x $(PROTO_VENV)/bin/python || $(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/pip install --quiet grpcio-tools==1.85.1
	cd agents && ../$(PROTO_VENV)/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. agent.proto
