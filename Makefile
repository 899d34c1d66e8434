# llmgw — `make run` starts it, `make test` checks it. Everything installs from the pinned files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Checks and tests run with a throwaway key; `make run` keeps a generated one under var/.
typecheck migrations-check pytest-sqlite pytest-postgres bench: export SECRET_KEY = llmgw-checks-only-not-a-secret

.PHONY: run test lint typecheck migrations-check pytest pytest-sqlite pytest-postgres bench clean

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# llama-cpp-python (the real llama.cpp server in the agent tests) compiles from source.
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	@mkdir -p var; test -s var/secret_key || $(PY) -c 'import secrets; print(secrets.token_urlsafe(50))' > var/secret_key
	SECRET_KEY=$$(cat var/secret_key) $(PY) manage.py run

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

migrations-check: $(STAMP)
	$(PY) manage.py makemigrations --check --dry-run

pytest-sqlite: $(STAMP)
	DATABASE_URL=sqlite:///var/test.sqlite3 $(PY) -m pytest $(PYTEST_ARGS)

pytest-postgres: $(STAMP)
	@$(PY) -m tests.harness.require_postgres; rc=$$?; \
	if [ $$rc = 0 ]; then \
	  DATABASE_URL=$${TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/llmgw} $(PY) -m pytest $(PYTEST_ARGS); \
	elif [ $$rc != 3 ]; then exit $$rc; fi

test: lint typecheck migrations-check pytest-sqlite pytest-postgres

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) var/*.sqlite3*
