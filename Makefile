# carve developer entry points. `make test` and `make demo` are the two commands a newcomer needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PRODUCT := driver kubeletplugin controller

.PHONY: test lint typecheck unit demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy $(PRODUCT)

unit: venv
	$(BIN)/pytest -q

# The one test command: lint, strict typing of the product packages, then every test suite.
test: lint typecheck unit

demo: venv
	$(BIN)/carve demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
