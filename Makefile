# Two commands on a fresh machine with Python >= 3.10 and make: `make demo`, `make test`
# (`make docs` builds the documentation site into site/).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs install clean

install: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# The documentation site (mkdocs.yml, docs/), strict: a broken link or API reference fails.
# mkdocstrings reads keras_strategies; JAX is the quickest backend to import.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 KERAS_BACKEND=jax $(PY) -m mkdocs build --strict --quiet --site-dir site

# The docs build first: it takes seconds, the suite takes minutes.
test: docs
	$(PY) scripts/test_all_backends.py

clean:
	rm -rf $(VENV) site
