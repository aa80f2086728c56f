# The two commands a newcomer needs (README.md):
#   make run    start splitgemma on the default model
#   make test   run the test suite
# Each creates its own virtual environment (.venv) and installs what it needs from the registries.
# Tests run through .venv/bin/pytest (not python -m pytest) so that they import the installed
# package with its compiled core, never the source folder beside it.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.splitgemma-installed
SOURCES := pyproject.toml CMakeLists.txt $(shell find native splitgemma services protos -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.txt' -o -name '*.proto' \) 2>/dev/null)

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet '.[test]'
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest -q tests

run: install
	$(PY) -m splitgemma.demo

clean:
	rm -rf $(VENV) build dist out
