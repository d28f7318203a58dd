# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv and installs the pinned versions (constraints.txt) before running.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp-install
SITE_DIR ?= site

.PHONY: install demo test lint typecheck unit bench docs clean

$(STAMP): pyproject.toml constraints.txt
	@echo "== installing the pinned packages into $(VENV): the first time 1 to 4 minutes (measured on 2 cores:"
	@echo "   73 s on a quiet machine, 4 minutes on a loaded one); pip names each package as it goes"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --progress-bar off --disable-pip-version-check -c constraints.txt -e ".[test,examples,docs]" \
		| grep --line-buffered -E '^(Collecting|Installing|Successfully|ERROR)' ; test $${PIPESTATUS[0]} -eq 0
	# zennit, the LRP rules' oracle, names torchvision as a dependency: installed without (see constraints.txt)
	$(PIP) install --progress-bar off --disable-pip-version-check -q --no-deps -c constraints.txt zennit
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	@echo "== ruff (a few seconds)"
	$(VENV)/bin/ruff check tdhook_fn tests benchmarks examples

typecheck: $(STAMP)
	@echo "== mypy --strict tdhook_fn (about 30 s, less when cached)"
	$(VENV)/bin/mypy --strict tdhook_fn

unit: $(STAMP)
	@echo "== pytest (about 5,250 tests: 5 to 7 minutes measured on a quiet 2-core machine, up to 15 on a loaded one; the examples and torchrun jobs run last)"
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	@echo "== benchmarks (about 10 minutes; tables print as they finish)"
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/run.py

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir $(SITE_DIR)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
