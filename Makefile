# Two entry points on a fresh machine:
#   make mnist   creates .venv, installs dsgd, builds the op library, trains MNIST
#   make test    same install, then runs the test suite
# and one for the docs site:
#   make docs    creates .venv if needed, installs the docs extra, builds site/ with --strict
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: install mnist test docs clean

# Every installed module, and dsgd's own, is compiled once, here, on all cores (pip alone compiles one module at
# a time: 118 s for the whole install here, against 98 s). The .pyc files must exist: where PYTHONDONTWRITEBYTECODE
# is set (as on our development machine and CI), Python caches nothing it compiles, and every process would compile
# TensorFlow's modules anew (a fresh-clone run, tried: far slower).
$(STAMP): pyproject.toml Makefile $(wildcard dsgd/ops/cc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e ".[test,examples,keras,tune,data,bench]"
	$(PY) -m compileall -qq -j 0 dsgd $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
	$(PY) -m dsgd.ops.build
	touch $(STAMP)

install: $(STAMP)

# The docs extra alone: the API reference is read from the sources (griffe), so the
# op library and the other extras are not needed to build the site.
$(DOCS_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

mnist: install
	$(PY) examples/mnist.py

test: install
	$(PY) -m pytest -q

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) dsgd/ops/_build site
