# llmgw — `make run` starts it, `make test` checks it. Everything installs from the pinned files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two install steps: `make run` needs only the runtime (requirements.txt); the test tools
# (requirements-dev.txt) come with the first `make test`. Each step has its stamp. Every file
# installed is checked against the hashes the lockfiles pin (--require-hashes): a package
# changed on the index, or a mirror's other build of it, is refused.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
LLAMA_STAMP := $(VENV)/.installed-llamacpp

# Checks and tests run with a throwaway key; `make run` keeps a generated one under var/.
typecheck migrations-check pytest-sqlite pytest-postgres pytest-llamacpp-sqlite pytest-llamacpp-postgres bench bench-routing bench-routing-model bench-fleet bench-accounting bench-tracing bench-usage: export SECRET_KEY = llmgw-checks-only-not-a-secret
# The suite starts hundreds of Python processes. Where the environment says not to write
# bytecode (PYTHONDONTWRITEBYTECODE=1), each of them compiled our modules again as it started
# (docs/decisions.md, 'bytecode caches in the test passes'), and each pytest process the test
# modules; the passes keep Python's caches (__pycache__, ignored by git).
pytest-sqlite pytest-postgres pytest-llamacpp-sqlite pytest-llamacpp-postgres: export PYTHONDONTWRITEBYTECODE =

.PHONY: proto dist run test venv audit lint typecheck migrations-check pytest pytest-sqlite pytest-postgres pytest-llamacpp pytest-llamacpp-sqlite pytest-llamacpp-postgres bench bench-routing bench-routing-model bench-fleet bench-accounting bench-tracing bench-usage bench-agent-servers profile clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install --quiet --require-hashes -r requirements.txt
	touch $@

# A lockfile entry is its `name==version \` line and the `--hash` lines continuing it: this
# awk program prints the entries of llama-cpp-python (LLAMA_ENTRY=1) or all others (=0).
LLAMA_ENTRY = awk -v want=$(1) '/^[^ \#]/ { llama = /^llama-cpp-python==/ } llama == want' \
  requirements-dev.txt

$(TEST_STAMP): $(RUN_STAMP) requirements-dev.txt
	# Every test tool but llama-cpp-python, which compiles llama.cpp: that one builds beside the
	# checks and the passes (LLAMA_STAMP), and only the tests that start it wait for it.
	$(call LLAMA_ENTRY,0) > $(VENV)/requirements-dev-now.txt
	$(PY) -m pip install --quiet --require-hashes -r requirements.txt -r $(VENV)/requirements-dev-now.txt
	touch $@

# llama-cpp-python (the real llama.cpp server in the agent and usage tests) from source: its
# dependencies are pinned in requirements-dev.txt and already installed. The tests serve a tiny
# text model, so the multimodal library is not built and -O1 is enough, and neither is
# llama.cpp's "common" library, which the bindings never load (tests/harness/llama_cpp_build.cmake
# says how; what each saves: docs/decisions.md, 'llama.cpp's build for the tests').
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS_RELEASE=-O1 -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
  -DCMAKE_PROJECT_llama.cpp_INCLUDE_BEFORE=$(CURDIR)/tests/harness/llama_cpp_build.cmake
# The source distribution is hash-checked like every other file (its build tools, installed by
# pip for the build alone, are not: pip checks hashes only of what it installs here).
$(LLAMA_STAMP): $(TEST_STAMP)
	$(call LLAMA_ENTRY,1) > $(VENV)/requirements-llamacpp-now.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(PY) -m pip install --quiet --no-deps --require-hashes -r $(VENV)/requirements-llamacpp-now.txt
	touch $@

venv: $(LLAMA_STAMP)

# Plain http on loopback: cookies without the Secure flag unless LLMGW_HTTPS says otherwise.
# var/ and the key in it are owner-only from the first byte, whatever the caller's umask (the
# key signs every session); `manage.py run` closes what an older version left open. The key is
# written whole to a file of its own, then linked into place (a link fails where the name
# exists), so of two `make run` started together one key wins and both read it, never half of
# one; an empty file an interrupted older write left is replaced.
run: $(RUN_STAMP)
	@umask 077; mkdir -p var; test -s var/secret_key || { new=$$(mktemp var/.secret_key.XXXXXX) && $(PY) -c 'import secrets; print(secrets.token_urlsafe(50))' > "$$new" && { ln "$$new" var/secret_key 2>/dev/null || test -s var/secret_key || mv -f "$$new" var/secret_key; }; rm -f "$$new"; }
	SECRET_KEY=$$(cat var/secret_key) LLMGW_HTTPS=$${LLMGW_HTTPS:-false} $(PY) manage.py run

# The lockfiles' pins against published security advisories (OSV records; where they come from:
# tests/harness/advisories.py): a pin a known vulnerability affects fails `make test`. Where no
# advisory source can be reached it says loudly that nothing was checked (LLMGW_ADVISORIES: a
# copy of OSV's export of PyPI, all.zip, or a folder of OSV records).
audit: $(RUN_STAMP)
	$(PY) -m tests.harness.advisories requirements.txt requirements-dev.txt

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Which app may import which: the contracts in pyproject.toml (docs/code.md: how the code is layered).
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

SQLITE_URL := sqlite:///var/test.sqlite3
POSTGRES_URL = $${TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/llmgw}

# The two passes run everything but the tests that start llama.cpp (marked llamacpp); those run
# in pytest-llamacpp, on both backends, once llama-cpp-python is built.
pytest-sqlite: $(TEST_STAMP)
	DATABASE_URL=$(SQLITE_URL) $(PY) -m pytest $(XDIST) -m 'not llamacpp' $(PYTEST_ARGS)

pytest-postgres: $(TEST_STAMP)
	@$(PY) -m tests.harness.require_postgres; rc=$$?; \
	if [ $$rc = 0 ]; then \
	  DATABASE_URL=$(POSTGRES_URL) $(PY) -m pytest $(XDIST) --store-tests-only -m 'not llamacpp' $(PYTEST_ARGS); \
	elif [ $$rc != 3 ]; then exit $$rc; fi

# The two backends' llama.cpp tests run side by side: they wait on the build, then mostly on
# the engines they start.
pytest-llamacpp: pytest-llamacpp-sqlite pytest-llamacpp-postgres

pytest-llamacpp-sqlite: $(LLAMA_STAMP)
	DATABASE_URL=$(SQLITE_URL) $(PY) -m pytest -m llamacpp $(PYTEST_ARGS)

pytest-llamacpp-postgres: $(LLAMA_STAMP)
	@$(PY) -m tests.harness.require_postgres; rc=$$?; \
	if [ $$rc = 0 ]; then \
	  DATABASE_URL=$(POSTGRES_URL) $(PY) -m pytest --store-tests-only -m llamacpp $(PYTEST_ARGS); \
	elif [ $$rc != 3 ]; then exit $$rc; fi

# Everything at once, each target's output kept together: most of a test pass is spent
# waiting on the processes it starts, so the checks, both passes and llama.cpp's build (first
# in the list, so it starts first) share two cores well.
test: $(TEST_STAMP)
	$(MAKE) --no-print-directory -j8 --output-sync=target pytest-llamacpp-sqlite pytest-llamacpp-postgres lint typecheck migrations-check audit pytest-sqlite pytest-postgres

bench: $(RUN_STAMP)
	$(PY) -m bench

# Routing over four sim replicas with prefix caches: llmgw side by side with SGLang's Model
# Gateway (installed into var/sglang-router-venv on first use, never a dependency of ours).
# A few minutes; BENCH_ROUTING_ARGS="--quick", "--workload shared", "--target llmgw" ...
bench-routing: $(RUN_STAMP)
	$(PY) -m bench.routing $(BENCH_ROUTING_ARGS)

# The same engines and workloads in virtual time (seconds, no machine noise, no router time):
# for trying a change of routing before measuring it with bench-routing.
bench-routing-model: $(RUN_STAMP)
	DJANGO_SETTINGS_MODULE=llmgw_site.settings $(PY) -m bench.routing.model $(BENCH_ROUTING_ARGS)

# The control plane at fleet scale (1,000 simulated nodes, PostgreSQL + Redis); about 15
# minutes with the default hour-slope sample of 10 minutes. BENCH_FLEET_ARGS=--duration 60 ...
# It reuses the cluster tests' harness (the invariant checker, task events): the test tools.
bench-fleet: $(TEST_STAMP)
	$(PY) -m bench.fleet $(BENCH_FLEET_ARGS)

# What usage accounting costs per request (on vs off), alone and quickly.
bench-accounting: $(RUN_STAMP)
	$(PY) -m bench.accounting

# What OpenTelemetry traces cost per request (on vs off), alone; BENCH_BASELINE=DIR adds the
# code of another checkout (tracing off against the code before it). BENCH_TRACING_ARGS=--quick
bench-tracing: $(RUN_STAMP)
	$(PY) -m bench.tracing $(BENCH_TRACING_ARGS)

# Usage at volume: 10 million rows in PostgreSQL (BENCH_POSTGRES_URL, a database it may drop and
# create), then the dashboard JSON, /account/ and a budget check, timed.
bench-usage: $(RUN_STAMP)
	$(PY) -m bench.usage_volume

# The agents' WebSocket streams on uvicorn and on daphne, side by side (PostgreSQL + Redis).
bench-agent-servers: $(TEST_STAMP)
	$(PY) -m bench.agent_servers $(BENCH_AGENT_ARGS)

# py-spy samples one web process under non-streamed and streamed load: collapsed stacks and
# flame graphs in var/profile/. py-spy is not a dependency: pip install py-spy first.
profile: $(RUN_STAMP)
	$(PY) -m bench.profile

# Two wheels and their source archives in dist/ (docs/install.md): llmgw, the whole product
# (`pip install` or `pipx install` it: its `llmgw` command is manage.py), and llmgw-agent, the
# node program alone (agents/pyproject.toml). `build` comes with the test tools; each build
# installs the backend (hatchling) into a throwaway environment of its own.
dist: $(TEST_STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m build --outdir dist agents

clean:
	rm -rf $(VENV) var/*.sqlite3*

# The gRPC frames (agents/agent_pb2.py) from agents/agent.proto. grpcio-tools is a build tool
# only (it pulls a newer setuptools), so it lives in a throwaway environment under var/.
PROTO_VENV := var/proto-venv
proto:
	test -x $(PROTO_VENV)/bin/python || $(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/pip install --quiet grpcio-tools==1.85.1
	cd agents && ../$(PROTO_VENV)/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. agent.proto
