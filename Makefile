# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv and installs the pinned versions (constraints.txt) before running.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp-install

.PHONY: install demo test lint typecheck unit bench docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e ".[test,examples,docs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check tdhook_fn tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict tdhook_fn

unit: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/run.py

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
