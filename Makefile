# Two commands on a fresh machine (see README.md):
#   make demo   - the main job: a real offloaded fine-tune under a VRAM budget (CPU fallback with a note)
#   make test   - lint + every package's tests + tests-integration, CPU-only (what CI runs)
# Both bootstrap .venv with nox from tools/requirements-nox.txt; nox then builds its own environments.

PYTHON ?= python3
VENV := .venv-nox
NOX := $(VENV)/bin/nox

.PHONY: demo test lint gpu bench

$(NOX): tools/requirements-nox.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r tools/requirements-nox.txt
	touch $(NOX)

demo: $(NOX)
	$(NOX) -s demo -- $(ARGS)

test: $(NOX)
	$(NOX) -s lint tests_all

lint: $(NOX)
	$(NOX) -s lint

bench: $(NOX)
	$(NOX) -s bench
