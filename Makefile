# Two commands on a fresh machine with Python >= 3.10 and make: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The lowest supported Keras (keras_strategies/_version.py): `make test` also runs the JAX suite on it.
KERAS_MIN_VENV := .venv-keras-min
KERAS_MIN_PY := $(KERAS_MIN_VENV)/bin/python
KERAS_MIN_STAMP := $(KERAS_MIN_VENV)/.installed

.PHONY: demo test test-keras-min install clean

install: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(KERAS_MIN_STAMP): requirements-keras-min.txt pyproject.toml
	test -x $(KERAS_MIN_PY) || $(PYTHON) -m venv $(KERAS_MIN_VENV)
	$(KERAS_MIN_PY) -m pip install --quiet --upgrade pip
	$(KERAS_MIN_PY) -m pip install --quiet -r requirements-keras-min.txt
	$(KERAS_MIN_PY) -m pip install --quiet --no-deps -e .
	touch $(KERAS_MIN_STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# The three backends on the newest supported Keras, and JAX on the lowest, side by side.
test: $(STAMP) $(KERAS_MIN_STAMP)
	KS_TEST_KERAS_MIN_PYTHON=$(CURDIR)/$(KERAS_MIN_PY) $(PY) scripts/test_all_backends.py

# The JAX suite on the lowest supported Keras alone.
test-keras-min: $(KERAS_MIN_STAMP)
	KS_TEST_BACKENDS=jax-keras-min KS_TEST_KERAS_MIN_PYTHON=$(CURDIR)/$(KERAS_MIN_PY) $(KERAS_MIN_PY) scripts/test_all_backends.py

clean:
	rm -rf $(VENV) $(KERAS_MIN_VENV)
