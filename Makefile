# Two entry points on a fresh machine:
#   make mnist   creates .venv, installs dsgd, builds the op library, trains MNIST
#   make test    same install, then runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install mnist test clean

$(STAMP): pyproject.toml Makefile $(wildcard dsgd/ops/cc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,keras,tune,data,bench]"
	$(PY) -m dsgd.ops.build
	touch $(STAMP)

install: $(STAMP)

mnist: install
	$(PY) examples/mnist.py

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) dsgd/ops/_build
